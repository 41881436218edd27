"""Decode attention on the host CPU over KV rows that already live in host memory, for split-K with the device.

A layer's window rows [r0, r1) are attended on the CPU, reading the stored rows in place (zero-copy views of the
host arrays' shards), and the result is returned as a normalized partial output with its log-sum-exp, which the
device merges with its own partial over the remaining rows (jaxkv.model.merge_partials).

Shapes (B = batch, K = kv heads held by the array or shard, G = query heads per kv head, Dh = head_dim,
R = rows of the array, E = stored width of a head row, jaxkv.kv_quant):
  kv:    stored [2, B, K, R, E] (index 0 = K, 1 = V), numpy, C order, in any KVFormat; row i is cache row row0 + i
  q:     f32[B, K, G, Dh], query head k * G + g (the model's values, widened to f32)
  start: i32[B], first valid cache row of each sequence (rows before it are left padding)
  out:   o f32[B, K, G, Dh] = softmax(q k^T / sqrt(Dh)) v over the valid rows of [r0, r1), normalized;
         lse f32[B, K, G] = log sum exp of those scaled scores. No valid row: o = 0, lse = -inf.

The kernel (numba, nopython, parallel, GIL released) splits [r0, r1) into blocks of ROW_BLOCK rows and runs one task
per (sequence, head, block): scores of the block's K rows for the G heads, block max and sum, then the V rows
weighted by exp(score - max), all in f32, into per-block partials (a scratch buffer of the calling thread, reused
from call to call). A second parallel loop, one task per query head, merges that head's blocks in block order.
Tasks never share an accumulator and the block size does not depend on the thread count, so the result is
bitwise the same for every run and every thread count (on one machine: the vector width of the compiled code may
differ elsewhere). Rows are widened to f32 in chunks of _CHUNK rows (an L1-resident scratch), exactly: bf16 by a
16-bit shift, float16 and the f16 scales by re-biasing the exponent, fp8 by a 256-entry table, int8 times its block's
scale, int4's two nibbles per byte (jaxkv.kv_quant's order) by a shift and a mask times their block's scale. The rows
two chunks ahead are prefetched, so memory loads overlap the arithmetic.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading

import jax
import jax.numpy as jnp
import numba
import numba.core.codegen
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from jaxkv import distributed
from jaxkv.host import wait as wait_lib
from jaxkv.kv_quant import INT4_BLOCK, INT4_HALF, INT8_BLOCK, KVFormat


def _wide_vectors() -> None:
  """Lets numba's LLVM use 512-bit vectors where the CPU has them: LLVM tunes Intel server cores to prefer 256-bit
  ones, and without that tuning the kernel read 11-25% more GB/s on the H200 host (Emerald Rapids, 16 and 24 threads,
  measured in 2026-11). numba compiles with one set of CPU features per process, so this holds for every
  function the process compiles with numba. CPU features the user gave numba (NUMBA_CPU_FEATURES) win, and a process
  whose numba compiled before this import keeps the features it compiled with."""
  features = numba.core.codegen.get_host_cpu_features()  # What numba would use: it may drop AVX (NUMBA_ENABLE_AVX).
  if numba.config.CPU_FEATURES is None and "+avx512f" in features.split(","):
    numba.config.CPU_FEATURES = features + ",-prefer-256-bit"


_wide_vectors()  # Before any function of this module compiles.

# Threads of the kernel in the engine: numba's pool (NUMBA_NUM_THREADS, by default the cores) but two, left to the
# dispatching thread and the feeder, and at most 16. Measured on the H200 hosts, decode steps with host attention:
# on 16 cores, 14 threads beat 16 by 1.3-1.4x (spinning workers starve those threads); on 32 cores, 16 threads ran
# 8B at 16k, batch 4 in 142.8 ms per step where 30 had taken 155.6 (two sessions). DRAM read bandwidth is near its
# peak at 16 threads (63 GB/s on 16 cores).
ENGINE_THREADS = max(1, min(numba.config.NUMBA_NUM_THREADS - 2, 16))

# The process's kernel thread: a split layer's kernel runs here while the dispatching thread dispatches the device's
# side (jaxkv.host.decode), and so does the split's measurement (jaxkv.host.split); one per process, so the kernels run
# one at a time. Run the kernel from no other thread in a process that decodes: with numba's OpenMP layer each thread
# that starts parallel loops keeps a team of threads of its own, and one kernel call on the main thread of the H200
# host (24 threads) slowed decode steps at 32k, batch 1 from 44-46 to 52-53 ms (two processes each; likely GNU
# OpenMP's spin throttled once its threads outnumber the cores, so every loop wakes sleeping threads).
WORKER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxkv-host-attention")

ROW_BLOCK = 256  # Rows per task; fixed, so that the reduction order never depends on the threads.
_CHUNK = 8  # Rows widened to f32 at a time; the V update below is written out for 8.
_PREFETCH = 2 * _CHUNK  # Rows ahead to prefetch (measured: 16 beat 8, 32 and 64).

_F32, _BF16, _F16, _INT8, _FP8, _INT4 = range(6)
_CODES = {"float32": _F32, "bfloat16": _BF16, "float16": _F16, "int8": _INT8, "float8_e4m3fn": _FP8, "int4": _INT4}
_FP8_VALUES = np.arange(256, dtype=np.uint8).view(jnp.float8_e4m3fn).astype(np.float32)  # e4m3fn bits -> f32.


def engine_threads(requested: int) -> int:
  """The kernel's threads in the engine for kv.host_attention_threads = requested (0 = ENGINE_THREADS); ValueError
  past numba's pool."""
  if requested > numba.config.NUMBA_NUM_THREADS:
    raise ValueError(
        f"kv.host_attention_threads {requested} is over numba's pool of {numba.config.NUMBA_NUM_THREADS} threads "
        "(NUMBA_NUM_THREADS, by default the cores)"
    )
  return requested or ENGINE_THREADS


