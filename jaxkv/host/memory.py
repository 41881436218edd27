"""Pinned host memory for the KV cache: the pool's cap, the RAM available to it, and what this process has reserved.

jaxkv.residency.place calls `reserve` before a cache with streamed layers is made: the check fails in one line, before
anything is allocated, when the cache's pinned bytes in this process exceed the host RAM available (MemAvailable,
plus what the pool already holds) or the pool's cap. On the GPU the pinned pool keeps the memory it grew to (a BFC
allocator), so MemAvailable no longer counts what the next cache of that size will reuse: `RESERVED` remembers the
largest reservation of the process.

Before the backend starts, `startup_env` sizes what JAX reads only then (jaxkv.apps.cli.setup_platform, with the
caches an app may make): JAX's memory fraction for placement auto, whose planner keeps resident what fits in JAX's
pool, and the pinned pool's cap to the whole cache where it may stream.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import numpy as np

from jaxkv import cache as cache_lib
from jaxkv.config import KVConfig, ModelConfig
from jaxkv.kv_quant import KVFormat

DEFAULT_GPU_POOL_GB = 64
POOL_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
# JAX's pool with placement auto: the planner keeps resident the layers that fit in what is free in it; the rest of
# the device (7 GiB of an H200) is left to what allocates outside it (cuBLAS, cuDNN and the CUDA context).
AUTO_MEM_FRACTION = 0.95


@dataclasses.dataclass(frozen=True)
class CacheNeed:
  """A cache an app may make: its kv config, batch and capacity (rows)."""

  kv: KVConfig
  batch: int
  capacity: int

  def host_bytes(self, model: ModelConfig) -> int:
    """Pinned host bytes of the cache with every layer streamed (auto's bound), plus one layer in flight."""
    rows = cache_lib.rows_bound(self.capacity, self.kv.block)
    return cache_lib.row_bytes(model, self.kv.dtype, self.batch) * rows * (model.num_layers + 1)


def startup_env(model: ModelConfig, needs: list[CacheNeed], environ=None) -> dict[str, str]:
  """Sets in `environ` (default os.environ), before the backend starts, what the user has not set: with a placement
  auto among `needs`, JAX's memory fraction (MEM_FRACTION_ENV = AUTO_MEM_FRACTION); with a placement that streams,
  the pinned pool (POOL_ENV) to the largest such cache's host_bytes in GiB, rounded up, plus one, where that is over
  the default (a cap: the pool grows to what the caches take). Returns what it set. The host RAM is checked where a
  cache is placed (`check_host_memory`), against the layers it streams."""
  environ = os.environ if environ is None else environ
  out = {}
  if any(n.kv.placement == "auto" for n in needs) and MEM_FRACTION_ENV not in environ:
    out[MEM_FRACTION_ENV] = str(AUTO_MEM_FRACTION)
  streaming = [n for n in needs if n.kv.placement != "device"]
  gib = max((n.host_bytes(model) for n in streaming), default=0) / 2**30
  if gib > DEFAULT_GPU_POOL_GB and POOL_ENV not in environ:
    out[POOL_ENV] = str(math.ceil(gib) + 1)
  environ.update(out)
  return out


def pool_limit_bytes() -> int | None:
  """The pinned host pool cap of this process's backend, or None where there is none (CPU)."""
  env = os.environ.get(POOL_ENV)
  if env:
    return int(float(env) * 2**30)
  if jax.default_backend() == "gpu":
    return DEFAULT_GPU_POOL_GB * 2**30
  return None


def available_host_bytes() -> int | None:
  """The host RAM available to a new allocation: MemAvailable of /proc/meminfo (Linux), else the free physical pages
  (os.sysconf), else None (unknown)."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024  # kB.
  except OSError:
    pass
  try:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (ValueError, OSError, AttributeError):
    return None


@dataclasses.dataclass
class Reserved:
  """held: the largest host cache this process has placed, bytes (what the pinned pool may already hold)."""

  held: int = 0

  def ram_for_cache(self) -> int | None:
    """Host bytes a new host cache may take: available_host_bytes() plus what the pool may already hold."""
    available = available_host_bytes()
    return None if available is None else available + self.held

  def reserve(self, needed: int, layers: int, model: ModelConfig, fmt: KVFormat, batch: int, rows: int) -> None:
    """check_host_memory against ram_for_cache(), then counts `needed` as held by the pool."""
    check_host_memory(needed, layers, model, fmt, batch, rows, self.ram_for_cache())
    self.held = max(self.held, needed)


RESERVED = Reserved()  # The process's.


def check_host_memory(
    needed: int, layers: int, model: ModelConfig, fmt: KVFormat, batch: int, rows: int, available: int | None
) -> None:
  """Raises a one-line ValueError, before anything is allocated, when the host KV cache (`needed` bytes in this
  process, `layers` streamed layers) exceeds the host RAM `available` (None = unknown: not checked) or the pinned
  pool's cap."""
  gib = needed / 2**30
  what = (
      f"the host KV cache needs {gib:.2f} GiB of pinned host memory in this process "
      f"({layers} streamed layers x 2 x batch {batch} x {model.num_kv_heads} kv heads x {rows} rows x "
      f"{fmt.row_bytes} B per head row ({fmt.name}), plus one layer in flight)"
  )
  if available is not None and needed > available:
    raise ValueError(
        f"{what}, but this host has {available / 2**30:.2f} GiB of RAM available for it (MemAvailable, plus what "
        "the pinned pool already holds). Lower the batch "
        "or the capacity (--capacity, engine.capacity), store the KV in int8 or int4 (--kv_dtype=int8, int4), or "
        "keep more layers on the devices (--kv_placement=auto)."
    )
  limit = pool_limit_bytes()
  if limit is not None and needed > limit:
    raise ValueError(
        f"{what}, but the pinned pool is limited to {limit / 2**30:.2f} GiB. Raise it before starting, e.g. "
        f"{POOL_ENV}={int(np.ceil(gib)) + 1}, or lower the batch or the capacity (--capacity, engine.capacity)."
    )
