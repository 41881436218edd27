"""Saved slots (llama-server's POST /slots/{id}?action=save|restore|erase): a conversation's KV rows in a file.

A slot remembers the tokens of the request it served last, prompt and generated (jaxkv.serving.loop). Its KV lives on
as prefix-cache blocks (jaxkv.serving.prefix_cache: engine.prefill_chunk tokens each), so saving a conversation of T
tokens saves its n = T // C whole blocks, C = prefill_chunk: `Save` takes each block from the prefix cache or, where
it is not there, prefills it by a request's programs (jaxkv.serving.slots.SlotFiller.block: the bits of a cold
prefill) and reads it back, one block per unit of work; `write` puts them in a file. `read` checks a file and
`Restore` puts its blocks into the prefix cache, first checking that this model computes block 0's bits as the file
holds them (another checkpoint or config gives other rows). A later request whose prompt starts with the conversation
then prefills only its tail past the last whole block, with the bits of a server that never saved. `Erase` drops the
conversation's blocks from the prefix cache.

The jobs run on the engine thread, one unit (at most one prefill chunk and one block's transfer) between two decode
steps (jaxkv.serving.server.Run.work); the file is read and written elsewhere (the API's worker threads).

File (safetensors): "tokens" i64[T]; "layer.{l}" [2, 1, K, n C, E] (layer l's rows of the n blocks, the cache's
dtype); metadata "format" (FORMAT) and "fingerprint" (`fingerprint`: what shapes the rows).
"""

from __future__ import annotations

import abc
import concurrent.futures
import dataclasses
import hashlib
import json
import os

import jax
import numpy as np
import safetensors
import safetensors.numpy

FORMAT = "jaxkv.slot.v1"


def fingerprint(config) -> str:
  """sha256 of what a block's rows depend on besides the weights (jaxkv.config.Config): the model's config, the
  prefill chunk and the KV dtype (Restore compares the rows themselves for the rest)."""
  what = dict(
      model=dataclasses.asdict(config.model), prefill_chunk=config.engine.prefill_chunk, kv_dtype=config.kv.dtype
  )
  return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


def path_in(directory: str, filename: str) -> str:
  """The path of `filename` in `directory`; ValueError for a name that is not a plain file name there."""
  if not isinstance(filename, str) or filename in ("", ".", "..") or any(c in filename for c in "/\\\0"):
    raise ValueError(f"filename {filename!r} is not a plain file name; give one without folders, e.g. chat1.bin")
  return os.path.join(directory, filename)


@dataclasses.dataclass(frozen=True)
class Saved:
  """A conversation: tokens (T) and its blocks' rows, blocks[i][l]: block i of layer l [2, 1, K, C, E] (numpy)."""

  tokens: tuple[int, ...]
  blocks: list[list[np.ndarray]]


def write(path: str, saved: Saved, fp: str) -> int:
  """Writes `saved` to `path` (through a temporary file, then renamed); returns the bytes written. fp: the model's
  fingerprint."""
  tensors = {"tokens": np.asarray(saved.tokens, np.int64)}
  for l in range(len(saved.blocks[0]) if saved.blocks else 0):
    tensors[f"layer.{l}"] = np.concatenate([b[l] for b in saved.blocks], axis=3)
  partial = f"{path}.partial"
  safetensors.numpy.save_file(tensors, partial, metadata={"format": FORMAT, "fingerprint": fp})
  os.replace(partial, path)
  return os.path.getsize(path)