class _Buffer:
  """Exposes `nbytes` bytes at `ptr` to numpy and keeps `owner` (the memory's owner) alive with the view."""

  def __init__(self, owner, ptr: int, nbytes: int, writable: bool):
    self.owner = owner
    self.__array_interface__ = dict(shape=(nbytes,), typestr="|u1", data=(ptr, not writable), version=3)


def shard_views(arr: jax.Array, writable: bool = False) -> list[tuple[tuple[slice, ...], np.ndarray]]:
  """Numpy views of `arr`'s addressable shards, without copying: [(index into arr, view)], read-only unless
  `writable`.

  Each view has its shard's shape and dtype and holds a reference to the shard, so the memory stays allocated while
  the view lives. Works for shards whose buffer the host can address: memory kind "pinned_host" (and any memory on
  the CPU backend). The caller must not delete or donate `arr` while a view is used; this function waits until `arr`
  is ready (a host array stored by an asynchronous device-to-host copy may still be in flight). A write through a
  writable view changes `arr` behind JAX's back: the caller must know that no computation reading `arr` still runs.
  """
  kind = arr.sharding.memory_kind
  if kind not in ("pinned_host", "unpinned_host") and any(d.platform != "cpu" for d in arr.devices()):
    raise ValueError(f"the host cannot read memory kind {kind!r} of a device array; store it in pinned_host")
  arr.block_until_ready()
  views = []
  for shard in arr.addressable_shards:
    data = shard.data
    row_major = tuple(range(data.ndim))
    layout = data.format.layout.major_to_minor
    if tuple(layout) != row_major:
      raise ValueError(f"shard layout {layout} is not row-major {row_major}; a view needs the default layout")
    raw = np.asarray(_Buffer(data, data.unsafe_buffer_pointer(), data.nbytes, writable))
    views.append((shard.index, raw.view(data.dtype).reshape(data.shape)))
  return views


def gather(views: list[tuple[tuple[slice, ...], np.ndarray]], shape: tuple[int, ...]) -> np.ndarray:
  """A host copy of an array of `shape` from its shard views (`shard_views`): this process's shards, zeros elsewhere."""
  if len(views) == 1 and views[0][1].shape == tuple(shape):
    return views[0][1].copy()
  out = np.zeros(shape, views[0][1].dtype)
  for index, view in views:
    out[index] = view
  return out


