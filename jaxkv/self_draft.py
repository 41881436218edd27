"""Self-speculation (speculate.mode self, as in QuantSpec and TriForce): the run's own model drafts over a second
cache, an int4 copy of the KV (config.SELF_DRAFT_KV_DTYPE, jaxkv.kv_quant) resident in device memory while the exact
cache streams; jaxkv.spec_decode verifies the drafts on the exact cache.

The draft generation is a second engine on the same weights, mesh and layout whose kv is int4 with placement device
(`draft_config`), batch as the run's. It is filled after the run's prefill (`begin`) by quantizing the exact cache's
rows, layer by layer (`_quantize_fn`: each window moved to the devices once, unpacked and packed as int4; the open
pages likewise): one read of the exact cache over the link and no model compute, where a second prefill would
compute the prompt again (its attention quadratic in the context: minutes at 1M); and each row is the int4 of the
exact row, closer to it than an int4 prefill's rows (whose attention already reads int4 rows). Each pass
(`propose_batch`) runs one-token steps on it, the plain decode programs of an int4 device cache
(jaxkv.decode.decode_pass) with a greedy argmax on the device between them (`_next_fn`; no sampling state): first
the verified tokens it lacks, then each row's known tokens (its last recorded one and its pending ones), then its
own drafts; the tokens go back to the host once, after the last step.

Rollback: the draft cache's `end` moves back to the exact cache's (rows below it hold verified tokens); the rows of
accepted drafts are the draft's own (a draft step wrote each accepted token at its row from the rows below it, as a
plain int4 step would), and the verified tokens it never wrote (the pass's last accepted one, or every token of
passes without drafts) are written by the next pass's first steps. Its pages fill on its own steps: a draft step
writes at most cap rows past the exact end (spec_decode keeps them two rows below the page's end), so only steps of
verified tokens write a page's last row and grow its windows, as the plain loop does.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import cache as cache_lib
from jaxkv import decode
from jaxkv import distributed
from jaxkv import mesh as mesh_lib
from jaxkv import model
from jaxkv import residency
from jaxkv.config import SELF_DRAFT_KV_DTYPE, Config
from jaxkv.kv_quant import KVFormat


def draft_config(config: Config) -> Config:
  """The draft engine's config: the run's, with an int4 KV in device memory and no speculation."""
  kv = dataclasses.replace(
      config.kv,
      dtype=SELF_DRAFT_KV_DTYPE,
      placement="device",
      host_attention=False,
      host_attention_fraction=0.0,
      device_budget_gib=None,
  )
  return dataclasses.replace(config, kv=kv, speculate=dataclasses.replace(config.speculate, mode="off"))


def cache_bytes(config: Config, layout, batch: int) -> int:
  """Device bytes per device of a draft cache of `batch` rows at config.engine.capacity (its windows and open pages
  at their bound, cache.rows_bound), the fullest stage's layers."""
  tensor = mesh_lib.tensor_size(layout.mesh(0))
  row = cache_lib.row_bytes(config.model, SELF_DRAFT_KV_DTYPE, batch, tensor)
  layers = max(layout.stage_of.count(s) for s in range(len(layout.meshes)))
  return row * cache_lib.rows_bound(config.engine.capacity, config.kv.block) * layers


def check_fits(config: Config, layout, batch: int) -> int:
  """The draft cache's bytes per device (cache_bytes); ValueError where they exceed the free memory of the fullest of
  this process's devices less kv.headroom_mib (devices that report no memory: no check)."""
  need = cache_bytes(config, layout, batch)
  devices = sorted({d for m in layout.meshes for d in m.local_devices}, key=lambda d: d.id)
  free = residency.free_device_bytes(devices)
  headroom = config.kv.headroom_mib
  if free is not None and need > free - headroom * 2**20:
    raise ValueError(
        f"--speculate=self: the {SELF_DRAFT_KV_DTYPE} draft cache takes {need / 2**20:.0f} MiB per device, more than "
        f"the free device memory {free / 2**20:.0f} MiB - --kv_headroom_mib={headroom}; lower engine.capacity or "
        "the batch, or use --speculate=lookup"
    )
  return need


