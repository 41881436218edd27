"""How KV cache rows are stored: a float dtype, or quantized rows packed with their scales in one uint8 array.

A stored cache array keeps the layout of jaxkv.cache, [2, B, K, R, E], and only its last axis E and dtype depend
on the KV dtype (Dh = head_dim):

  "bfloat16", "float32" (and "model" = the model dtype):  E = Dh values of that dtype.
  "int8":           u8[..., Dh + Dh // 16]: Dh int8 values, then Dh / 32 float16 scales as 2 bytes each
                    (little-endian on every platform jax runs on). llama.cpp q8_0 style: one scale per block of
                    32 values along head_dim, scale = max|x| / 127, q = round(x / scale). Dh = 128: 136 B per
                    row instead of 256 (bf16), 0.53x.
  "int4":           u8[..., Dh / 2 + Dh / 16]: Dh 4-bit values, two per byte, then Dh / 32 float16 scales.
                    llama.cpp q4_0 style: one scale per block of 32 values along head_dim; the block's value of
                    largest magnitude, m, maps to q = -8: scale = -m / 8 (signed), q = clip(round(x / scale), -8, 7).
                    Nibble order (llama.cpp's): byte 16 j + i of the values holds value 32 j + i of the row in its
                    low nibble and value 32 j + 16 + i in its high nibble, so a block unpacks into two contiguous
                    runs of 16 (no interleave); a nibble is q in 4-bit two's complement (q4_0's nibble xor 8), so
                    the byte 0x00 is two zeros whatever the scale. Dh = 128: 72 B per row, 0.28x bf16.
  "float8_e4m3fn":  u8[..., Dh + 2]: Dh float8_e4m3fn values, then one float16 scale for the row,
                    scale = max|x| / 448 (448 = e4m3fn's largest finite value). Dh = 128: 130 B per row, 0.51x.

Why one array: each layer's window is delivered with ONE host->device transfer, whose host issue cost (~60 us
on the GPU host) would double with a separate scale array. Why one fp8 scale per (head, token) row: e4m3 carries
its own exponent, so it needs a scale only to map the row's range onto [-448, 448], not per small block as
int8 does; every element keeps 3 mantissa bits (relative error <= 2^-4) over e4m3's normal range, which spans
2^-6..448, i.e. values down to ~2^-15 of the row's largest. One scale per delivered row costs 2 bytes per 128
values (1.6%); int8's per-32 blocks cost 8 bytes per 128.

Why int4 is q4_0 (all 16 levels, 72 B) and not q4_1 (a float16 minimum per block too, 80 B): docs/design.md.

Scales are the float32 max|x| / qmax rounded UP to float16 (never down; int4's in magnitude), so max|x| / |scale| <=
qmax: no int8 or fp8 value clips, int4's only as bounded below. The quantizers divide by the float16 scale they
store, so pack/unpack are exactly consistent:
  int8: |x - unpack(pack(x))| <= scale / 2 for every value of the block.
  int4: |x - unpack(pack(x))| <= |scale| / 2, except values of the sign opposite to m with |x| > 7.5 |scale|, which
        clip from q = 8 to 7 and err by at most |scale| (= |m| / 8, rounded up).
  fp8:  |x - unpack(pack(x))| <= 2^-4 |x| for |x| >= 2^-6 scale (e4m3's normal range), and <= 2^-10 scale below
        (its subnormal step 2^-9, halved).
A zero block or row gets scale 0 and packs to zero bytes; all-zero bytes decode to zeros (open pages start so).
Limits: |x| above 127 x 65504 (int8), 8 x 65504 (int4) or 448 x 65504 (fp8) saturates; KV activations are far
smaller.

Rows are quantized once, on the device, when they are written (jaxkv.model), and dequantized on the device
inside the layer function that attends over them, so every placement and delivery depth sees the same values
(jaxkv.host_attention's kernel reads the same bytes on the CPU).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxkv import config as config_lib
from jaxkv.config import ModelConfig

QUANTIZED = ("int8", "int4", "float8_e4m3fn")
INT8_BLOCK = config_lib.INT8_BLOCK
INT8_MAX = 127.0
INT4_BLOCK = config_lib.INT4_BLOCK
INT4_HALF = INT4_BLOCK // 2  # Bytes of a block's values; value i and i + INT4_HALF share byte i.
INT4_MIN = -8.0  # q of the value of largest magnitude.
FP8_MAX = 448.0  # Largest finite float8_e4m3fn.
SCALE_BYTES = 2  # A float16 scale.
_F16_MAX = 65504.0


@dataclasses.dataclass(frozen=True)
class KVFormat:
  """The storage of one head row of Dh values. name: "bfloat16", "float32", "float16", "int8", "int4" or
  "float8_e4m3fn"
  ("model" resolved); compute_dtype: the model dtype, which quantized rows are dequantized to."""

  name: str
  head_dim: int
  compute_dtype: str

  @classmethod
  def of(cls, model: ModelConfig, kv_dtype: str = "model") -> KVFormat:
    """The format of `kv_dtype` (one of config.KV_DTYPES) for `model`; ValueError when it cannot hold it."""
    config_lib.check_kv_dtype(kv_dtype, model.head_dim)
    return cls(model.dtype if kv_dtype == "model" else kv_dtype, model.head_dim, model.dtype)

  @property
  def quantized(self) -> bool:
    return self.name in QUANTIZED

  @property
  def storage_dtype(self) -> jnp.dtype:
    """dtype of the stored array: uint8 (packed) for quantized rows, else the float dtype."""
    return jnp.dtype(jnp.uint8 if self.quantized else self.name)

  @property
  def width(self) -> int:
    """E, the last axis of the stored array."""
    if self.name == "int8":
      return self.head_dim + self.head_dim // INT8_BLOCK * SCALE_BYTES
    if self.name == "int4":
      return self.head_dim // 2 + self.head_dim // INT4_BLOCK * SCALE_BYTES
    if self.name == "float8_e4m3fn":
      return self.head_dim + SCALE_BYTES
    return self.head_dim

  @property
  def row_bytes(self) -> int:
    """Bytes of one stored head row (Dh values and their scales)."""
    return self.width * self.storage_dtype.itemsize

  @property
  def values_dtype(self) -> jnp.dtype:
    """dtype that `unpack` returns: the stored float dtype, or the model dtype for quantized rows."""
    return jnp.dtype(self.compute_dtype if self.quantized else self.name)

  def pack(self, x: jax.Array) -> jax.Array:
    """x [..., Dh] (any float dtype) -> stored [..., E] of storage_dtype."""
    if self.name == "int8":
      return pack_int8(x)
    if self.name == "int4":
      return pack_int4(x)
    if self.name == "float8_e4m3fn":
      return pack_fp8(x)
    return x.astype(self.name)

  def unpack(self, stored: jax.Array) -> jax.Array:
    """stored [..., E] -> values [..., Dh] of values_dtype."""
    if self.name == "int8":
      return unpack_int8(stored, self.values_dtype)
    if self.name == "int4":
      return unpack_int4(stored, self.values_dtype)
    if self.name == "float8_e4m3fn":
      return unpack_fp8(stored, self.values_dtype)
    return stored


def _scale_up_f16(amax: jax.Array, qmax: float) -> jax.Array:
  """f32 amax [...] -> f16 [...] scale >= amax / qmax (the nearest float16 at or above it; capped at 65504)."""
  d = amax.astype(jnp.float32) / qmax
  s = jnp.minimum(d, _F16_MAX).astype(jnp.float16)
  bits = jax.lax.bitcast_convert_type(s, jnp.uint16)
  up = jax.lax.bitcast_convert_type(bits + jnp.uint16(1), jnp.float16)  # Next float16 up (s >= 0).
  return jnp.where((s.astype(jnp.float32) < d) & (s < _F16_MAX), up, s)


def _scale_bytes(scale: jax.Array) -> jax.Array:
  """f16 [..., n] -> u8 [..., 2n]."""
  b = jax.lax.bitcast_convert_type(scale, jnp.uint8)  # [..., n, 2]
  return b.reshape(*scale.shape[:-1], scale.shape[-1] * SCALE_BYTES)


def _scales(stored_tail: jax.Array) -> jax.Array:
  """u8 [..., 2n] -> f32 [..., n]."""
  b = stored_tail.reshape(*stored_tail.shape[:-1], stored_tail.shape[-1] // SCALE_BYTES, SCALE_BYTES)
  return jax.lax.bitcast_convert_type(b, jnp.float16).astype(jnp.float32)


def _divide(x: jax.Array, scale: jax.Array) -> jax.Array:
  """x / scale in f32, 0 where the scale is 0 (an all-zero block)."""
  s = scale.astype(jnp.float32)
  return jnp.where(s != 0, x / jnp.where(s != 0, s, 1.0), 0.0)


def pack_int8(x: jax.Array) -> jax.Array:
  """x [..., Dh] float, Dh % 32 == 0 -> u8[..., Dh + Dh // 16]: Dh int8 values, then Dh // 32 f16 scales."""
  *lead, dh = x.shape
  blocks = x.astype(jnp.float32).reshape(*lead, dh // INT8_BLOCK, INT8_BLOCK)
  scale = _scale_up_f16(jnp.max(jnp.abs(blocks), axis=-1), INT8_MAX)  # f16 [..., Dh / 32]
  q = jnp.clip(jnp.round(_divide(blocks, scale[..., None])), -INT8_MAX, INT8_MAX).astype(jnp.int8)
  q = jax.lax.bitcast_convert_type(q, jnp.uint8).reshape(*lead, dh)
  return jnp.concatenate([q, _scale_bytes(scale)], axis=-1)


def unpack_int8(stored: jax.Array, dtype) -> jax.Array:
  """u8[..., Dh + Dh // 16] -> [..., Dh] of dtype (computed in f32, then cast)."""
  *lead, e = stored.shape
  dh = e * INT8_BLOCK // (INT8_BLOCK + SCALE_BYTES)
  q = jax.lax.bitcast_convert_type(stored[..., :dh], jnp.int8).astype(jnp.float32)
  q = q.reshape(*lead, dh // INT8_BLOCK, INT8_BLOCK)
  return (q * _scales(stored[..., dh:])[..., None]).reshape(*lead, dh).astype(dtype)


def pack_int4(x: jax.Array) -> jax.Array:
  """x [..., Dh] float, Dh % 32 == 0 -> u8[..., Dh / 2 + Dh / 16]: Dh / 2 bytes of 4-bit values (two per byte, in
  the module docstring's order), then Dh // 32 f16 scales."""
  *lead, dh = x.shape
  blocks = x.astype(jnp.float32).reshape(*lead, dh // INT4_BLOCK, INT4_BLOCK)
  m = jnp.take_along_axis(blocks, jnp.argmax(jnp.abs(blocks), axis=-1, keepdims=True), axis=-1)[..., 0]
  size = _scale_up_f16(jnp.abs(m), -INT4_MIN)  # f16 [..., Dh / 32], >= |m| / 8.
  scale = jnp.where(m > 0, -size, size)  # m -> q = -8; a zero block keeps +0 (zero bytes).
  q = jnp.clip(jnp.round(_divide(blocks, scale[..., None])), INT4_MIN, -INT4_MIN - 1).astype(jnp.int32)
  nibbles = (q & 0xF).astype(jnp.uint8)  # 4-bit two's complement.
  packed = nibbles[..., :INT4_HALF] | nibbles[..., INT4_HALF:] << 4  # [..., Dh / 32, 16]
  return jnp.concatenate([packed.reshape(*lead, dh // 2), _scale_bytes(scale)], axis=-1)


def unpack_int4(stored: jax.Array, dtype) -> jax.Array:
  """u8[..., Dh / 2 + Dh / 16] -> [..., Dh] of dtype (computed in f32, then cast)."""
  *lead, e = stored.shape
  dh = e * INT4_BLOCK // (INT4_HALF + SCALE_BYTES)
  b = stored[..., : dh // 2].astype(jnp.int32).reshape(*lead, dh // INT4_BLOCK, INT4_HALF)
  signed = lambda nibble: (nibble ^ 8) - 8  # 4-bit two's complement -> int.
  q = jnp.concatenate([signed(b & 0xF), signed(b >> 4)], axis=-1).astype(jnp.float32)  # [..., Dh / 32, 32]
  return (q * _scales(stored[..., dh // 2 :])[..., None]).reshape(*lead, dh).astype(dtype)


def pack_fp8(x: jax.Array) -> jax.Array:
  """x [..., Dh] float -> u8[..., Dh + 2]: Dh float8_e4m3fn values, then the row's f16 scale."""
  x32 = x.astype(jnp.float32)
  scale = _scale_up_f16(jnp.max(jnp.abs(x32), axis=-1, keepdims=True), FP8_MAX)  # f16 [..., 1]
  y = jnp.clip(_divide(x32, scale), -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
  return jnp.concatenate([jax.lax.bitcast_convert_type(y, jnp.uint8), _scale_bytes(scale)], axis=-1)


def unpack_fp8(stored: jax.Array, dtype) -> jax.Array:
  """u8[..., Dh + 2] -> [..., Dh] of dtype (computed in f32, then cast)."""
  dh = stored.shape[-1] - SCALE_BYTES
  y = jax.lax.bitcast_convert_type(stored[..., :dh], jnp.float8_e4m3fn).astype(jnp.float32)
  return (y * _scales(stored[..., dh:])).astype(dtype)
