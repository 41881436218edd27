"""Pinned host memory for the KV cache: the pool's cap, the RAM available to it, and what this process has reserved.

jaxkv.residency.place calls `reserve` before a cache with streamed layers is made: the check fails in one line, before
anything is allocated, when the cache's pinned bytes in this process exceed the host RAM available (MemAvailable,
plus what the pool already holds) or the pool's cap. On the GPU the pinned pool keeps the memory it grew to (a BFC
allocator), so MemAvailable no longer counts what the next cache of that size will reuse: `RESERVED` remembers the
largest reservation of the process.

The pool's cap is read when JAX's backend starts; jaxkv.host.startup sizes it before that.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np

from jaxkv.config import ModelConfig
from jaxkv.kv_quant import KVFormat

DEFAULT_GPU_POOL_GB = 64
POOL_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"


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
    check_host_memory(needed, layers, model, fmt, batch, rows, self.ram_for_cache(), pool_limit_bytes())
    self.held = max(self.held, needed)


RESERVED = Reserved()  # The process's.


def check_host_memory(
    needed: int,
    layers: int,
    model: ModelConfig,
    fmt: KVFormat,
    batch: int,
    rows: int,
    available: int | None,
    limit: int | None,
) -> None:
  """Raises a one-line ValueError, before anything is allocated, when the host KV cache (`needed` bytes in this
  process, `layers` streamed layers) exceeds the host RAM `available` or the pinned pool's cap `limit` (None =
  unknown or none: not checked)."""
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
  if limit is not None and needed > limit:
    raise ValueError(
        f"{what}, but the pinned pool is limited to {limit / 2**30:.2f} GiB. Raise it before starting, e.g. "
        f"{POOL_ENV}={int(np.ceil(gib)) + 1}, or lower the batch or the capacity (--capacity, engine.capacity)."
    )