def read(path: str, fp: str, block: int) -> tuple[Saved, int]:
  """The conversation saved at `path` and the file's bytes; FileNotFoundError, ValueError for a file that is not a
  slot file or was saved by another model or config (fp: this model's fingerprint; block: its prefill chunk)."""
  name = os.path.basename(path)
  try:
    with safetensors.safe_open(path, "numpy") as f:
      meta = f.metadata() or {}
      if meta.get("format") != FORMAT:
        raise ValueError(f"{name!r} is not a jaxkv slot file")
      if meta.get("fingerprint") != fp:
        raise ValueError(f"{name!r} was saved by another model or config; restore it on a server of that model")
      tokens = f.get_tensor("tokens")
      layers = [f.get_tensor(f"layer.{l}") for l in range(sum(k.startswith("layer.") for k in f.keys()))]
  except safetensors.SafetensorError as e:
    raise ValueError(f"{name!r} is not a jaxkv slot file ({e})") from e
  n = len(tokens) // block
  if any(a.shape[3] != n * block for a in layers) or (n and not layers):
    raise ValueError(f"{name!r} is damaged: its rows do not cover its {len(tokens)} tokens")
  blocks = [[a[:, :, :, i * block : (i + 1) * block] for a in layers] for i in range(n)]
  return Saved(tuple(int(t) for t in tokens), blocks), os.path.getsize(path)


class Job(abc.ABC):
  """Work for the engine thread: `advance(filler)` does one unit (a jaxkv.serving.slots.SlotFiller of the prefix
  cache's server) and returns whether the job is done; `future` then has its result, or the error it raised."""

  def __init__(self):
    self.future: concurrent.futures.Future = concurrent.futures.Future()

  @abc.abstractmethod
  def advance(self, filler) -> bool:
    """One unit of the job; True once it is done (its future set)."""


class Save(Job):
  """The blocks of a conversation's `tokens`, read back one per unit; its result: Saved."""

  def __init__(self, tokens):
    super().__init__()
    self.tokens, self._rows, self._host = tuple(tokens), [], []

  def advance(self, filler) -> bool:
    if filler.prefix_cache is None:
      raise ValueError("saving a slot needs the prefix cache: give --prefix_cache_gib")
    i = len(self._rows)
    if i < len(self.tokens) // filler.prefix_cache.block:
      self._rows.append(filler.block(self.tokens, i, self._rows))
      self._host.append(jax.device_get(self._rows[-1]))
      return False
    self.future.set_result(Saved(self.tokens, self._host))
    return True


class Restore(Job):
  """Puts a saved conversation's blocks into the prefix cache, one per unit, after checking block 0's bits against
  this model's; its result: the conversation's tokens."""

  def __init__(self, saved: Saved, filename: str):
    super().__init__()
    self.saved, self.filename, self._first, self._next = saved, filename, None, 0

  def advance(self, filler) -> bool:
    pc, blocks = filler.prefix_cache, self.saved.blocks
    if pc is None:
      raise ValueError("restoring a slot needs the prefix cache: give --prefix_cache_gib")
    if self._next == 0 and blocks:
      nbytes = sum(a.nbytes for a in blocks[0]) * len(blocks)
      if nbytes > pc.budget_bytes:
        raise ValueError(
            f"{self.filename!r} holds {nbytes / 2**20:.1f} MiB of KV rows, more than the prefix cache's "
            f"{pc.budget_bytes / 2**20:.1f} MiB; raise --prefix_cache_gib"
        )
      self._first = filler.block(self.saved.tokens, 0, [])
      mine = jax.device_get(self._first)
      if any(a.dtype != b.dtype or a.tobytes() != b.tobytes() for a, b in zip(mine, blocks[0])):
        raise ValueError(f"{self.filename!r} holds KV rows this model does not compute: saved by another checkpoint")
      self._next = 1
      return False
    if self._next < len(blocks):
      i, keys = self._next, pc.keys(self.saved.tokens, self._next + 1)
      if pc.entry(keys[i]) is None:
        rows = [jax.device_put(np.ascontiguousarray(a), r.sharding) for a, r in zip(blocks[i], self._first)]
        pc.add(keys, [rows], sum(a.nbytes for a in rows))
      self._next += 1
      return False
    self.future.set_result(self.saved.tokens)
    return True


class Erase(Job):
  """Drops a conversation's blocks from the prefix cache (those no request copies now); its result: its tokens."""

  def __init__(self, tokens):
    super().__init__()
    self.tokens = tuple(tokens)

  def advance(self, filler) -> bool:
    pc = filler.prefix_cache
    if pc is not None:
      pc.drop(pc.keys(self.tokens, len(self.tokens) // pc.block))
    self.future.set_result(len(self.tokens))
    return True
