"""Device calls that meet a host thread through counters in pinned host memory: the native ops of
jaxkv/native/host_wait.cc.

A `Slot` ties an array in pinned host memory (this process's shards) to a counter per local device, also in pinned
host memory. Inside a jitted function:
  `wait(slot, shape, sharding)` gives f32 `shape` on the devices, each device's shard copied from the slot's array
    once the host has called `Slot.signal()` for this call (the k-th call on a slot waits for the k-th signal);
  `publish(x, slot, sharding)` copies each device's shard of x into the slot's array, then raises that device's
    counter; the host's `Slot.wait()` returns once every local device has done so for its k-th call.
So a call can be dispatched before its input exists and the device starts on it as soon as the host's counter moves,
and the host sees a device's result without asking the runtime. On CUDA a one-block kernel on the call's stream
spins on the counter and copies, reading and writing host memory through its device address; on the CPU the call's
thread does it (for the tests). The engine's host attention uses the pair for q and the host's partial
(jaxkv.host.decode, docs/design.md).

Rules for the caller: every `wait` call dispatched must be matched by one `signal`, or its device waits forever; the
host must not write a slot's array for the k+1-th `wait` call before the k-th has copied it, nor read it for the k-th
`publish` before `Slot.wait` returned, nor past the next call's publish.

The ops are C++ built with the system's C++ compiler at first use, against jaxlib's FFI headers, into
$JAXKV_CACHE_DIR (default ~/.cache/jaxkv); `available()` says whether they loaded. The CUDA kernels are PTX in the
C++ source, made with `nvcc -ptx -arch=compute_80` from:

  extern "C" __global__ void jaxkv_wait_copy(const unsigned int* counter, unsigned int expect,
                                             const unsigned int* src, unsigned int* dst, unsigned long long words) {
    if (threadIdx.x == 0) {
      while (static_cast<int>(*reinterpret_cast<const volatile unsigned int*>(counter) - expect) < 0) {
      }
    }
    __syncthreads();
    for (unsigned long long i = threadIdx.x; i < words; i += blockDim.x) dst[i] = __ldcv(src + i);
  }
  extern "C" __global__ void jaxkv_publish(const unsigned int* src, unsigned int* dst, unsigned long long words,
                                           unsigned int* counter, unsigned int value) {
    for (unsigned long long i = threadIdx.x; i < words; i += blockDim.x) __stcs(dst + i, src[i]);
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) *reinterpret_cast<volatile unsigned int*>(counter) = value;
  }
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile
import threading
import time
import weakref

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from absl import logging

WAIT, PUBLISH = "jaxkv_host_wait", "jaxkv_host_publish"
_SOURCE = pathlib.Path(__file__).parent.parent / "native" / "host_wait.cc"


def _cache_dir() -> pathlib.Path:
  path = os.environ.get("JAXKV_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "jaxkv")
  try:
    os.makedirs(path, exist_ok=True)
    if os.access(path, os.W_OK):
      return pathlib.Path(path)
  except OSError:
    pass
  return pathlib.Path(tempfile.gettempdir())


def compiler() -> str | None:
  """The C++ compiler that builds the ops: $CXX, else g++ (its path; None where there is none)."""
  return shutil.which(os.environ.get("CXX", "g++"))


def _build() -> pathlib.Path:
  """The ops' shared library, compiled once per source, jaxlib and compiler (atomically: concurrent processes)."""
  cxx = compiler()
  if cxx is None:
    raise RuntimeError("no C++ compiler (g++, or $CXX) to build them")
  include = jax.ffi.include_dir()
  source = _SOURCE.read_bytes()
  key = hashlib.sha256(b"\0".join([source, include.encode(), jaxlib.__version__.encode(), cxx.encode()])).hexdigest()
  out = _cache_dir() / f"host_wait-{key[:16]}.so"
  if not out.exists():
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", f"-I{include}", str(_SOURCE), "-o", tmp, "-ldl"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
      os.unlink(tmp)
      raise RuntimeError(f"building them failed: {' '.join(cmd)}\n{done.stderr[-2000:]}")
    os.replace(tmp, out)
  return out


@functools.cache
def _library() -> ctypes.CDLL | None:
  """Builds, loads and registers the ops (once per process); None, with a warning, where that fails."""
  try:
    lib = ctypes.CDLL(str(_build()))
  except (OSError, RuntimeError) as e:
    logging.warning("jaxkv: the host_wait ops are not available (%s)", e)
    return None
  lib.jaxkv_host_wait_set.argtypes = [ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64]
  lib.jaxkv_host_wait_set.restype = None
  lib.jaxkv_host_wait_limits.restype = ctypes.c_int
  lib.jaxkv_host_wait_poll.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_double]
  lib.jaxkv_host_wait_poll.restype = ctypes.c_int
  for name, cpu, cuda in (
      (WAIT, "JaxkvHostWaitCpu", "JaxkvHostWaitCuda"),
      (PUBLISH, "JaxkvHostPublishCpu", "JaxkvHostPublishCuda"),
  ):
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, cpu)), platform="cpu")
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, cuda)), platform="CUDA")
  return lib


