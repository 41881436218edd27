"""Link and transfer ceilings for the benchmark, measured in the same process as the arms.

Every figure is per device: each device receives only its own KV heads (K / tensor of them), so a delivery's
"bytes per device" is its head share, and GB/s (1e9 B/s) is what one device's link carried. Timings wrap an
eager `jax.device_put` from pinned host memory and a `block_until_ready` on its result.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp

from jaxkv import cache as cache_lib
from jaxkv import chunked
from jaxkv import distributed
from jaxkv import layout as layout_lib
from jaxkv import mesh as mesh_lib
from jaxkv import residency
from jaxkv.cache import KVCache
from jaxkv.config import Config, ModelConfig
from jaxkv.kv_quant import KVFormat
from jaxkv.transport import Transport

TRANSFER_ONLY_DEPTH = 2


def _ones(shape, dtype, out_sharding) -> jax.Array:
  """A device array of ones, created in its sharded layout (never whole on one device)."""
  return jax.jit(lambda: jnp.ones(shape, dtype), out_shardings=out_sharding)()


def _put_seconds(src: jax.Array, dst: jax.sharding.Sharding) -> float:
  t0 = time.perf_counter()
  distributed.move(src, dst).block_until_ready()
  return time.perf_counter() - t0


def _gbps_summary(bytes_per_device: int, seconds: list[float]) -> dict:
  gbps = [bytes_per_device / s / 1e9 for s in seconds]
  return dict(bytes_per_device=bytes_per_device, seconds=seconds, gbps=gbps, gbps_median=statistics.median(gbps))


def h2d_peak(mesh: jax.sharding.Mesh, bytes_per_device: int, reps: int) -> dict:
  """pinned_host -> device GB/s of one `jax.device_put` of u8[T * bytes_per_device] sharded over `tensor`.

  One untimed put, then `reps` timed ones; returns bytes_per_device, seconds, gbps (per sample) and
  gbps_median.
  """
  t = mesh_lib.tensor_size(mesh)
  spec = mesh_lib.P(mesh_lib.TENSOR)
  dev = mesh_lib.NamedSharding(mesh, spec, memory_kind="device")
  host = distributed.move(
      _ones((t * bytes_per_device,), jnp.uint8, dev), mesh_lib.NamedSharding(mesh, spec, memory_kind="pinned_host")
  )
  host.block_until_ready()
  _put_seconds(host, dev)
  seconds = [_put_seconds(host, dev) for _ in range(reps)]
  host.delete()
  return _gbps_summary(bytes_per_device, seconds)


def h2d_chunked(
    model: ModelConfig, kv_dtype: str, mesh: jax.sharding.Mesh, batch: int, rows: int, chunk_rows: int, reps: int
) -> dict:
  """GB/s of one streamed layer's window of `rows` rows (kv_dtype's stored rows, K split over `tensor`) delivered
  as decode delivers it: in chunks of chunk_rows (jaxkv.chunked.chunks, each a jaxkv.cache.rows_to_device call),
  issued back to back and waited for at the end; the window's bytes per device over that time (the chunks' leaf
  overlaps included). One untimed delivery, then `reps`."""
  fmt = KVFormat.of(model, kv_dtype)
  dev = mesh_lib.sharding(mesh, mesh_lib.CACHE_AXES, "device")
  src = _ones((2, batch, model.num_kv_heads, rows, fmt.width), fmt.storage_dtype, dev)
  window = distributed.move(src, mesh_lib.sharding(mesh, mesh_lib.CACHE_AXES, "pinned_host"))
  jax.block_until_ready(window)
  src.delete()
  pieces = chunked.chunks(rows, chunk_rows)

  def seconds() -> float:
    t0 = time.perf_counter()
    jax.block_until_ready([cache_lib.rows_to_device(window, c.first_row, c.rows, dev) for c in pieces])
    return time.perf_counter() - t0

  seconds()
  timed = [seconds() for _ in range(reps)]
  window.delete()
  per_device = rows * cache_lib.row_bytes(model, kv_dtype, batch, mesh_lib.tensor_size(mesh))
  return dict(chunk_rows=chunk_rows, chunks=len(pieces), **_gbps_summary(per_device, timed))


def host_cache_filled(config: Config, mesh: jax.sharding.Mesh, batch: int, rows: int, layout=None) -> KVCache:
  """A host-placement KVCache whose every layer window is ones[2, B, K, rows, E] in pinned_host (E and the dtype
  of config.kv.dtype: the packed rows of a quantized cache, so the bytes moved are the real ones).

  Each layer gets its own host buffer, as in a real cache. Raises ValueError when the pinned pool is too small.
  """
  kv = dataclasses.replace(config.kv, placement="host", host_attention=False, host_attention_fraction=0.0)
  layout = layout or layout_lib.make_layout("tensor", mesh, config.model.num_layers)
  args = (config.model, kv, layout, batch, config.engine.capacity)
  cache = KVCache(*args, placement=residency.place(*args))
  m = config.model
  shape = (2, batch, m.num_kv_heads, rows, cache.row_width)
  for l in range(m.num_layers):  # Each layer in its own stage's memory (split mode layer).
    src = _ones(shape, cache.dtype, cache.device_shardings[l])
    cache.windows[l] = distributed.move(src, cache.host_shardings[l])
    jax.block_until_ready(cache.windows[l])
    src.delete()
  cache.rows = rows
  return cache


def transfer_only_ms(transport: Transport, passes: int) -> float:
  """ms per pass of `passes` back-to-back passes whose compute waits for nothing but the deliveries.

  Deliveries (one per group of layers, jaxkv.residency.decode_groups) run into the next pass as in decode. compute(g)
  waits for the delivery of group g - depth - 1, so at most 2 depth + 2 deliveries are alive: the depth + 1 held here
  and the feeder's depth + 1 slots (decode, whose dispatch of group g waits for its windows, keeps depth + 1 in
  flight). Without that wait the feeder issued every pass
  at once, and on the H200 the clock read passes at 66 GB/s, over the link's peak, alternating with slow ones. The
  clock stops when every delivery has landed.
  """
  held = collections.deque()
  t0 = time.perf_counter()
  for i in range(passes):
    for delivery in transport.deliveries(next_pass=i < passes - 1):
      held.append(delivery.windows)
      if len(held) > transport.depth + 1:
        jax.block_until_ready(held.popleft())
  jax.block_until_ready(list(held))
  return 1e3 * (time.perf_counter() - t0) / passes


def cell_ceilings(
    config: Config, mesh: jax.sharding.Mesh, batch: int, rows: int, reps: int, passes: int, layout=None
) -> dict:
  """Ceilings for one (context, batch) cell whose decode delivers windows of `rows` rows per layer.

  h2d_layer: GB/s of single per-layer deliveries (`reps` puts of windows[l], layers in turn).
  transfer_only: ms per step of Transport(depth=2) passes with no compute (transfer_only_ms bounds the deliveries
    in flight), median of `reps` runs of `passes` passes (after one untimed run); also the transport's summary (depth
    after any fallback).
  """
  if rows == 0:
    return dict(window_rows=0, skipped="the decode window is empty (context < kv.block): nothing is delivered")
  cache = host_cache_filled(config, mesh, batch, rows, layout)
  n = config.model.num_layers
  _put_seconds(cache.windows[0], cache.device_shardings[0])
  seconds = [_put_seconds(cache.windows[i % n], cache.device_shardings[i % n]) for i in range(reps)]
  # Every layer's window has the same bytes per device of its stage (all heads in split mode layer).
  layer = _gbps_summary(cache.windows[0].nbytes // len(cache.device_shardings[0].device_set), seconds)
  transport = Transport(cache, TRANSFER_ONLY_DEPTH)
  transfer_only_ms(transport, passes)
  ms = [transfer_only_ms(transport, passes) for _ in range(reps)]
  out = dict(
      window_rows=rows,
      h2d_layer=layer,
      transfer_only=dict(ms=ms, ms_median=statistics.median(ms), passes=passes, **transport.summary()),
  )
  for w in cache.windows:
    w.delete()
  return out
