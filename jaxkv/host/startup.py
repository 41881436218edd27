"""What JAX reads only when its backend starts, set by jaxkv before that: JAX's memory fraction and allocator for
placement auto, and the pinned host pool's cap from the residency plans of the caches an app may make
(jaxkv.apps.cli.setup_platform calls `startup_env`).

The pinned pool is a BFC allocator that grows by regions of doubling size up to its cap: a cap far above what the
caches take lets one region pin most of the host's RAM (an 80 GiB device, 1M tokens of the 8B: 88 GiB streamed,
a 134 GiB cap, the process killed by the host). So the cap is what the plan streams on the devices found (their
memory from the driver's NVML, as JAX itself has not started), with a margin, and never above the whole cache.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import os

import jax.numpy as jnp

from jaxkv import cache as cache_lib
from jaxkv import residency
from jaxkv.config import KVConfig, ModelConfig
from jaxkv.host import memory
from jaxkv.kv_quant import KVFormat

MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
ALLOCATOR_ENV = "XLA_PYTHON_CLIENT_ALLOCATOR"
# JAX's device allocator where placement auto streams on NVIDIA GPUs: CUDA's stream-ordered pool, which maps its
# pages where a large array needs them. With XLA's default (a BFC allocator carving one preallocated region) the 8B's
# 1M cache ran out of device memory in its warm-up on an H100 and an H200, asking a 4 GiB window; with cuda_async it
# ran (H100, H200).
AUTO_ALLOCATOR = "cuda_async"
# JAX's pool with placement auto: the planner keeps resident the layers that fit in what is free in it; the rest of
# the device (7 GiB of an H200) is left to what allocates outside it (cuBLAS, cuDNN and the CUDA context).
AUTO_MEM_FRACTION = 0.95
# The plan made before JAX starts counts the weights and no more; at the cache the pool also holds the runtime's own
# arrays (0.6 GiB on an H200 at 1M): the early plan takes this much less free memory and one streamed layer more.
EARLY_PLAN_MARGIN_BYTES = 2 * 2**30


@dataclasses.dataclass(frozen=True)
class CacheNeed:
  """A cache an app may make: its kv config, batch, capacity (rows) and prefill chunk (rows; 0: no prefill)."""

  kv: KVConfig
  batch: int
  capacity: int
  prefill_chunk: int = 0

  def layer_bytes(self, model: ModelConfig) -> int:
    """One layer's window at full capacity, all heads."""
    return cache_lib.row_bytes(model, self.kv.dtype, self.batch) * cache_lib.rows_bound(self.capacity, self.kv.block)

  def streamed_layers(self, model: ModelConfig, devices: list[int] | None, fraction: float) -> int:
    """The layers the cache streams on devices of these memory sizes (bytes; None: unknown, every layer for a
    placement that streams): placement auto's plan with JAX's pool (`fraction` of each device) less the weights,
    less EARLY_PLAN_MARGIN_BYTES (or kv.device_budget_gib where given), and one layer more; the larger of the plans
    with and without host attention (which, when it does not pay, is turned off at the cache)."""
    if self.kv.placement == "device":
      return 0
    if self.kv.placement == "host" or devices is None:
      return model.num_layers
    weights = model.num_params() * jnp.dtype(model.dtype).itemsize
    free = int(fraction * min(devices) * len(devices)) - weights - EARLY_PLAN_MARGIN_BYTES
    free = None if self.kv.device_budget_gib is not None else max(free, 0)  # The budget given is the plan's.
    streamed = 0
    for kv in {self.kv, dataclasses.replace(self.kv, host_attention=False)}:
      group = residency.group_layers(kv.group_layers, kv.host_attention, self.layer_bytes(model))
      groups = residency.decode_groups((0,) * model.num_layers, group)
      plan = residency.auto_plan(model, kv, self.batch, self.capacity, self.prefill_chunk, groups, 1, free)
      streamed = max(streamed, len(plan.streamed) - plan.resident_layers)
    return min(streamed + 1 if streamed else 0, model.num_layers)


def device_memory_bytes() -> list[int] | None:
  """The memory of each NVIDIA GPU this process may use (CUDA_VISIBLE_DEVICES where it lists indices), from the
  driver's NVML before JAX starts; None where there is no driver or no GPU."""
  try:
    nvml = ctypes.CDLL("libnvidia-ml.so.1")
  except OSError:
    return None

  class Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]

  count = ctypes.c_uint()
  if nvml.nvmlInit_v2() or nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)):
    return None
  try:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    indices = range(count.value)
    if visible is not None and all(v.strip().isdigit() for v in visible.split(",") if v.strip()):
      indices = [int(v) for v in visible.split(",") if v.strip() and int(v) < count.value]
    sizes = []
    for i in indices:
      handle, mem = ctypes.c_void_p(), Memory()
      if nvml.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle)) or nvml.nvmlDeviceGetMemoryInfo(
          handle, ctypes.byref(mem)
      ):
        return None
      sizes.append(mem.total)
    return sizes or None
  finally:
    nvml.nvmlShutdown()


def startup_env(model: ModelConfig, needs: list[CacheNeed], devices: list[int] | None, environ=None) -> dict[str, str]:
  """Sets in `environ` (default os.environ), before the backend starts, what the user has not set: with a placement
  auto among `needs`, JAX's memory fraction (MEM_FRACTION_ENV = AUTO_MEM_FRACTION) and, where such a cache's plan
  on NVIDIA GPUs (devices known) streams, its allocator (ALLOCATOR_ENV = AUTO_ALLOCATOR: the device is full of
  windows); where a cache streams, the pinned pool's cap
  (memory.POOL_ENV) to the largest such cache's streamed layers (CacheNeed.streamed_layers on `devices`: their
  memory sizes in bytes, device_memory_bytes(); None: unknown) plus one in flight, in GiB rounded up, plus one,
  where that is over the default cap. Returns what it set. ValueError (one line) where the host's available RAM
  cannot hold a cache's streamed layers (planned on known devices, or all of placement host); the cache's own check
  (jaxkv.residency.place) counts the layers its plan streams."""
  environ = os.environ if environ is None else environ
  out = {}
  auto = any(n.kv.placement == "auto" for n in needs)
  if auto and MEM_FRACTION_ENV not in environ:
    out[MEM_FRACTION_ENV] = environ[MEM_FRACTION_ENV] = str(AUTO_MEM_FRACTION)
  fraction = float(environ.get(MEM_FRACTION_ENV, AUTO_MEM_FRACTION))
  needed = 0
  for need in needs:
    layers = need.streamed_layers(model, devices, fraction)
    if not layers:
      continue
    if need.kv.placement == "auto" and devices is not None and ALLOCATOR_ENV not in environ:
      out[ALLOCATOR_ENV] = environ[ALLOCATOR_ENV] = AUTO_ALLOCATOR
    pinned = need.layer_bytes(model) * (layers + 1)
    needed = max(needed, pinned)
    if need.kv.placement == "host" or devices is not None:  # Else the cache's own check, with the plan it makes.
      fmt, rows = KVFormat.of(model, need.kv.dtype), cache_lib.rows_bound(need.capacity, need.kv.block)
      memory.check_host_memory(pinned, layers, model, fmt, need.batch, rows, memory.available_host_bytes(), None)
  gib = needed / 2**30
  if gib > memory.DEFAULT_GPU_POOL_GB and memory.POOL_ENV not in environ:
    out[memory.POOL_ENV] = environ[memory.POOL_ENV] = str(math.ceil(gib) + 1)
  return out
