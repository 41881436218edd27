"""Quantized and narrowed KV caches (jaxkv.kv_quant): packing bounds, accuracy against the f32 cache, bytes moved,
and the errors for what cannot run. Bitwise equality across placements and depths per KV dtype is in
test_transport.py."""

import dataclasses

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import tiny
from jaxkv import config as config_lib
from jaxkv import kv_quant
from jaxkv import mesh as mesh_lib
from jaxkv import model

DH = 32  # int8 and int4 need head_dim % 32 == 0: the tiny model (head_dim 16) with head_dim 32.
LENGTHS = tuple(range(1, 48, 3))  # 16 sequences, 1..46 prompt tokens: prefill and decode over 1..8 blocks.
NEW = 16


def _cfg():
  return helpers.tiny_config(head_dim=DH)


def _format(kv_dtype, head_dim=128, dtype="float32"):
  m = dataclasses.replace(_cfg().model, head_dim=head_dim, dtype=dtype)
  return kv_quant.KVFormat.of(m, kv_dtype)


def _random_rows(shape, seed=0):
  """Gaussian rows whose scale varies over 2^-12..2^12 from row to row, and one all-zero row."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * np.exp2(rng.uniform(-12, 12, shape[:-1] + (1,)))
  x[(0,) * (len(shape) - 1)] = 0.0
  return x.astype(np.float32)


def _scales(stored, head_dim):
  return np.asarray(kv_quant._scales(jnp.asarray(stored)[..., head_dim:]))  # pylint: disable=protected-access


def test_packed_layout_widths_and_dtypes():
  for kv_dtype, width, dtype in [
      ("int8", 128 + 4 * 2, np.uint8),  # 128 int8 values + 4 f16 scales: 136 B for 256 of bf16.
      ("int4", 64 + 4 * 2, np.uint8),  # 128 4-bit values + 4 f16 scales: 72 B.
      ("float8_e4m3fn", 128 + 2, np.uint8),
      ("bfloat16", 128, jnp.bfloat16),
      ("float32", 128, np.float32),
      ("model", 128, jnp.bfloat16),
  ]:
    fmt = _format(kv_dtype, dtype="bfloat16")
    assert (fmt.width, fmt.storage_dtype, fmt.row_bytes) == (width, np.dtype(dtype), width * np.dtype(dtype).itemsize)
    stored = jax.eval_shape(fmt.pack, jax.ShapeDtypeStruct((2, 3, 4, 5, 128), jnp.bfloat16))
    assert stored.shape == (2, 3, 4, 5, width) and stored.dtype == dtype
    values = jax.eval_shape(fmt.unpack, stored)
    assert values.shape == (2, 3, 4, 5, 128) and values.dtype == fmt.values_dtype
    assert values.dtype == (np.float32 if kv_dtype == "float32" else jnp.bfloat16)  # Quantized: the model dtype.


@pytest.mark.parametrize("kv_dtype", ["int8", "int4", "float8_e4m3fn", "bfloat16", "float32"])
def test_zero_bytes_decode_to_zeros_and_zeros_pack_to_zero_bytes(kv_dtype):
  """Open pages and the padding of a placed prefill (jitted.Fns.place) are zero bytes: they must read as 0 in every
  format."""
  fmt = _format(kv_dtype)
  zeros = np.zeros((2, 1, 2, 3, fmt.width), fmt.storage_dtype)
  np.testing.assert_array_equal(np.asarray(jax.jit(fmt.unpack)(zeros), np.float32), 0.0)
  np.testing.assert_array_equal(np.asarray(jax.jit(fmt.pack)(np.zeros((2, 1, 2, 3, 128)))).view(np.uint8), 0)


def test_int8_round_trip_error_is_at_most_half_a_scale_per_block():
  """q = round(x / scale) with |x| / scale <= 127 (the scale is rounded up to float16, never down), and
  q * scale is exact in f32 (7 + 11 significant bits): |x - deq| <= scale / 2 per block of 32, up to the f32
  rounding of x / scale (2^-24 relative, i.e. <= 127 * 2^-24 scale)."""
  x = _random_rows((4, 3, 8, 5, 128))
  stored = jax.jit(kv_quant.pack_int8)(x)
  deq = np.asarray(jax.jit(lambda s: kv_quant.unpack_int8(s, jnp.float32))(stored))
  scale = _scales(stored, 128)  # [..., 4]
  blocks = lambda a: a.reshape(*a.shape[:-1], 4, 32)
  err = np.abs(blocks(deq) - blocks(x)).max(-1)
  assert np.all(err <= scale / 2 * (1 + 2**-16)), (err / scale).max()
  amax = np.abs(blocks(x)).max(-1)
  assert np.all(scale >= amax / 127)  # Rounded up: no value clips.
  normal = scale >= 2**-14  # float16 normal: the rounding-up costs at most one float16 step, 2^-10 relative.
  assert np.all(scale[normal] <= amax[normal] / 127 * (1 + 2**-10))
  assert np.all(deq[0, 0, 0, 0] == 0) and np.all(scale[0, 0, 0, 0] == 0)


def test_int4_round_trip_error_is_at_most_half_a_scale_but_at_the_clipped_end():
  """m = the block's value of largest magnitude, scale = -m / 8 with |scale| rounded up to float16: q = round(x /
  scale) lies in [-8, 8], m's at -8; q = 8 (a value of the other sign, |x| >= 7.5 |scale|) clips to 7. So |x - deq|
  <= |scale| / 2 per block of 32 but for those values, which err by at most |scale|; q * scale is exact in f32."""
  x = _random_rows((4, 3, 8, 5, 128), seed=3)
  stored = jax.jit(kv_quant.pack_int4)(x)
  deq = np.asarray(jax.jit(lambda s: kv_quant.unpack_int4(s, jnp.float32))(stored))
  scale = _scales(stored, 64)  # [..., 4], signed.
  blocks = lambda a: a.reshape(*a.shape[:-1], 4, 32)
  y = blocks(x) / np.where(scale == 0, 1, scale)[..., None]  # x / scale.
  err = np.abs(blocks(deq) - blocks(x))
  slack = 1 + 2**-16  # The f32 rounding of x / scale.
  clipped = y > 7.5
  assert np.all(err[~clipped] <= (np.abs(scale)[..., None] / 2 * slack).repeat(32, -1)[~clipped])
  assert np.all(err <= np.abs(scale)[..., None] * slack)
  assert clipped.any() and np.all(y >= -8) and np.all(y <= 8)
  amax = np.abs(blocks(x)).max(-1)
  m = np.take_along_axis(blocks(x), np.abs(blocks(x)).argmax(-1)[..., None], -1)[..., 0]
  assert np.all(np.sign(scale) == -np.sign(m))  # m maps to q = -8.
  normal = np.abs(scale) >= 2**-14
  assert np.all(np.abs(scale) >= amax / 8)
  assert np.all(np.abs(scale)[normal] <= amax[normal] / 8 * (1 + 2**-10))
  assert np.all(deq[0, 0, 0, 0] == 0) and np.all(scale[0, 0, 0, 0] == 0)
  # Relative error over the row: ~2.1 sigma / 8 / sqrt(12) per value and some clipping (measured 8.6%).
  rel = np.linalg.norm(deq - x, axis=-1) / np.maximum(np.linalg.norm(x, axis=-1), 1e-30)
  assert rel.max() < 0.15, rel.max()


def test_int4_packing_layout():
  """Byte 16 j + i holds value 32 j + i in its low nibble and 32 j + 16 + i in its high one, each q in 4-bit two's
  complement; then the blocks' float16 scales, little-endian. A block whose extreme is negative gets a positive
  scale, one whose extreme is positive a negative one: both give that extreme q = -8."""
  q = np.concatenate([np.arange(-8, 8), np.arange(7, -9, -1)])  # -8..7, then 7..-8: every nibble, low and high.
  q = np.stack([q, np.roll(q, 5)])  # Two blocks, 64 values.
  x = np.concatenate([0.5 * q[0], -0.25 * q[1]]).astype(np.float32)  # Scales 0.5 and -0.25.
  stored = np.asarray(jax.jit(kv_quant.pack_int4)(x))
  nibbles = (q & 0xF).astype(np.uint8)
  want = np.concatenate([nibbles[0, :16] | nibbles[0, 16:] << 4, nibbles[1, :16] | nibbles[1, 16:] << 4])
  scales = np.array([0.5, -0.25], "<f2").view(np.uint8)
  np.testing.assert_array_equal(stored, np.concatenate([want, scales]))
  assert (stored[0], stored[8], stored[15]) == (0x78, 0xF0, 0x87)  # (low, high) = (-8, 7), (0, -1), (7, -8).
  np.testing.assert_array_equal(np.asarray(kv_quant.unpack_int4(jnp.asarray(stored), jnp.float32)), x)


def test_fp8_round_trip_relative_error_is_at_most_2_to_the_minus_4():
  """e4m3 keeps 3 mantissa bits: in its normal range (|y| >= 2^-6, y = x / scale) neighbours are 2^-3 of the
  leading power of two apart, so round-to-nearest errs by at most 2^-4 of |y|, hence of |x|; below, the
  subnormal step is 2^-9, so the error is at most 2^-10 scale. |y| <= 448 never clips (scale rounded up)."""
  x = _random_rows((4, 3, 8, 5, 128), seed=1)
  stored = jax.jit(kv_quant.pack_fp8)(x)
  deq = np.asarray(jax.jit(lambda s: kv_quant.unpack_fp8(s, jnp.float32))(stored))
  scale = _scales(stored, 128)  # [..., 1]
  err = np.abs(deq - x)
  normal = np.abs(x) >= 2**-6 * scale
  assert np.all(err[normal] <= 2**-4 * np.abs(x[normal]) * (1 + 2**-16))
  sub = np.broadcast_to(scale, x.shape)[~normal]
  assert np.all(err[~normal] <= 2**-10 * sub * (1 + 2**-16))
  assert np.all(scale >= np.abs(x).max(-1, keepdims=True) / 448)
  # Relative error over the row, as the attention sees it: well under the 2^-4 worst case (measured ~2.4%).
  rel = np.linalg.norm(deq - x, axis=-1) / np.maximum(np.linalg.norm(x, axis=-1), 1e-30)
  assert rel.max() < 0.04, rel.max()


def test_quantized_formats_pack_per_head_row_only():
  """Packing a row never reads another row: the same row packs the same wherever it sits (needed for the open
  page written one row at a time to equal a prefilled chunk)."""
  x = _random_rows((2, 2, 4, 6, 64), seed=2)
  for kv_dtype in kv_quant.QUANTIZED:
    pack = jax.jit(_format(kv_dtype, head_dim=64).pack)
    whole = np.asarray(pack(x))
    one = np.asarray(pack(x[:, :, :, 3:4]))
    np.testing.assert_array_equal(whole[:, :, :, 3:4], one)


def test_packing_sharded_over_heads_gives_the_unsharded_bytes():
  """The cache is sharded on K (jaxkv.mesh.CACHE_AXES): packing and unpacking act per head row, so each device
  packs its own heads to the bytes the unsharded packing gives, and the packed array keeps the heads' sharding."""
  sharding = mesh_lib.sharding(helpers.mesh(4), mesh_lib.CACHE_AXES)
  x = _random_rows((2, 3, 4, 5, 64), seed=4)
  for kv_dtype in kv_quant.QUANTIZED:
    fmt = _format(kv_dtype, head_dim=64)
    stored = jax.jit(fmt.pack)(jax.device_put(x, sharding))
    assert stored.sharding.is_equivalent_to(sharding, 5), kv_dtype
    assert {s.data.shape for s in stored.addressable_shards} == {(2, 3, 1, 5, fmt.width)}
    np.testing.assert_array_equal(np.asarray(stored), np.asarray(jax.jit(fmt.pack)(x)))
    values = jax.jit(fmt.unpack)(stored)
    assert values.sharding.is_equivalent_to(sharding, 5), kv_dtype
    np.testing.assert_array_equal(np.asarray(values), np.asarray(jax.jit(fmt.unpack)(np.asarray(stored))))


