"""A request entering a slot: its prompt prefilled alone, its rows put into the slot (jaxkv.cache.KVCache.insert_slot).

Every request is prefilled at rows [0, L) of a scratch generation of one sequence, the epoch's one (made at the first
request, cleared for each), its chunks aligned to its position 0 (jaxkv.engine.Engine.prefill_slot), with the prefix
cache its first whole blocks taken from there (jaxkv.serving.prefix_cache) and its new whole blocks stored there; its
rows are then moved to [E - L, E) of slot b of the epoch's cache (jitted.Fns.place), layer by layer as the prefill
yields them, so that slot b of a layer is replaced while the next layers compute. A prompt's rows, and its last
hidden state, never depend on where it enters, on the requests beside it or on the prefix cache.

Positions are r - start[b], so a request sees the same positions, keys and values as when decoded alone.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxkv import sampling
from jaxkv.host import memory
from jaxkv.serving import prefix_cache as prefix_cache_lib


def check_prefix_cache_budget(nbytes: int) -> None:
  """ValueError for a prefix cache budget below 0 or past this backend's pinned host pool (run after the platform
  is set)."""
  if nbytes < 0:
    raise ValueError(f"the prefix cache budget must be >= 0, got {nbytes} B")
  pool = memory.pool_limit_bytes()
  if pool is not None and nbytes >= pool:
    raise ValueError(
        f"the prefix cache budget ({nbytes / 2**30:.2f} GiB) does not fit the pinned host pool ({pool / 2**30:.2f} "
        f"GiB) beside the KV cache; lower --prefix_cache_gib or raise {memory.POOL_ENV}"
    )


@dataclasses.dataclass
class _Shared:
  """A prompt's prefill kept for the fills that share it (SlotFiller.fill's shares): the prefill (iterated), the
  layers it yielded, and how many fills may still take them."""

  prompt: tuple[int, ...]
  run: object
  layers: list
  left: int


class SlotFiller:
  """Prefills requests alone and puts their rows into slots of one epoch's cache; close() it with the epoch.

  engine: jaxkv.engine.Engine; prefix_cache: a PrefixCache or None; counters, shapes: the run's (the scratch
  generation's passes count there)."""

  def __init__(self, engine, prefix_cache: prefix_cache_lib.PrefixCache | None, counters, shapes: set):
    self.engine, self.prefix_cache, self.counters, self.shapes = engine, prefix_cache, counters, shapes
    self._scratch = None
    self._shared: _Shared | None = None

  def scratch(self):
    """The epoch's generation of one sequence. With the prefix cache its cache lives on the devices (the same bits in
    every placement): a prompt's window arrives there from the prefix cache's blocks, and would otherwise be stored
    to host memory and delivered back for the next chunk. The price: one prompt's rows in device memory."""
    if self._scratch is None:
      kv = self.engine.config.kv
      if self.prefix_cache is not None:
        kv = dataclasses.replace(kv, placement="device", host_attention=False, host_attention_fraction=0.0)
      self._scratch = self.engine.start(1, kv=kv, counters=self.counters, shapes=self.shapes)
    self._scratch.cache.clear()
    return self._scratch

  def fill(self, cache, slot: int, prompt, end: int, hidden: list | None = None, shares: int = 0) -> jax.Array:
    """Prefills `prompt` alone from row 0 and puts its rows at [end - L, end) of slot `slot` of `cache`
    (jaxkv.cache.KVCache) and into its open page; returns the hidden state of its last row [1, D]. hidden: a list
    that gets every row's (Engine.prefill's; the prefix cache is then neither read nor written: every row is
    computed). shares: the next `shares` fills of the same prompt (without hidden) take these rows instead of
    computing them (Engine.refill_slot): n samples of one prompt share its prefill, at the price of its rows kept in
    device memory until then (or until another prompt shares its own, or the epoch ends)."""
    eng, pc, prompt = self.engine, self.prefix_cache, tuple(prompt)
    shared = self._shared
    if hidden is None and shared is not None and shared.prompt == prompt:
      shared.left -= 1
      if not shared.left:
        self._shared = None
      return eng.refill_slot(self.scratch(), cache, slot, shared.run, shared.layers, len(prompt), end)
    layers = []  # With shares: the layers the prefill yields (else not kept: each layer's rows leave as it ends).
    if pc is None or hidden is not None:
      run = eng.prefill_slot(self.scratch(), cache, slot, prompt, end, hidden=hidden)
      for layer in run:
        if shares:
          layers.append(layer)
        del layer  # Else held while the next layer computes.
      self._share(prompt, run, layers, shares)
      return run.x
    chunk = eng.config.engine.prefill_chunk
    keys, hit = pc.match(prompt)
    fresh = [[] for _ in range(len(hit), len(keys))]  # Per new block, its rows of each layer.
    try:
      prefix = self._to_devices([e.rows for e in hit])
      run = eng.prefill_slot(self.scratch(), cache, slot, prompt, end, first=len(hit), prefix=prefix)
      for layer in run:
        if shares:
          layers.append(layer)
        fns = eng.layer_fns(layer.layer)
        for i, rows in enumerate(fresh):
          rows.append(fns.block(layer.window, layer.chunk, np.int32(layer.pad + (len(hit) + i) * chunk), size=chunk))
        del layer
      if fresh:  # Its own blocks stay pinned meanwhile: a block is not evicted to make room for its children.
        pc.add(keys, fresh, sum(a.nbytes for a in fresh[0]))
    finally:
      pc.release(hit)
    self._share(prompt, run, layers, shares)
    return run.x

  def block(self, tokens, i: int, before: list[list]) -> list:
    """Block i of `tokens` (rows [i C, (i + 1) C), C = engine.prefill_chunk), per layer [2, 1, K, C, E] in pinned
    host memory: the prefix cache's entry, else prefilled after `before` (blocks 0 .. i - 1, each per layer) by the
    programs of a request's prefill (chunk i alone, its window those blocks: the bits of a cold prefill) and stored in
    the prefix cache. One chunk's work: a saved slot's blocks, one between two decode steps
    (jaxkv.serving.slot_files)."""
    eng, pc, chunk = self.engine, self.prefix_cache, self.engine.config.engine.prefill_chunk
    keys = pc.keys(tokens, i + 1)
    entry = pc.entry(keys[i])
    if entry is not None:
      return entry.rows
    ids = np.asarray(tokens[: (i + 1) * chunk], np.int32)[None]
    run = eng.prefill(
        self.scratch(), ids, np.zeros(1, np.int32), (i + 1) * chunk, first=i, prefix=self._to_devices(before)
    )
    rows = [
        eng.layer_fns(layer.layer).block(layer.window, layer.chunk, np.int32(layer.pad + i * chunk), size=chunk)
        for layer in run
    ]
    pc.add(keys, [rows], sum(a.nbytes for a in rows))
    return rows

  def _to_devices(self, blocks: list[list]) -> list | None:
    """Blocks' rows (blocks[i][l]: block i of layer l, in pinned host memory) as the prefill's `prefix`: per layer,
    its blocks on the devices (None without blocks). Every layer's blocks start moving now, one transfer a layer on
    the host-to-device copy stream; the prefill joins each layer's just before its first chunk, so the transfers run
    behind the earlier layers."""
    if not blocks:
      return None
    layers = [[rows[l] for rows in blocks] for l in range(self.engine.config.model.num_layers)]
    return [jax.device_put(rows, rows[0].sharding.with_memory_kind("device")) for rows in layers]

  def _share(self, prompt: tuple, run, layers: list, shares: int) -> None:
    if shares:
      self._shared = _Shared(prompt, run, layers, shares)

  def prompt_logprobs(self, prompt, hidden: list, top: int) -> list:
    """The log-probability of each prompt token after the ones before it (None for the first) and the `top` most
    likely tokens there (jaxkv.sampling.logprobs's), from `hidden` (fill's: the chunks' rows [1, C, D]) through the
    head, one call and one read per chunk (one chunk's logits f32[C, V] on the host at a time)."""
    eng, entries, row = self.engine, [None], 0  # row: the prompt row of the chunk's first.
    for x in hidden:
      logits = jax.device_get(eng.fns.logits(eng.top_last, x))[0]
      for i in range(row, min(row + len(logits), len(prompt) - 1)):
        entries.append(sampling.logprobs(logits[i - row], prompt[i + 1], top))
      row += len(logits)
    return entries

  def close(self) -> None:
    self._shared = None
    if self._scratch is not None:
      self._scratch.close()