@functools.lru_cache(maxsize=None)
def _quantize_fn(cfg, kv_dtype: str, rows: int, sharding: jax.sharding.Sharding):
  def quantize(stored):
    """stored [2, B, K, A, E] in kv_dtype, rows [W - A, W) -> [2, B, K, rows, E'] in int4, rows [W - rows, W) (rows
    >= W: the rows dropped or added in front are start padding, zeros)."""
    src, dst = KVFormat.of(cfg, kv_dtype), KVFormat.of(cfg, SELF_DRAFT_KV_DTYPE)
    x = stored if src.name == dst.name else dst.pack(src.unpack(stored))
    return cache_lib.pad_front(x[:, :, :, max(x.shape[3] - rows, 0) :], rows)

  return jax.jit(quantize, out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _next_fn(cfg, sharding: jax.sharding.Sharding):
  def nxt(top, y, forced, force):
    """y [B, D], a draft step's output -> the next step's tokens i32[B] (forced i32[B] where force bool[B], else y's
    largest logit) and their embeddings [B, D]."""
    greedy = jnp.argmax(model.logits(top, y, cfg), axis=-1).astype(jnp.int32)
    tokens = jnp.where(force, forced, greedy)
    return tokens, model.embed(top, tokens)

  return jax.jit(nxt, out_shardings=sharding)


class SelfDraft:
  """The self-speculation drafter of an engine (module docstring), for jaxkv.spec_decode.Speculator: `begin` after
  the run's prefill, `propose_batch` each pass, `close` after the run; `summary` for the telemetry."""

  def __init__(self, engine):
    self.engine = type(engine)(draft_config(engine.config), engine.mesh, engine.params, engine.layout)
    self.gen = None
    self.bytes_per_device, self.fill_s, self.steps, self.caught_up = 0, 0.0, 0, 0

  def begin(self, gen) -> None:
    """After the run's prefill, generation `gen` (jaxkv.engine.Generation, prefilled): the draft cache gets the int4
    quantization of its rows, and its start and end; ValueError where it does not fit (check_fits)."""
    eng, exact = self.engine, gen.cache
    self.bytes_per_device = check_fits(eng.config, eng.layout, len(gen.start))
    t0 = time.perf_counter()
    self.gen = eng.start(len(gen.start))
    draft = self.gen.cache
    fmt = exact.kv.dtype
    for l in range(exact.model.num_layers):
      window = exact.windows[l]
      if window is not None:
        if exact.streamed[l]:
          window = exact.full_window(l, distributed.move(window, exact.device_shardings[l]))
        draft.windows[l] = _quantize_fn(exact.model, fmt, draft.window_rows(exact.rows, l), draft.device_shardings[l])(
            window
        )
      draft.opens[l] = _quantize_fn(exact.model, fmt, exact.block, draft.device_shardings[l])(exact.opens[l])
      jax.block_until_ready(draft.opens[l])  # One layer's exact window on the devices at a time.
    draft.rows, self.gen.start, self.gen.end = exact.rows, gen.start.copy(), gen.end
    self.fill_s = time.perf_counter() - t0

  def propose_batch(self, histories: dict[int, list[int]], wants: dict[int, int], end: int) -> dict[int, list[int]]:
    """Row b's greedy continuation of histories[b] (its prompt, recorded tokens and pending ones), wants[b] tokens,
    for every row of `histories` (the other rows' steps write token 0, then their own tokens); the exact cache holds verified rows below `end`,
    the row of the last recorded token. Returns {b: up to wants[b] tokens}."""
    eng, gen = self.engine, self.gen
    batch = len(gen.start)
    gen.end = min(gen.end, end)  # Rollback: rows from the exact end on held drafts.
    first = gen.end
    klen = np.zeros(batch, np.int64)  # Row b's known tokens from row `first` on: verified, last recorded, pending.
    for b, h in histories.items():
      klen[b] = len(h) - (first - int(gen.start[b]))
    steps = max(int(klen[b]) - 1 + wants[b] for b in histories)
    known = np.zeros((batch, steps + 1), np.int32)
    for b, h in histories.items():
      known[b, : klen[b]] = h[first - int(gen.start[b]) :]
    nxt = _next_fn(eng.config.model, mesh_lib.replicated(eng.layout.last))
    x, outs = eng.embed(known[:, 0]), []
    for j in range(steps):  # Step j writes row first + j; its output is the token of row first + j + 1.
      y, _ = decode.decode_pass(eng, gen, x, eng.meta(gen.start, gen.end), next_pass=False, run_ahead=False)
      tokens, x = nxt(eng.top_last, y, eng.put(known[:, j + 1], np.int32), eng.put(j + 1 < klen, bool))
      outs.append(tokens)
    self.steps, self.caught_up = self.steps + steps, self.caught_up + end - first
    inputs = np.asarray(jax.device_get(outs)).T  # [B, steps]: the tokens of rows first + 1 .. first + steps.
    return {b: inputs[b, klen[b] - 1 : klen[b] - 1 + wants[b]].tolist() for b in histories}

  def close(self) -> None:
    if self.gen is not None:
      self.gen.close()
      self.gen = None

  def summary(self) -> dict:
    """The draft cache's KV dtype and device bytes per device, the seconds its fill took, the draft steps run and,
    of them, those that wrote verified tokens it lacked."""
    return dict(
        kv_dtype=SELF_DRAFT_KV_DTYPE,
        bytes_per_device=self.bytes_per_device,
        fill_s=self.fill_s,
        steps=self.steps,
        caught_up=self.caught_up,
    )