def available() -> bool:
  return _library() is not None


def wait(slot: int, shape: tuple[int, ...], sharding: jax.sharding.NamedSharding) -> jax.Array:
  """Inside jit: f32 `shape` in `sharding` (device memory), each device's shard copied from its `Slot` entry once the
  host has signalled this call (module docstring)."""
  # No side effect declared: JAX would then take its slow dispatch path for every call holding the op.
  call = jax.ffi.ffi_call(WAIT, jax.ShapeDtypeStruct(sharding.shard_shape(shape), jnp.float32))
  return jax.shard_map(
      lambda: call(slot=np.int64(slot)), mesh=sharding.mesh, in_specs=(), out_specs=sharding.spec, check_vma=False
  )()


def publish(x: jax.Array, slot: int, sharding: jax.sharding.NamedSharding) -> jax.Array:
  """Inside jit: copies each device's shard of x (f32, in `sharding`) into its `Slot` entry, then raises the device's
  counter. Returns x, in place (the op's result aliases its operand): use it instead of x, or the call is dropped."""
  call = jax.ffi.ffi_call(
      PUBLISH, jax.ShapeDtypeStruct(sharding.shard_shape(x.shape), jnp.float32), input_output_aliases={0: 0}
  )
  return jax.shard_map(
      lambda v: call(v, slot=np.int64(slot)),
      mesh=sharding.mesh,
      in_specs=sharding.spec,
      out_specs=sharding.spec,
      check_vma=False,
  )(x)


_slots_lock = threading.Lock()
_slots_used: set[int] = set()


class Slot:
  """A slot of the ops for `array` (f32, pinned host; its shards on this process's devices): the calls `wait` or
  `publish` on slot `id` copy from or to those shards (a slot serves one of the two). Dropping the Slot frees the
  id; the array must outlive every call dispatched on it."""

  def __init__(self, array: jax.Array):
    lib = _library()
    if lib is None:
      raise RuntimeError("the host_wait ops are not available (see the warning logged when they were built)")
    with _slots_lock:
      free = [s for s in range(lib.jaxkv_host_wait_limits(0)) if s not in _slots_used]
      if not free:
        raise RuntimeError("every slot of the host_wait ops is in use")
      self.id = free[0]  # The lowest: the calls compiled for it are reused.
      _slots_used.add(self.id)
    shards = array.addressable_shards
    pinned = jax.sharding.SingleDeviceSharding(shards[0].device, memory_kind="pinned_host")
    self._counters = jax.device_put(np.zeros(len(shards), np.uint32), pinned).block_until_ready()  # One per device.
    self._lib, self._counters_at = lib, self._counters.unsafe_buffer_pointer()
    self._count = np.ctypeslib.as_array((ctypes.c_uint32 * len(shards)).from_address(self._counters_at))
    self._k = 0  # Signals sent, or publications seen (a slot serves one direction).
    ordinals = [shard.device.local_hardware_id for shard in shards]  # XLA's device ordinals, as the ops see them.
    weakref.finalize(self, _release, lib, self.id, ordinals)
    if max(ordinals) >= lib.jaxkv_host_wait_limits(1):
      raise RuntimeError(f"device ordinal {max(ordinals)} is over the host_wait ops' limit")
    for i, (shard, ordinal) in enumerate(zip(shards, ordinals)):
      data = shard.data
      lib.jaxkv_host_wait_set(self.id, ordinal, self._counters_at + 4 * i, data.unsafe_buffer_pointer(), data.nbytes)
    self._array = array

  def signal(self) -> None:
    """The array holds the data of the next `wait` call: lets it copy."""
    self._k = (self._k + 1) % 2**32
    self._count[:] = self._k

  def wait(self, timeout_s: float = 60.0) -> None:
    """Returns once the next `publish` call has written the array on every local device; spins in C without the GIL.
    Raises TimeoutError after timeout_s: a call that failed never publishes."""
    k = (self._k + 1) % 2**32
    if not self._lib.jaxkv_host_wait_poll(self._counters_at, len(self._count), k, timeout_s):
      raise TimeoutError(f"the devices did not publish call {k} on host_wait slot {self.id} in {timeout_s} s")
    self._k = k


def _release(lib, slot: int, ordinals: list[int]) -> None:
  for d in ordinals:
    lib.jaxkv_host_wait_set(slot, d, None, None, 0)
  with _slots_lock:
    _slots_used.discard(slot)