@pytest.mark.parametrize("layer", [0, 3])
def test_attention_output_error_against_the_f32_cache(layer):
  """One layer's attention over 24 keys with K and V stored in each format vs f32 K and V.

  Expected relative (Frobenius) error of K, V: bf16 ~2^-9 (0.17% measured); int8 ~scale/sqrt(12) with
  scale ~ max of 32 Gaussians / 127 ~ 2.1 sigma / 127, i.e. ~0.5% (0.53% measured); fp8 ~2^-3 / sqrt(12) of
  each value's leading power of two, ~2.4% measured; int4 ~2.1 sigma / 8 / sqrt(12) and the clipped values, 8.6%
  measured. Softmax-weighted sums pass it on at ~1.2x (measured: 0.29%, 0.64%, 2.9%, 10.5% at most over 6 layers
  and 3 inputs). Thresholds: about 2x the measured values, so the ordering bf16 < int8 < fp8 < int4 holds too.
  """
  cfg = _cfg().model
  bounds = {"bfloat16": 0.006, "int8": 0.013, "float8_e4m3fn": 0.06, "int4": 0.2}

  @jax.jit
  def relative_errors(p, x):
    pos = jnp.broadcast_to(jnp.arange(24), (2, 24))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((24, 24), bool)), (2, 24, 24))
    q, k, v = model.qkv(p, x, pos, cfg)
    kv = jnp.stack([k, v]).transpose(0, 1, 3, 2, 4)
    ref = model.attention(q, kv, mask)
    out = {}
    for kv_dtype in bounds:
      fmt = kv_quant.KVFormat.of(cfg, kv_dtype)
      o = model.attention(q, fmt.unpack(fmt.pack(kv)), mask)
      assert o.dtype == jnp.float32
      out[kv_dtype] = jnp.linalg.norm(o - ref) / jnp.linalg.norm(ref)
    return out

  p = helpers.params(1, 0, cfg)["layers"][layer]
  x = np.random.default_rng(layer).standard_normal((2, 24, cfg.d_model)).astype(np.float32)
  errors = {k: float(v) for k, v in relative_errors(p, x).items()}
  for kv_dtype, bound in bounds.items():
    assert errors[kv_dtype] < bound, (kv_dtype, errors[kv_dtype])
  assert errors["bfloat16"] < errors["int8"] < errors["float8_e4m3fn"] < errors["int4"], errors


