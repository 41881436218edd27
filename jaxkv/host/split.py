"""The host's share of each window for host attention, chosen at start from rates measured on this machine.

With host attention a decode step moves (1 - f) of each streamed window over the link while the CPU attends the other
f in place (jaxkv.host.attention), then the devices merge the two partials. For one layer whose window holds W bytes
per device, with s = W / link, k = local W / cpu (the kernel reads the process's `local` head shards) and c the
fixed cost of a split layer's round trip (the query's call and its copy to the host, the kernel's call, the
hand-back, the merge's call: all on the path from one layer's kernel to the next), the model is

  streaming alone:   t = s
  split at f:        t(f) = max((1 - f) s, c + f k)   ->   f* = (s - c) / (s + k),   gain = s / t(f*).

A window whose predicted gain is under MIN_GAIN is not split (f = 0): it streams like any other, and where that holds
for the largest window a cache can reach, host attention is off for it (jaxkv.host.decode). `measure` runs the kernel
and the link side by side on one layer's worth of rows (SAMPLE_BYTES per device; each slows the other: they share the
host's memory) and times FIXED_RUNS round trips of the path, once per process and (shardings, format, threads); with
several processes, process 0's figures decide for all. With kv.host_attention_threads = 0 the kernel's threads are
chosen too: the candidate (ENGINE_THREADS and two and four fewer, leaving cores to the dispatching thread, the feeder
and XLA's own threads) with the largest predicted gain.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from jaxkv import distributed
from jaxkv.host import attention
from jaxkv import mesh as mesh_lib
from jaxkv.kv_quant import KVFormat

SAMPLE_BYTES = 64 * 2**20  # Stored rows per device to measure on: about one layer's window at long context.
MAX_FRACTION = 0.95  # A share of rows is always delivered: the device also attends the open page.
MIN_GAIN = 1.03  # A window whose predicted gain over streaming alone is smaller is not split.
FIXED_RUNS = 32  # Round trips timed for the fixed cost c.
_WEIGHT_ARGS = 9  # A layer's weight arrays: what each of its calls takes.
THREAD_STEPS = (0, 2, 4)  # Kernel threads tried with kv.host_attention_threads = 0: ENGINE_THREADS minus these.
_KERNEL_RUNS = 3
_MAX_COPIES = 16  # Copies in flight while measuring together: at most 1 GiB per device.


@dataclasses.dataclass(frozen=True)
class Split:
  """How a cache's streamed windows are split. source: "measured" (the model's f for each window, from cpu_gbps and
  link_gbps, rates measured together, GB/s = 1e9 B/s of stored rows, the link's per device and the CPU's over
  `local` head shards, and fixed_ms, a split layer's fixed cost) or "override" (`fraction` for every window)."""

  source: str
  threads: int
  fraction: float | None = None
  cpu_gbps: float | None = None
  link_gbps: float | None = None
  fixed_ms: float | None = None
  local: int = 1

  def share(self, window_bytes: int) -> float:
    """f for a window of `window_bytes` per device (one layer, every sequence): the override, or the model's
    optimum, 0 where its predicted gain is under MIN_GAIN."""
    if self.source == "override":
      return self.fraction
    return self.optimum(window_bytes) if self.gain(window_bytes) >= MIN_GAIN else 0.0

  def optimum(self, window_bytes: int) -> float:
    """The model's f* = (s - c) / (s + k), within [0, MAX_FRACTION]."""
    s, k = self._seconds(window_bytes)
    return min(max((s - self.fixed_ms / 1e3) / (s + k), 0.0), MAX_FRACTION) if window_bytes > 0 else 0.0

  def gain(self, window_bytes: int, f: float | None = None) -> float:
    """Predicted step time of streaming alone over that of the split at f (default the optimum)."""
    f = self.optimum(window_bytes) if f is None else f
    s, k = self._seconds(window_bytes)
    return s / max((1 - f) * s, self.fixed_ms / 1e3 + f * k) if f else 1.0

  def _seconds(self, window_bytes: int) -> tuple[float, float]:
    """(s, k): the window's seconds over the link, and in the kernel over the `local` head shards the CPU reads."""
    if self.cpu_gbps is None:
      raise ValueError("an override split has no model")
    return window_bytes / (self.link_gbps * 1e9), self.local * window_bytes / (self.cpu_gbps * 1e9)

  def summary(self, window_bytes: int) -> dict:
    """The fields, with a measured split's share (`fraction`, 0 where off) and the predicted gain of its optimum at
    `window_bytes`."""
    out = dataclasses.asdict(self)
    if self.source == "measured":
      out.update(window_bytes=window_bytes, fraction=self.share(window_bytes), predicted_gain=self.gain(window_bytes))
    return out