def attend(
    kv: np.ndarray,
    q: np.ndarray,
    start: np.ndarray,
    r0: int,
    r1: int,
    fmt: KVFormat,
    row0: int = 0,
    threads: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
  """Attention of q over rows [r0, r1) of kv (shapes in the module docstring) -> (o, lse).

  kv must be C-contiguous (a view of a whole host array: it is read in place, never copied). fmt: the stored format
  of kv's rows. threads: sets numba's thread count for the calling thread (a per-thread setting) first; None keeps
  it. Blocks the calling thread, not the GIL.
  """
  return _run(_raw(kv, fmt), q, start, r0, r1, fmt, row0, threads)


def _raw(kv: np.ndarray, fmt: KVFormat) -> np.ndarray:
  """kv's bytes as the kernel reads them: a read-only uint8 view of the same memory (ValueError if kv is not
  C-contiguous rows of `fmt`)."""
  if fmt.name not in _CODES:
    raise ValueError(f"host attention does not read KV format {fmt.name!r}; it reads {sorted(_CODES)}")
  if kv.ndim != 5 or kv.shape[4] != fmt.width or kv.dtype != fmt.storage_dtype:
    raise ValueError(f"kv {kv.dtype}{list(kv.shape)} is not stored as {fmt.name} [2, B, K, R, {fmt.width}]")
  if not kv.flags.c_contiguous:
    raise ValueError("kv must be C-contiguous: pass the whole array and a row range")
  raw = kv.view(np.uint8)
  raw.flags.writeable = False  # One compiled signature: views of host arrays are read-only.
  return raw


def _run(raw, q, start, r0, r1, fmt, row0, threads) -> tuple[np.ndarray, np.ndarray]:
  """The kernel over rows [r0, r1) of raw (from _raw) after checks that cost microseconds."""
  _, b, k, rows, _ = raw.shape
  if q.shape[:2] != (b, k) or q.shape[3] != fmt.head_dim:
    raise ValueError(f"q {q.shape} does not match kv [2, {b}, {k}, ...] (q must be [B, K, G, {fmt.head_dim}])")
  if not 0 <= r0 <= r1 <= rows:
    raise ValueError(f"rows [{r0}, {r1}) are not within the array's {rows} rows")
  if threads is not None:
    numba.set_num_threads(threads)
  return _attend(
      raw,
      _CODES[fmt.name],
      np.ascontiguousarray(q, np.float32),
      np.ascontiguousarray(start, np.int32),
      r0,
      r1,
      row0,
      np.float32(1.0 / math.sqrt(fmt.head_dim)),
      ROW_BLOCK,
      _FP8_VALUES,
      *_partials(q.shape, -(-(r1 - r0) // ROW_BLOCK)),
  )


_scratch = threading.local()


def _partials(q_shape: tuple[int, ...], nblk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The kernel's per-block partials for q [B, K, G, Dh] over nblk blocks: m, l f32[B, K, nblk, G] and
  o f32[B, K, nblk, G, Dh], uninitialized, in a buffer of the calling thread that grows as needed and is reused by
  its later calls. Allocating and zeroing them on every call (~1 MB at 32k rows) cost the H200 host ~0.2 ms a call:
  15% of a layer's kernel in the engine at batch 1."""
  b, k, g, dh = q_shape
  n = b * k * nblk * g
  buf = getattr(_scratch, "buf", None)
  if buf is None or buf.size < n * (dh + 2):
    buf = _scratch.buf = np.empty(n * (dh + 2), np.float32)
  return (
      buf[:n].reshape(b, k, nblk, g),
      buf[n : 2 * n].reshape(b, k, nblk, g),
      buf[2 * n : n * (dh + 2)].reshape(b, k, nblk, g, dh),
  )


def kernel_views(window: jax.Array, fmt: KVFormat) -> list[tuple[slice, np.ndarray]]:
  """What the kernel reads of a host (or CPU) array: [(the shard's heads, its bytes)] for each distinct addressable
  head shard (replicas once), zero-copy and checked once, so that `attend_views` over them costs no more JAX calls.

  window: stored [2, B, K, W, E] jax.Array of `fmt` rows, sharded on K (jaxkv.cache). The views hold the shards (as
  `shard_views` does): the caller drops them before `window` is deleted or donated (jaxkv.host.decode.HostDecode.forget_views).
  """
  views, done = [], set()
  for index, view in shard_views(window):
    heads = index[2]
    key = heads.indices(window.shape[2])
    if key not in done:
      done.add(key)
      views.append((heads, _raw(view, fmt)))
  return views


def attend_views(
    views: list[tuple[slice, np.ndarray]],
    q: np.ndarray,
    start: np.ndarray,
    r0: int,
    r1: int,
    fmt: KVFormat,
    threads: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
  """`attend` over rows [r0, r1) of each of `views` (from kernel_views) for q f32[B, K, G, Dh] of all K heads.

  Returns o f32[B, K, G, Dh] and lse f32[B, K, G]; heads no view holds are left 0 / -inf.
  """
  o = np.zeros(q.shape, np.float32)
  lse = np.full(q.shape[:3], -np.inf, np.float32)
  for heads, raw in views:
    o[:, heads], lse[:, heads] = _run(raw, q[:, heads], start, r0, r1, fmt, 0, threads)
  return o, lse


def attend_array(
    window: jax.Array, q: np.ndarray, start: np.ndarray, r0: int, r1: int, fmt: KVFormat, threads: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
  """`attend` over rows [r0, r1) of every addressable shard of a host (or CPU) array, read in place.

  window: stored [2, B, K, W, E] jax.Array, sharded on K (jaxkv.cache); q f32[B, K, G, Dh] for all K heads.
  Returns o f32[B, K, G, Dh] and lse f32[B, K, G]; heads of shards this process does not hold are left 0 / -inf.
  """
  return attend_views(kernel_views(window, fmt), q, start, r0, r1, fmt, threads)


class HandBack:
  """The host's partial on its way to the devices: one f32[B, K, G, Dh + 1] array in pinned host memory (o, then
  lse; heads sharded as `sharding` says), written in place through views of its shards and read by a device call
  that moves it to the devices itself. Writing costs a few microseconds where a new array per layer (`device_put`)
  cost the engine's dispatching thread 0.23-0.38 ms on the H200 hosts.

  The caller orders the two: a write must not start before the last call that reads the array has read it. In the
  engine the reader is the merge of the previous split layer on the array's stage, and layer l's partial is written
  once layer l's q is on the host: the call that made q contains that merge or takes an x made from its output.

  With device_wait, the devices and the host meet through jaxkv.host.wait instead: the reader waits on the devices
  (on `array_slot`) for the writer's `signal()` after `write`, and q comes the other way: the devices publish it into
  `query` (f32[B, K, G, Dh], pinned host, same sharding) through `query_slot`, and `read_query()` reads it.
  """

  def __init__(self, shape: tuple[int, ...], sharding: jax.sharding.Sharding, device_wait: bool = False):
    self.array = distributed.put_host(np.zeros(shape, np.float32), sharding)
    self._views = shard_views(self.array, writable=True)
    self.device_wait = device_wait
    self.array_slot = self.query = self.query_slot = None
    if device_wait:
      self.array_slot = wait_lib.Slot(self.array)
      self.query = distributed.put_host(np.zeros((*shape[:-1], shape[-1] - 1), np.float32), sharding)
      self._query_views = shard_views(self.query)
      self.query_slot = wait_lib.Slot(self.query)

  def write(self, o: np.ndarray, lse: np.ndarray) -> None:
    """o f32[B, K, G, Dh], lse f32[B, K, G] (all heads; each shard takes its own)."""
    for index, view in self._views:
      view[..., :-1] = o[index[:3]]
      view[..., -1] = lse[index[:3]]

  def signal(self) -> None:
    """With device_wait: the partial is written; the devices' merge may copy it."""
    self.array_slot.signal()

  def read_query(self) -> np.ndarray:
    """With device_wait: waits for the devices to publish the next q, then copies it out: f32[B, K, G, Dh], this
    process's heads (zeros elsewhere)."""
    self.query_slot.wait()
    return gather(self._query_views, self.query.shape)


@intrinsic
def _prefetch(typingctx, row, index):
  """Hints the CPU to load the cache line of row[index] (row: a 1-D array) into all cache levels."""

  def codegen(context, builder, sig, args):
    ary = context.make_array(sig.args[0])(context, builder, args[0])
    ptr = cgutils.get_item_pointer(context, builder, sig.args[0], ary, [args[1]])
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0"
    )
    builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])  # Read, keep in all levels, data.
    return context.get_dummy_value()

  return types.void(row, index), codegen


@numba.njit(fastmath={"contract"})
def _exp_nonpositive(x, n, bits):
  """x[:n] <- exp(x[:n]) for x <= 0, in f32: Cephes expf, |relative error| < 2^-23 (measured over [-87, 0]); it
  vectorizes, unlike libm's expf. Arguments below -87 give exp(-87) (< 2^-125, and a block's sum is >= 1).
  bits: u32[>= n] scratch."""
  two_k = bits.view(np.float32)
  for i in range(n):
    v = max(x[i], np.float32(-87.0))
    k = np.floor(v * np.float32(1.44269504) + np.float32(0.5))
    r = v - k * np.float32(0.693359375) - k * np.float32(-2.12194440e-4)  # v - k ln 2, in two steps.
    p = np.float32(1.9875691500e-4) * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    bits[i] = np.uint32(np.int32(k) + 127) << np.uint32(23)  # 2^k.
    x[i] = (p * (r * r) + r + np.float32(1.0)) * two_k[i]


@numba.njit(inline="always")
def _u16(rows, r, i):
  """The little-endian uint16 at byte i of row r of u8 rows (bytes, not a view: a per-row view stops vectorization)."""
  return np.uint32(rows[r, i]) | np.uint32(rows[r, i + 1]) << np.uint32(8)


@numba.njit(inline="always")
def _f16_to_f32(rows, r, first, n, out, out_bits):
  """n finite float16 values stored at bytes [first, first + 2n) of row r -> out f32[>= n] (out_bits: its uint32
  view), exactly and without f32 subnormal arithmetic, which a denormals-are-zero CPU mode would flush: normal
  values by re-biasing the exponent (+112), subnormal ones as mantissa x 2^-24."""
  for d in range(n):
    h = _u16(rows, r, first + 2 * d)
    out_bits[d] = ((h & 0x7FFF) << np.uint32(13)) + np.uint32(112 << 23) | (h & 0x8000) << np.uint32(16)
  for d in range(n):
    h = _u16(rows, r, first + 2 * d)
    if h & 0x7C00 == 0:
      x = np.float32(h & 0x3FF) * np.float32(2.0**-24)
      out[d] = -x if h & 0x8000 else x


@numba.njit(inline="always")
def _nibble(rows, r, i, shift):
  """The 4-bit two's complement integer in bits [shift, shift + 4) of byte i of row r of u8 rows, as f32."""
  return np.float32((((np.int32(rows[r, i]) >> shift) & 15) ^ 8) - 8)


@numba.njit(inline="always")
def _widen(rows, first, n, code, out, out_bits, scale, scale_bits, fp8):
  """Stored rows[first : first + n] (u8[R, row bytes]) -> out f32[_CHUNK, Dh]; rows n.. of out are zeroed.
  out_bits: out's uint32 view; scale, scale_bits: f32[Dh / 32] scratch and its uint32 view."""
  dh = out.shape[1]
  for c in range(_CHUNK):  # The rows of the chunk after next: their loads overlap this chunk's arithmetic.
    ahead = rows[min(first + _PREFETCH + c, rows.shape[0] - 1)]
    for e in range(0, ahead.shape[0], 64):
      _prefetch(ahead, e)
  if code == _F32:
    for c in range(n):
      for d in range(dh):
        out_bits[c, d] = _u16(rows, first + c, 4 * d) | _u16(rows, first + c, 4 * d + 2) << np.uint32(16)
  elif code == _BF16:
    for c in range(n):
      for d in range(dh):
        out_bits[c, d] = _u16(rows, first + c, 2 * d) << np.uint32(16)
  elif code == _F16:
    for c in range(n):
      _f16_to_f32(rows, first + c, 0, dh, out[c], out_bits[c])
  elif code == _INT8:
    for c in range(n):
      for d in range(dh):  # Converted whole, then scaled per block: measured 2.5x faster than both in one loop.
        out[c, d] = np.float32(np.int8(rows[first + c, d]))
      _f16_to_f32(rows, first + c, dh, dh // INT8_BLOCK, scale, scale_bits)
      for j in range(dh // INT8_BLOCK):
        sj = scale[j]
        for d in range(INT8_BLOCK):
          out[c, j * INT8_BLOCK + d] *= sj
  elif code == _INT4:
    for c in range(n):
      _f16_to_f32(rows, first + c, dh // 2, dh // INT4_BLOCK, scale, scale_bits)
      for j in range(dh // INT4_BLOCK):  # Byte i of block j: its value i in the low nibble, i + 16 in the high one.
        sj, byte0 = scale[j], j * INT4_HALF
        # The low nibbles, then the high ones: contiguous stores, measured 1.4x faster than one loop storing both.
        for i in range(INT4_HALF):
          out[c, j * INT4_BLOCK + i] = _nibble(rows, first + c, byte0 + i, 0) * sj
        for i in range(INT4_HALF):
          out[c, j * INT4_BLOCK + INT4_HALF + i] = _nibble(rows, first + c, byte0 + i, 4) * sj
  else:
    for c in range(n):
      _f16_to_f32(rows, first + c, dh, 1, scale, scale_bits)
      for d in range(dh):
        out[c, d] = fp8[rows[first + c, d]] * scale[0]
  for c in range(n, _CHUNK):
    out[c] = 0.0


@numba.njit(parallel=True, nogil=True, cache=True, fastmath={"reassoc", "contract"})
def _attend(kv, code, q, start, r0, r1, row0, scale, block, fp8, m_part, l_part, o_part):
  """kv u8[2, B, K, R, row bytes]; the rest as in `attend`; m_part, l_part, o_part: scratch for the blocks' partials
  (`_partials`), written in full before they are read. Returns (o, lse).

  Per task: s f32[G, rows] scores, widened in chunks of _CHUNK rows (K: 4 rows per pass over q; V: 8 rows per
  update of the accumulator, the padding rows weighted 0)."""
  nb, nk, ng, dh = q.shape
  nblk = (r1 - r0 + block - 1) // block
  for task in numba.prange(nb * nk * nblk):
    b, k, j = task // (nk * nblk), task // nblk % nk, task % nblk
    lo = max(r0 + j * block, start[b] - row0)
    n = min(r0 + (j + 1) * block, r1) - lo
    o_part[b, k, j] = 0.0
    if n <= 0:  # Every row of the block is padding.
      m_part[b, k, j] = -np.inf
      l_part[b, k, j] = 0.0
      continue
    buf = np.empty((_CHUNK, dh), np.float32)
    buf_bits = buf.view(np.uint32)
    scl = np.empty(max(dh // min(INT8_BLOCK, INT4_BLOCK), 1), np.float32)
    scl_bits = scl.view(np.uint32)
    padded = (n + _CHUNK - 1) // _CHUNK * _CHUNK
    s = np.zeros((ng, padded), np.float32)
    exp_bits = np.empty(padded, np.uint32)
    qk = q[b, k]
    for c0 in range(0, n, _CHUNK):
      _widen(kv[0, b, k], lo + c0, min(_CHUNK, n - c0), code, buf, buf_bits, scl, scl_bits, fp8)
      for g in range(ng):
        qg = qk[g]
        for c in range(0, _CHUNK, 4):
          a0, a1, a2, a3 = np.float32(0.0), np.float32(0.0), np.float32(0.0), np.float32(0.0)
          for d in range(dh):
            a0 += qg[d] * buf[c, d]
            a1 += qg[d] * buf[c + 1, d]
            a2 += qg[d] * buf[c + 2, d]
            a3 += qg[d] * buf[c + 3, d]
          s[g, c0 + c], s[g, c0 + c + 1], s[g, c0 + c + 2], s[g, c0 + c + 3] = a0, a1, a2, a3
    for g in range(ng):
      sg = s[g]
      m = np.float32(-np.inf)
      for i in range(n):
        sg[i] *= scale
        m = max(m, sg[i])
      for i in range(n):
        sg[i] -= m
      _exp_nonpositive(sg, n, exp_bits)
      total = np.float32(0.0)
      for i in range(n):
        total += sg[i]
      sg[n:] = 0.0
      m_part[b, k, j, g] = m
      l_part[b, k, j, g] = total
    for c0 in range(0, n, _CHUNK):
      _widen(kv[1, b, k], lo + c0, min(_CHUNK, n - c0), code, buf, buf_bits, scl, scl_bits, fp8)
      for g in range(ng):
        acc = o_part[b, k, j, g]
        p = s[g, c0 : c0 + _CHUNK]
        for d in range(dh):
          acc[d] += (
              p[0] * buf[0, d]
              + p[1] * buf[1, d]
              + p[2] * buf[2, d]
              + p[3] * buf[3, d]
              + p[4] * buf[4, d]
              + p[5] * buf[5, d]
              + p[6] * buf[6, d]
              + p[7] * buf[7, d]
          )
  o = np.zeros((nb, nk, ng, dh), np.float32)
  lse = np.full((nb, nk, ng), -np.inf, np.float32)
  # The blocks' merge, one task per query head: serial, it took ~0.06 ms of a 1 ms call on the H200 host.
  for bkg in numba.prange(nb * nk * ng):
    b, k, g = bkg // (nk * ng), bkg // ng % nk, bkg % ng
    m = np.float32(-np.inf)
    for j in range(nblk):
      m = max(m, m_part[b, k, j, g])
    if m == -np.inf:
      continue
    total = np.float32(0.0)
    for j in range(nblk):  # In block order.
      w = np.exp(m_part[b, k, j, g] - m)
      total += w * l_part[b, k, j, g]
      for d in range(dh):
        o[b, k, g, d] += w * o_part[b, k, j, g, d]
    for d in range(dh):
      o[b, k, g, d] /= total
    lse[b, k, g] = m + np.log(total)
  return o, lse