def _decode(kv_dtype, placement="device", on_step=None):
  # Blocks of 32 and one prefill chunk: few compiled shapes (the values do not depend on them).
  eng = helpers.engine(1, placement=placement, block=32, chunk=64, cfg=_cfg(), kv_dtype=kv_dtype)
  return eng.generate(helpers.prompts(LENGTHS), NEW, keep_logits=True, on_step=on_step)


@pytest.fixture(scope="module")
def decodes():
  """Greedy decodes of 16 prompts x 16 tokens on the head_dim-32 tiny f32 model with each KV dtype."""
  return {d: _decode(d) for d in ("model", "bfloat16", "int8", "int4", "float8_e4m3fn")}


# kv dtype: (max |logit - f32 logit| over the steps whose context equals the f32 run's, floor on the tokens
# equal to the f32 run's, floor on the greedy decisions that agree given the same context).
ACCURACY = {
    "bfloat16": (0.04, 0.9, 0.97),
    "int8": (0.08, 0.75, 0.95),
    "float8_e4m3fn": (0.4, 0.5, 0.9),
    "int4": (1.1, 0.3, 0.8),
}


@pytest.mark.parametrize("kv_dtype", sorted(ACCURACY))
def test_logits_and_greedy_tokens_against_the_f32_cache(kv_dtype, decodes):
  """Measured on 6 prompt seeds (this test runs seed 0: 0.020, 0.94, 0.99 / 0.039, 0.93, 0.99 / 0.18, 0.62,
  0.94 / int4 0.63, 0.41, 0.87), 256 tokens each:
  bf16: max |dlogit| 0.015-0.025, tokens equal 0.91-1.0, decisions 0.98-1.0;
  int8: max |dlogit| 0.037-0.050, tokens equal 0.80-0.98, decisions 0.97-1.0;
  fp8:  max |dlogit| 0.15-0.25, tokens equal 0.57-0.83, decisions 0.93-0.97;
  int4: max |dlogit| 0.56-0.71, tokens equal 0.03-0.10 (0.37-0.58 over this test's 16 tokens), decisions 0.83-0.92
  (16 tokens; 0.86-0.91 over 256).
  The logit error follows the KV error (0.17%, 0.53%, 2.4%, 8.6%, see above) times this model's sensitivity. This
  random-weight model has near-flat outputs (|logits| <= ~5 over 256 tokens; median top-2 gap ~0.25), so a
  small error flips a close greedy choice and, free-running, the rest of that sequence; per-decision
  agreement (same context) is the steadier figure. Thresholds: ~1.6x the worst measured logit error, floors
  below the worst measured agreement."""
  max_dlogit, tokens_floor, decisions_floor = ACCURACY[kv_dtype]
  ref, res = decodes["model"], decodes[kv_dtype]
  a, b = np.array(ref.tokens), np.array(res.tokens)
  # Step t's logits see the same context when every earlier token agrees.
  same = np.concatenate([np.ones((len(a), 1), bool), np.cumprod(a == b, axis=1)[:, :-1].astype(bool)], axis=1)
  dlogit = np.abs(res.logits - ref.logits).max(-1).T  # [B, steps]
  tokens_equal, decisions = (a == b).mean(), (a == b)[same].mean()
  print(
      f"{kv_dtype}: max |dlogit| {dlogit[same].max():.4f}, tokens equal {tokens_equal:.3f}, decisions {decisions:.3f}"
  )
  assert dlogit[same].max() < max_dlogit
  assert tokens_equal >= tokens_floor
  assert decisions >= decisions_floor
  assert dlogit[same].max() > 0  # The format is in effect.


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_auto_placement_is_bit_identical_to_device_with_quantized_rows(kv_dtype):
  """With packed rows, auto keeping 3, 2 or 1 of the 6 layers on the device (one layer per group) at depths 0, 1
  and 2 gives the device placement's tokens and logits, and moves only its streamed layers' packed rows
  (tests/test_transport.py runs device and host at every depth with each KV dtype)."""
  cfg, prompts, new = _cfg(), helpers.prompts((1, 7, 8, 9, 19)), 14  # Blocks of 8: windows grow while decoding.
  ref = helpers.engine(2, placement="device", cfg=cfg, kv_dtype=kv_dtype).generate(prompts, new, keep_logits=True)
  host = helpers.engine(2, placement="host", depth=2, group_layers=1, cfg=cfg, kv_dtype=kv_dtype).generate(prompts, new)
  assert (host.tokens_sha256, host.logits_sha256) == (ref.tokens_sha256, ref.logits_sha256)
  for depth, layers in ((0, 3), (1, 2), (2, 1)):
    eng = helpers.engine(2, placement="auto", depth=depth, group_layers=1, cfg=cfg, kv_dtype=kv_dtype)
    layer = helpers.layer_bytes(eng, len(prompts))
    eng = helpers.with_kv(eng, device_budget_gib=(layers * layer + layer // 2) / 2**30)
    res = eng.generate(prompts, new, keep_logits=True)
    np.testing.assert_array_equal(res.logits, ref.logits, err_msg=str(depth))
    assert (res.tokens_sha256, res.logits_sha256) == (ref.tokens_sha256, ref.logits_sha256)
    assert res.transport["residency"]["resident_layers"] == layers and res.transport["depth"] == depth
    assert res.transport["h2d_bytes"] * 6 == host.transport["h2d_bytes"] * (6 - layers)


def test_float32_kv_dtype_is_the_f32_model_dtype(decodes):
  assert _decode("float32").logits_sha256 == decodes["model"].logits_sha256


def test_bytes_per_decode_step_shrink_by_the_packed_row_ratio(decodes):
  """h2d/d2h telemetry counts the stored bytes: an int8 row is Dh + Dh / 32 * 2 B, (Dh + Dh / 16) / (2 Dh) of
  a bf16 row; int4 Dh / 2 + Dh / 32 * 2 B; fp8 Dh + 2 B. Host placement: the same tokens as the device runs, fewer
  bytes. Open pages hold packed rows too."""
  moved = {}
  for kv_dtype in ("bfloat16", "int8", "int4", "float8_e4m3fn"):
    pages = []
    res = _decode(kv_dtype, placement="host", on_step=lambda step, cache: pages.append(cache.opens[0]))
    assert res.logits_sha256 == decodes[kv_dtype].logits_sha256  # Compiled already by `decodes`.
    moved[kv_dtype] = (res.transport["h2d_bytes"], res.transport["d2h_bytes"])
    fmt = kv_quant.KVFormat.of(_cfg().model, kv_dtype)
    assert pages[0].dtype == fmt.storage_dtype and pages[0].shape == (2, len(LENGTHS), 8, 32, fmt.width)
  row = {"bfloat16": DH * 2, "int8": DH + DH // 32 * 2, "int4": DH // 2 + DH // 32 * 2, "float8_e4m3fn": DH + 2}
  assert moved["bfloat16"][0] > 0 and moved["bfloat16"][1] > 0
  for kv_dtype in ("int8", "int4", "float8_e4m3fn"):
    for got, bf16 in zip(moved[kv_dtype], moved["bfloat16"]):
      assert got * row["bfloat16"] == bf16 * row[kv_dtype], kv_dtype


def test_cache_row_bytes_and_pinned_pool_sizing_use_the_packed_rows():
  cfg = _cfg()
  sizes = {}
  for kv_dtype in ("model", "int8", "int4"):
    kv = dataclasses.replace(cfg.kv, placement="host", dtype=kv_dtype)
    c = helpers.kv_cache(cfg.model, kv, helpers.mesh(2), batch=3, capacity=64)
    sizes[kv_dtype] = (c.row_bytes(2), c.host_bytes_per_process(), c.dtype, c.row_width)
  assert sizes["model"][0] == 2 * 3 * 4 * DH * 4 and sizes["model"][2:] == (np.float32, DH)
  for kv_dtype, width in (("int8", DH + 2), ("int4", DH // 2 + 2)):
    assert sizes[kv_dtype][0] == 2 * 3 * 4 * width and sizes[kv_dtype][2:] == (np.uint8, width)
    assert sizes[kv_dtype][1] * DH * 4 == sizes["model"][1] * width  # Pinned-pool sizing.


def test_bad_kv_dtypes_raise_clear_errors():
  with pytest.raises(ValueError, match="kv.dtype must be one of model, bfloat16, float32, int8, int4, float8_e4m3fn"):
    config_lib.KVConfig(dtype="int2")
  cd = tiny.get_config()  # head_dim 16
  for kv_dtype in ("int8", "int4"):
    cd.kv.dtype = kv_dtype
    with pytest.raises(
        ValueError, match=rf"kv.dtype {kv_dtype} .* model.head_dim must be a multiple of 32; got head_dim 16"
    ):
      config_lib.from_config_dict(cd)
    with pytest.raises(ValueError, match="head_dim"):
      kv_quant.KVFormat.of(helpers.tiny_config().model, kv_dtype)
    with pytest.raises(ValueError, match="head_dim"):
      helpers.engine(1, kv_dtype=kv_dtype)
  cd.kv.dtype = "float8_e4m3fn"
  assert config_lib.from_config_dict(cd).kv.dtype == "float8_e4m3fn"  # One scale per row: any head_dim.