def split(
    fraction: float,
    threads: int,
    host: jax.sharding.NamedSharding,
    device: jax.sharding.NamedSharding,
    fmt: KVFormat,
    groups: int,
    window_bytes: int,
) -> Split:
  """The override when fraction > 0, else the measured split; threads > 0 is the kernel's, 0 chooses them (the
  candidate with the largest predicted gain for a window of `window_bytes` per device, the largest the cache
  reaches). ValueError past numba's pool."""
  base = attention.engine_threads(threads)
  if jax.process_count() > 1:  # The same candidates, hence the same collective measurements, in every process.
    base = int(multihost_utils.broadcast_one_to_all(np.int32(base)))
  candidates = [base] if threads else sorted({max(1, base - d) for d in THREAD_STEPS}, reverse=True)
  if fraction:
    return Split("override", candidates[0], fraction)
  measured = [measure(host, device, fmt, groups, t) for t in candidates]
  return max(measured, key=lambda s: s.gain(window_bytes))


@functools.lru_cache(maxsize=None)
def measure(
    host: jax.sharding.NamedSharding, device: jax.sharding.NamedSharding, fmt: KVFormat, groups: int, threads: int
) -> Split:
  """Measures the kernel on `threads` threads over SAMPLE_BYTES of `fmt` rows per device (host: the cache's
  pinned_host sharding of a window [2, B, K, W, E]; groups: query heads per KV head, G, which sets the kernel's
  arithmetic per row) while the same rows stream to `device`, and a split layer's fixed cost; returns the Split."""
  mesh = host.mesh
  t = mesh_lib.tensor_size(mesh)
  heads = t  # One KV head per device shard: the kernel's and the link's rates are per byte, not per head.
  rows = max(SAMPLE_BYTES // (2 * fmt.row_bytes), attention.ROW_BLOCK)
  shape = (2, 1, heads, rows, fmt.width)
  window = jax.jit(lambda: jnp.zeros(shape, fmt.storage_dtype), out_shardings=device)()
  window = distributed.move(window, host)
  window.block_until_ready()
  q = np.zeros((1, heads, groups, fmt.head_dim), np.float32)
  start = np.zeros(1, np.int32)
  per_device = window.nbytes // t

  def attend():  # On the engine's kernel thread: see attention.WORKER.
    attention.WORKER.submit(attention.attend_array, window, q, start, 0, rows, fmt, threads).result()

  def stream(n):
    return [distributed.move(window, device) for _ in range(n)]

  def seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0

  def together(n) -> tuple[float, float]:
    """Kernel runs while n copies are in flight: (kernel seconds for _KERNEL_RUNS runs, link seconds for n)."""
    t0 = time.perf_counter()
    copies = stream(n)
    for _ in range(_KERNEL_RUNS):
      attend()
    t_cpu = time.perf_counter() - t0
    jax.block_until_ready(copies)
    return t_cpu, time.perf_counter() - t0

  attend()  # Compiles the kernel for this format, and warms both paths.
  jax.block_until_ready(stream(1))
  # Best of a few runs each: a single run can land on a busy moment (seen on the H200 host: 3 GB/s once, 27 another).
  cpu_alone = min(seconds(attend) for _ in range(_KERNEL_RUNS))
  link_alone = min(seconds(lambda: jax.block_until_ready(stream(1))) for _ in range(_KERNEL_RUNS))
  # More copies in flight than the kernel's runs take, so that the link's time is its own (it is read after the
  # kernel's runs): biased low only where the cap cuts in.
  n = min(_MAX_COPIES, math.ceil(_KERNEL_RUNS * cpu_alone / link_alone) + 1)
  runs = [together(n) for _ in range(2)]
  t_cpu, t_link = min(r[0] for r in runs), min(r[1] for r in runs)
  fixed = _fixed_seconds(window, q, start, fmt, threads)
  # The CPU reads every local head shard; each device's link carries its own share, all in parallel.
  local = len({shard.index[2].indices(heads) for shard in window.addressable_shards})
  window.delete()
  figures = np.array(
      [_KERNEL_RUNS * local * per_device / t_cpu / 1e9, n * per_device / t_link / 1e9, fixed * 1e3, local]
  )
  if jax.process_count() > 1:  # Every process must split at the same rows: process 0's figures decide.
    figures = np.asarray(multihost_utils.broadcast_one_to_all(figures))
  cpu_gbps, link_gbps, fixed_ms = (float(v) for v in figures[:3])
  local = int(figures[3])
  logging.info(
      "host attention, %d kernel threads: cpu %.1f GB/s and link %.1f GB/s per device x %d, measured together "
      "(alone: %.1f and %.1f), a split layer's fixed cost %.3f ms",
      threads,
      cpu_gbps,
      link_gbps,
      local,
      local * per_device / cpu_alone / 1e9,
      per_device / link_alone / 1e9,
      fixed_ms,
  )
  return Split("measured", threads, None, cpu_gbps, link_gbps, fixed_ms, local)


def _fixed_seconds(window: jax.Array, q: np.ndarray, start: np.ndarray, fmt: KVFormat, threads: int) -> float:
  """Seconds of one round trip of a split layer's path with one row block on each side, the median of FIXED_RUNS in
  a row: a device call writes q to pinned host memory; the kernel's worker waits for it and attends one row block of
  `window` while a device call attends a block delivered from pinned host memory (issued before the query, as the
  feeder does); a device call takes the host's partial back. Each call takes a layer's weights' worth of arguments
  (_WEIGHT_ARGS arrays), and each trip starts from the last one's result."""
  mesh = window.sharding.mesh
  device = mesh_lib.sharding(mesh, (), "device")
  pinned = mesh_lib.sharding(mesh, (mesh_lib.BATCH, mesh_lib.KV_HEADS, None, None), "pinned_host")
  on_device = window.sharding.with_memory_kind("device")
  shape = (*window.shape[:3], attention.ROW_BLOCK, window.shape[4])
  block_host = distributed.move(
      jax.jit(lambda: jnp.zeros(shape, window.dtype), out_shardings=on_device)(), window.sharding
  )
  weights = jax.jit(lambda: [jnp.zeros((8,), jnp.float32)] * _WEIGHT_ARGS, out_shardings=device)()
  query = jax.jit(lambda w, x: jnp.broadcast_to(x + sum(v[0] for v in w), q.shape), out_shardings=pinned)
  tail = jax.jit(
      lambda w, x, blk: x + 0 * blk[0, 0, 0, 0, 0].astype(jnp.float32) + sum(v[0] for v in w), out_shardings=device
  )
  # The partial's sum (0 here) joins x: each trip waits for the last one's kernel.
  merge = jax.jit(
      lambda w, x, o, lse: x + 0 * jnp.nan_to_num(o.sum() + lse.sum()) + sum(v[0] for v in w), out_shardings=device
  )

  def host_part(q_host):
    if q_host.is_fully_addressable:
      q_np = np.asarray(q_host)
    else:  # This process's heads; the kernel reads only those.
      q_np = attention.gather(attention.shard_views(q_host), q_host.shape)
    return attention.attend_array(window, q_np, start, 0, attention.ROW_BLOCK, fmt, threads)

  x, times = jax.jit(lambda: jnp.zeros((), jnp.float32), out_shardings=device)(), []
  for _ in range(FIXED_RUNS + 1):
    t0 = time.perf_counter()
    delivered = distributed.move(block_host, on_device)
    kernel = attention.WORKER.submit(host_part, query(weights, x))
    y = tail(weights, x, delivered)
    o, lse = kernel.result()
    x = merge(weights, y, o, lse)
    x.block_until_ready()
    times.append(time.perf_counter() - t0)
  block_host.delete()
  return float(np.median(times[1:]))
