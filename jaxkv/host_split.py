"""The host's share of each window for host attention, chosen from rates measured on this machine.

With host attention a decode step moves (1 - f) of each streamed window over the link while the CPU attends the other
f in place (jaxkv.host_attention). Both sides work at once, so a step is shortest when they take the same time:

  f B / cpu = (1 - f) B / link   ->   f = cpu / (cpu + link)

where cpu is the kernel's rate over stored rows and link the pinned host -> device rate, both in bytes per second,
measured TOGETHER (each slows the other: they share the host's memory). `measure` runs them side by side on one
layer's worth of rows (SAMPLE_BYTES per device, zeros: the rate does not depend on the values), once per process and
(shardings, format); with several processes, process 0's rates decide for all. The serial work of each layer (the
query's round trip, the merge, the MLP) is not in the model, so the measured f is an upper bound on the best one, near
it where a layer's kernel is long: on the H200 host (32 cores, 24 threads, device waits) the measured share (0.54-0.57)
ran 2.01x the link-bound tokens/s at 32k batch 4 (f = 0.48: 1.80x) but 1.39x at 32k batch 1, where f = 0.48 ran
1.66-1.77x (docs/performance.md).
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
from jaxkv import host_attention
from jaxkv import mesh as mesh_lib
from jaxkv.kv_quant import KVFormat

SAMPLE_BYTES = 64 * 2**20  # Stored rows per device to measure on: about one layer's window at long context.
MAX_FRACTION = 0.95  # A share of rows is always delivered: the device also attends the open page.
_KERNEL_RUNS = 3
_MAX_COPIES = 16  # Copies in flight while measuring together: at most 1 GiB per device.


@dataclasses.dataclass(frozen=True)
class Split:
  """fraction: the host's share f in (0, 1); source: "measured" or "override"; cpu_gbps / link_gbps: the rates
  measured together (None for an override), GB/s = 1e9 B/s of stored rows, the link's per device."""

  fraction: float
  source: str
  cpu_gbps: float | None = None
  link_gbps: float | None = None

  def summary(self) -> dict:
    return dataclasses.asdict(self)


def choose(cpu_gbps: float, link_gbps: float) -> float:
  """f = cpu / (cpu + link), at most MAX_FRACTION."""
  if cpu_gbps <= 0 or link_gbps <= 0:
    raise ValueError(f"rates must be positive, got cpu {cpu_gbps} and link {link_gbps} GB/s")
  return min(cpu_gbps / (cpu_gbps + link_gbps), MAX_FRACTION)


def split(
    fraction: float,
    host: jax.sharding.NamedSharding,
    device: jax.sharding.NamedSharding,
    fmt: KVFormat,
    groups: int,
    threads: int,
) -> Split:
  """The override when fraction > 0, else the measured split."""
  if fraction:
    return Split(fraction, "override")
  return measure(host, device, fmt, groups, threads)


@functools.lru_cache(maxsize=None)
def measure(
    host: jax.sharding.NamedSharding, device: jax.sharding.NamedSharding, fmt: KVFormat, groups: int, threads: int
) -> Split:
  """Measures the kernel on `threads` threads over SAMPLE_BYTES of `fmt` rows per device (host: the cache's
  pinned_host sharding of a window [2, B, K, W, E]; groups: query heads per KV head, G, which sets the kernel's
  arithmetic per row) while the same rows stream to `device`, and returns the split they give."""
  mesh = host.mesh
  t = mesh_lib.tensor_size(mesh)
  heads = t  # One KV head per device shard: the kernel's and the link's rates are per byte, not per head.
  rows = max(SAMPLE_BYTES // (2 * fmt.row_bytes), host_attention.ROW_BLOCK)
  shape = (2, 1, heads, rows, fmt.width)
  window = jax.jit(lambda: jnp.zeros(shape, fmt.storage_dtype), out_shardings=device)()
  window = distributed.move(window, host)
  window.block_until_ready()
  q = np.zeros((1, heads, groups, fmt.head_dim), np.float32)
  start = np.zeros(1, np.int32)
  per_device = window.nbytes // t

  def attend():  # On the engine's kernel thread: see host_attention.WORKER.
    host_attention.WORKER.submit(host_attention.attend_array, window, q, start, 0, rows, fmt, threads).result()

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
  # The CPU reads every local head shard; each device's link carries its own share, all in parallel.
  local = len({shard.index[2].indices(heads) for shard in window.addressable_shards})
  window.delete()
  cpu_gbps = _KERNEL_RUNS * local * per_device / t_cpu / 1e9
  link_gbps = n * per_device / t_link / 1e9
  if jax.process_count() > 1:  # Every process must split at the same rows: process 0's rates decide.
    cpu_gbps, link_gbps = (float(v) for v in multihost_utils.broadcast_one_to_all(np.array([cpu_gbps, link_gbps])))
  fraction = choose(cpu_gbps, link_gbps * local)
  logging.info(
      "host attention split: f = %.3f from cpu %.1f GB/s and link %.1f GB/s per device x %d, measured together "
      "(alone: %.1f and %.1f)",
      fraction,
      cpu_gbps,
      link_gbps,
      local,
      local * per_device / cpu_alone / 1e9,
      per_device / link_alone / 1e9,
  )
  return Split(fraction, "measured", cpu_gbps, link_gbps)
