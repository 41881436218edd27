"""The decode attention's leaves and fold (jaxkv.decode_attention): against a plain reference, the Pallas kernel
(interpreted) against the XLA leaves, and a sequence's bits independent of the window's length, of the rows its rows
sit at and of the batch around it, from the attention up to the server. The same checks see the legacy attention's
dependence on the window's length, so they fail if a reduction depends on the padded length again."""

import dataclasses
import functools
import types
from unittest import mock

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from jaxkv import decode_attention as da
from jaxkv import engine as engine_lib
from jaxkv import model
from jaxkv import serving
from jaxkv.kv_quant import KVFormat

S = da.LEAF_ROWS
IMPLS = {"xla": {}, "pallas": dict(interpret=True)}  # The kernel in Pallas's interpreter.


def _partials(rng, n, shape=(2, 3, 2), dh=4):
  m = rng.standard_normal((n, *shape)).astype(np.float32)
  l = rng.uniform(0.5, 3.0, (n, *shape)).astype(np.float32)
  o = rng.standard_normal((n, *shape, dh)).astype(np.float32)
  return da.Partials(jnp.asarray(m), jnp.asarray(l), jnp.asarray(o))


def _identities(n, shape=(2, 3, 2), dh=4):
  return da.Partials(jnp.full((n, *shape), -jnp.inf), jnp.zeros((n, *shape)), jnp.zeros((n, *shape, dh)))


def _equal(a: da.Partials, b: da.Partials) -> bool:
  return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b))


def _cat(*ps: da.Partials) -> da.Partials:
  return da.Partials(*(jnp.concatenate(parts) for parts in zip(*ps)))


def test_identities_fold_away_bit_for_bit():
  x, one = _partials(np.random.default_rng(0), 5), _identities(1)
  merge = jax.jit(da.merge)
  assert _equal(merge(x, _identities(5)), x) and _equal(merge(_identities(5), x), x)
  both = merge(one, one)
  assert _equal(both, one) and not np.isnan(np.asarray(both.l)).any()
  fold = jax.jit(da.fold)
  want = fold(x)  # 5 leaves, padded to 8.
  for extra in (1, 3, 4, 11):  # 8 and 16 leaves: trailing identities change nothing.
    assert _equal(fold(_cat(x, _identities(extra))), want), extra
  assert _equal(fold(_identities(3)), da.Partials(*(a[0] for a in _identities(1))))


def test_the_fold_is_the_union_of_the_leaves():
  x = _partials(np.random.default_rng(1), 6)
  m, l, o = (np.asarray(a, np.float64) for a in x)
  top = m.max(0)
  w = np.exp(m - top)
  got = jax.jit(da.fold)(x)
  np.testing.assert_allclose(got.m, top, rtol=0, atol=0)
  np.testing.assert_allclose(got.l, (w * l).sum(0), rtol=1e-6)
  np.testing.assert_allclose(got.o, (w[..., None] * o).sum(0), rtol=1e-5, atol=1e-6)


def _reference(q, kv, first_row, start, end):
  """float64 attention of q [B, K, G, Dh] over buffer rows kv [2, B, K, R, Dh] at absolute rows first_row + r, those
  in [start[b], end] -> o [B, K, G, Dh], lse [B, K, G]."""
  rows = first_row + np.arange(kv.shape[3])
  mask = (rows[None] >= np.asarray(start)[:, None]) & (rows[None] <= end)
  s = np.einsum("bkgd,bkrd->bkgr", np.asarray(q, np.float64), np.asarray(kv[0], np.float64)) / np.sqrt(q.shape[-1])
  s = np.where(mask[:, None, None, :], s, -np.inf)
  top = s.max(-1, keepdims=True)
  w = np.exp(s - top)
  return np.einsum("bkgr,bkrd->bkgd", w / w.sum(-1, keepdims=True), np.asarray(kv[1], np.float64)), (
      np.log(w.sum(-1)) + top[..., 0]
  )


# (first_row, window rows or 0, page rows, end - first_row - window rows, start): a window of 2 leaves and a half,
# starts below, at and past the first row and mid-leaf; a tail at row 512 (host attention's split); a page alone.
CASES = [
    (0, 2 * S + S // 2, 8, 5, (0, 37, 300, 2 * S + S // 2 + 3)),
    (512, S + 40, 16, 15, (0, 512, 600, 700)),
    (96, 0, 32, 20, (0, 100, 110, 116)),
]


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("case", range(len(CASES)))
def test_attention_over_the_leaves_matches_a_plain_reference(impl, case):
  first_row, w_rows, p_rows, past, start = CASES[case]
  rng = np.random.default_rng(case)
  b, k, g, dh = len(start), 2, 3, 16
  q = rng.standard_normal((b, k, g, dh)).astype(np.float32)
  kv = rng.standard_normal((2, b, k, w_rows + p_rows, dh)).astype(np.float32)
  parts = (kv[:, :, :, w_rows:],) if not w_rows else (kv[:, :, :, :w_rows], kv[:, :, :, w_rows:])
  end = first_row + w_rows + past
  attend = jax.jit(functools.partial(da.attend, impl=impl, **IMPLS[impl]))
  o, lse = attend(jnp.asarray(q), tuple(map(jnp.asarray, parts)), first_row, jnp.asarray(start, jnp.int32), end)
  want_o, want_lse = _reference(q, kv, first_row, start, end)
  np.testing.assert_allclose(o, want_o, rtol=1e-5, atol=2e-6)
  np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_the_kernel_computes_the_leaves_of_the_xla_reference():
  """Leaf by leaf, including leaves past the rows (identities, bit for bit) and a later range of leaves."""
  rng = np.random.default_rng(7)
  b, k, g, dh, w_rows, p_rows = 3, 2, 4, 32, 3 * S, 8
  q = jnp.asarray(rng.standard_normal((b, k, g, dh)), jnp.bfloat16)
  kv = jnp.asarray(rng.standard_normal((2, b, k, w_rows + p_rows, dh)), jnp.bfloat16)
  parts, start, end = (kv[:, :, :, :w_rows], kv[:, :, :, w_rows:]), jnp.array([0, 400, 770], jnp.int32), w_rows + 2
  for first_leaf, n in ((0, 6), (2, 3)):
    run = lambda impl: jax.jit(
        functools.partial(da.leaf_partials, num_leaves=n, first_leaf=first_leaf, impl=impl, **IMPLS[impl])
    )(q, parts, 0, start, end)
    kernel, ref = run("pallas"), run("xla")
    empty = np.asarray(ref.m) == -np.inf
    assert empty.any() and (~empty).any()
    np.testing.assert_array_equal(np.asarray(kernel.m) == -np.inf, empty)
    assert (np.asarray(kernel.l)[empty] == 0).all() and (np.asarray(kernel.o)[empty] == 0).all()
    for got, want in zip(kernel, ref):  # bfloat16 weights: the kernel rounds exp(s - m) of a tile's running max.
      np.testing.assert_allclose(np.asarray(got)[~empty], np.asarray(want)[~empty], rtol=2e-2, atol=2e-2)


def test_the_kernel_reads_int8_rows_packed_with_the_bits_of_their_unpacked_values():
  """int8 rows (KERNEL_UNPACKS) go to the kernel packed, each tile unpacked in it: the bits of the kernel over the
  rows unpacked first (kv_format.unpack), over a window and open page (a tile straddling them) and over a chunk's
  leaves (a traced first_leaf, jaxkv.chunked), with a sequence starting mid-window and masked tiles; values in
  bfloat16 and float32."""
  rng = np.random.default_rng(11)
  b, k, g, dh, w_rows, p_rows = 2, 2, 4, 64, 2 * S + 40, 16
  rows = jnp.asarray(4 * rng.standard_normal((2, b, k, w_rows + p_rows, dh)), jnp.float32)
  start, end = jnp.array([0, 300], jnp.int32), w_rows + 9
  for values_dtype in ("bfloat16", "float32"):
    fmt = KVFormat("int8", dh, values_dtype)
    q = jnp.asarray(rng.standard_normal((b, k, g, dh)), values_dtype)
    stored = fmt.pack(rows)
    parts = (stored[:, :, :, :w_rows], stored[:, :, :, w_rows:])
    values = tuple(fmt.unpack(p) for p in parts)
    assert da.attention_rows("pallas", fmt, parts) == parts
    attend = jax.jit(functools.partial(da.attend, impl="pallas", interpret=True), static_argnames="kv_format")
    for got, want in zip(attend(q, parts, 0, start, end, kv_format=fmt), attend(q, values, 0, start, end)):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    chunk = jax.jit(
        lambda parts, first_leaf, f: da.leaf_partials(
            q, parts, 0, start, end, 2, first_leaf=first_leaf, impl="pallas", interpret=True, kv_format=f
        ),
        static_argnums=2,
    )
    got, want = chunk(parts[:1], jnp.int32(1), fmt), chunk(values[:1], jnp.int32(1), None)
    assert np.isfinite(np.asarray(got.m)).any() and np.isinf(np.asarray(got.m)).any()
    for x, y in zip(got, want):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("kv_dtype", ["int8", "int4", "float8_e4m3fn"])
def test_only_the_kernel_reads_int8_packed_and_every_other_attention_gets_values_first(kv_dtype):
  """attention_rows: int8 rows as stored for the kernel; for the XLA leaves, the legacy attention and the kernel over
  int4 or fp8, their values (kv_format.unpack's bits); the leaves refuse rows in the other form."""
  rng = np.random.default_rng(2)
  fmt = KVFormat(kv_dtype, 64, "bfloat16")
  stored = fmt.pack(jnp.asarray(rng.standard_normal((2, 1, 2, 40, 64)), jnp.float32))
  q = jnp.zeros((1, 2, 2, 64), jnp.bfloat16)
  for impl in ("pallas", "xla", "legacy"):
    (rows,) = da.attention_rows(impl, fmt, (stored,))
    if impl == "pallas" and kv_dtype == "int8":
      assert da.reads_packed(impl, fmt) and rows is stored
    else:
      assert not da.reads_packed(impl, fmt)
      np.testing.assert_array_equal(np.asarray(rows), np.asarray(fmt.unpack(stored)))
    if impl != "legacy":
      wrong = fmt.unpack(stored) if rows is stored else stored
      with pytest.raises(ValueError, match="rows must be"):
        da.leaf_partials(q, (wrong,), 0, jnp.zeros(1, jnp.int32), 39, 1, impl=impl, kv_format=fmt)


@pytest.mark.parametrize("kv_dtype", ["int8", "int4", "float8_e4m3fn"])
def test_a_layer_over_quantized_rows_has_the_bits_of_its_values_unpacked_first(kv_dtype, monkeypatch):
  """decode_layer (a verify pass of 3 tokens over a window and the open page) and decode_tail_partial over quantized
  rows, with the XLA leaves and the (interpreted) kernel: the bits of the same attention over the rows unpacked first
  (reads_packed off), so int8's packed read changes no bit and int4, fp8 and the XLA leaves attend values as before."""
  cfg = helpers.tiny_config(head_dim=64, dtype="bfloat16").model
  fmt = KVFormat.of(cfg, kv_dtype)
  params = helpers.params(1, cfg=cfg)["layers"][0]
  rng = np.random.default_rng(4)
  k, page, w_rows = cfg.num_kv_heads, 8, S + 40
  rows = fmt.pack(jnp.asarray(rng.standard_normal((2, 2, k, w_rows + page, cfg.head_dim)), jnp.float32))
  window, open_page = rows[:, :, :, :w_rows], rows[:, :, :, w_rows:]
  x = jnp.asarray(rng.standard_normal((2, 3, cfg.d_model)), jnp.bfloat16)
  q = jnp.asarray(rng.standard_normal((2, k, cfg.num_heads // k, cfg.head_dim)), jnp.float32)
  start, end = jnp.array([0, 100], jnp.int32), jnp.int32(w_rows + 2)
  leaves = da.leaf_partials
  monkeypatch.setattr(da, "leaf_partials", lambda *a, **kw: leaves(*a, **{**kw, "interpret": kw["impl"] == "pallas"}))
  for impl in ("xla", "pallas"):
    layer = functools.partial(model.decode_layer, cfg=cfg, kv_format=fmt, attention_impl=impl)
    tail = functools.partial(model.decode_tail_partial, kv_format=fmt, attention_impl=impl)
    run = lambda: (layer(params, x, window, open_page, start, end), tail(q, window, open_page, start, end))
    got = run()
    with monkeypatch.context() as m:
      m.setattr(da, "reads_packed", lambda impl, fmt: False)
      want = run()
    for a, c in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(c), err_msg=impl)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
def test_the_kernel_lowers_to_triton_for_a_cuda_gpu(kv_dtype):
  """Pallas's Triton lowering of the kernel, run here for a CUDA target (jax.export; no GPU needed): the Llama-3-8B
  heads over a window and the open page, and over a chunk's leaves (a traced first_leaf); int8 read packed as byte
  pairs (u16: i32 offsets in elements stay below 2**31 at 1M rows) and no unpacked window in the program. What
  Pallas cannot lower (a load it does not support) fails here, not at a GPU's start-up check."""
  fmt = KVFormat(kv_dtype, 128, "bfloat16")
  rows = lambda n: jax.ShapeDtypeStruct((2, 1, 8, n, fmt.width), fmt.storage_dtype)
  spec = (jax.ShapeDtypeStruct((1, 8, 4, 128), jnp.bfloat16), rows(4096), rows(256))
  start = jax.ShapeDtypeStruct((1,), jnp.int32)
  kw = dict(impl="pallas", kv_format=fmt)
  rows_of = lambda *stored: da.attention_rows("pallas", fmt, stored)
  attend = lambda q, w, p, s: da.attend(q, rows_of(w, p), 0, s, 4106, **kw)
  chunk = lambda q, w, p, s: da.leaf_partials(q, rows_of(w), 0, s, 4106, 2, first_leaf=s[0], **kw)
  triton = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
  for f, kernels in ((attend, 2), (chunk, 1)):
    lowered = export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[triton])(*spec, start)
    module = lowered.mlir_module()
    assert module.count("xla.gpu.triton(") == kernels
    assert ("4096x128xbf16" in module) == (kv_dtype == "bfloat16")
    assert ("4096x68xui16" in module) == (kv_dtype == "int8")


def test_the_kernel_sharded_by_kv_head_gives_the_unsharded_bits():
  rng = np.random.default_rng(3)
  b, k, g, dh, w_rows = 2, 4, 2, 16, 2 * S
  q = jnp.asarray(rng.standard_normal((b, k, g, dh)), jnp.float32)
  kv = jnp.asarray(rng.standard_normal((2, b, k, w_rows + 8, dh)), jnp.float32)
  parts, start = (kv[:, :, :, :w_rows], kv[:, :, :, w_rows:]), jnp.array([0, 100], jnp.int32)
  run = lambda mesh: jax.jit(functools.partial(da.attend, impl="pallas", mesh=mesh, interpret=True))(
      q, parts, 0, start, w_rows + 4
  )
  one, two = run(None), run(helpers.mesh(2))
  assert two[0].addressable_shards[0].data.shape == (b, k // 2, g, dh)  # Each device attends its kv heads.
  for a, c in zip(one, two):
    np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("tensor", [1, 2, 4])
def test_the_xla_leaves_give_a_sequence_its_bits_in_a_batch_of_any_size_on_a_sharded_mesh(tensor):
  """The same sequence in slot 0 of batches of 1 to 5, its kv heads sharded over the mesh (as a tensor-parallel
  decode runs the leaves). A reduce's vectorization on the CPU follows the whole shape (the leaf's sum of 8 kv heads
  over 2 devices changed at batch 2): the leaves sum in a fixed tree (pairwise_sum)."""
  rng = np.random.default_rng(11)
  mesh = helpers.mesh(tensor)
  heads = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "tensor"))
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, None, "tensor"))
  q = rng.standard_normal((1, 8, 2, 16)).astype(np.float32)
  kv = rng.standard_normal((2, 1, 8, S + 24, 16)).astype(np.float32)
  leaves = jax.jit(lambda q, kv, start: da.leaf_partials(q, (kv,), 0, start, S + 20, 2))
  outs = []
  for batch in range(1, 6):
    q_b, kv_b = np.repeat(q, batch, axis=0), np.repeat(kv, batch, axis=1)
    p = leaves(jax.device_put(q_b, heads), jax.device_put(kv_b, rows), jnp.zeros(batch, jnp.int32))
    outs.append([np.asarray(a)[:, 0] for a in p])
  for batch, out in enumerate(outs[1:], 2):
    for got, want in zip(out, outs[0]):
      np.testing.assert_array_equal(got, want, err_msg=f"batch {batch}")


# A sequence of L rows (its new row included) whose rows, relative to its newest, are the same everywhere: at rows
# [d, d + L) of slot `slot` of a batch, in a window of W rows plus an 8-row page. (L, d, W, batch, slot): alone from
# row 0; moved by a block and by 300 rows (the new row at another page row); in a window of 6 leaves (a fold of 8
# where the others fold 4); among longer sequences, in a batch of 3 and of 2. A short one: alone with no window, and
# in a batch's window.
PLACEMENTS = {
    "long": [(700, 0, 696, 1, 0), (700, 8, 704, 1, 0), (700, 300, 992, 1, 0), (700, 700, 1392, 1, 0)]
    + [(700, 300, 992, 3, 1), (700, 5, 704, 2, 1)],
    "short": [(6, 0, 0, 1, 0), (6, 13, 16, 3, 2), (6, 300, 304, 2, 0)],
}


def _placed(length, d, w_rows, batch, slot, dh, seed=0):
  """rows [2, batch, 8, W + 8, Dh] with the sequence's `length` rows (the same in every call) at [d, d + length) of
  `slot`, start i32[batch], end = d + length - 1: rows of the other slots and below the sequence are random (masked
  for it)."""
  rng = np.random.default_rng(seed)
  own = np.random.default_rng(99).standard_normal((2, 1, 8, length, dh)).astype(np.float32)
  rows = rng.standard_normal((2, batch, 8, w_rows + 8, dh)).astype(np.float32)
  rows[:, slot : slot + 1, :, d : d + length] = own
  start = np.zeros(batch, np.int32)
  start[slot] = d
  end = d + length - 1
  assert w_rows <= end < w_rows + 8
  return rows, start, end


def _split(rows, w_rows):
  """(window or None, open page) of placed rows."""
  page = jnp.asarray(rows[:, :, :, w_rows:])
  return None if not w_rows else jnp.asarray(rows[:, :, :, :w_rows]), page


def _decode_layer_outputs(impl: str, placements) -> list[np.ndarray]:
  """decode_layer's output row of the sequence at every placement (tiny model, layer 0, f32)."""
  cfg = helpers.tiny_config().model
  params = helpers.params(1)["layers"][0]
  x_own = np.random.default_rng(98).standard_normal(cfg.d_model).astype(np.float32)
  layer = jax.jit(functools.partial(model.decode_layer, cfg=cfg, attention_impl=impl))
  outs = []
  for length, d, w_rows, batch, slot in placements:
    rows, start, end = _placed(length, d, w_rows, batch, slot, cfg.head_dim)
    x = np.random.default_rng(d).standard_normal((batch, cfg.d_model)).astype(np.float32)
    x[slot] = x_own
    y, _ = layer(params, jnp.asarray(x), *_split(rows, w_rows), jnp.asarray(start), jnp.int32(end))
    outs.append(np.asarray(y)[slot])
  return outs


@pytest.mark.parametrize("which", sorted(PLACEMENTS))
def test_a_decode_layer_gives_a_sequence_its_bits_at_any_window_length_row_and_batch(which):
  first, *others = _decode_layer_outputs("xla", PLACEMENTS[which])
  for placement, out in zip(PLACEMENTS[which][1:], others):
    np.testing.assert_array_equal(out, first, err_msg=str(placement))


def test_the_check_sees_the_legacy_attention_depend_on_the_window_length():
  first, *others = _decode_layer_outputs("legacy", PLACEMENTS["long"])
  assert not all(np.array_equal(out, first) for out in others)
  np.testing.assert_allclose(np.stack(others), np.stack([first] * len(others)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("which", sorted(PLACEMENTS))
def test_the_kernel_gives_a_sequence_its_bits_at_any_window_length_row_and_batch(which):
  rng = np.random.default_rng(97)
  q_own = rng.standard_normal((8, 2, 16)).astype(np.float32)
  attend = jax.jit(functools.partial(da.attend, impl="pallas", interpret=True))
  outs = []
  for length, d, w_rows, batch, slot in PLACEMENTS[which]:
    rows, start, end = _placed(length, d, w_rows, batch, slot, 16)
    q = rng.standard_normal((batch, 8, 2, 16)).astype(np.float32)
    q[slot] = q_own
    parts = tuple(p for p in _split(rows, w_rows) if p is not None)
    o, lse = attend(jnp.asarray(q), parts, 0, jnp.asarray(start), end)
    outs.append((np.asarray(o)[slot], np.asarray(lse)[slot]))
  for placement, (o, lse) in zip(PLACEMENTS[which][1:], outs[1:]):
    np.testing.assert_array_equal(o, outs[0][0], err_msg=str(placement))
    np.testing.assert_array_equal(lse, outs[0][1], err_msg=str(placement))


def test_the_tail_partial_matches_the_legacy_one():
  fmt = KVFormat.of(helpers.tiny_config().model)
  rng = np.random.default_rng(5)
  q = jnp.asarray(rng.standard_normal((2, 8, 2, 16)), jnp.float32)
  for t_rows in (0, 300):
    tail = jnp.asarray(rng.standard_normal((2, 2, 8, t_rows, 16)), jnp.float32) if t_rows else None
    page = jnp.asarray(rng.standard_normal((2, 2, 8, 8, 16)), jnp.float32)
    start, end = jnp.array([0, 1000 - t_rows // 2], jnp.int32), 1003
    run = lambda impl: jax.jit(functools.partial(model.decode_tail_partial, kv_format=fmt, attention_impl=impl))(
        q, tail, page, start, end
    )
    for got, want in zip(run("xla"), run("legacy")):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _gpu():
  return types.SimpleNamespace(platform="gpu", compute_capability="9.0")


@mock.patch.object(da, "pallas_check", lambda *args, **kwargs: None)  # The kernel runs (and matches) on the fake GPU.
def test_resolve_picks_the_kernel_only_where_it_runs():
  bf16 = dataclasses.replace(helpers.tiny_config().model, dtype="bfloat16", head_dim=128)
  cpu = jax.devices("cpu")[0]
  assert da.resolve("auto", bf16, KVFormat.of(bf16), _gpu()) == "pallas"
  assert da.resolve("auto", bf16, KVFormat.of(bf16, "int8"), _gpu()) == "pallas"  # Read packed.
  assert da.resolve("auto", bf16, KVFormat.of(bf16, "int4"), _gpu()) == "pallas"  # Unpacked to bf16 first.
  assert da.resolve("auto", bf16, KVFormat.of(bf16), cpu) == "xla"
  odd = dataclasses.replace(bf16, head_dim=96)
  assert da.resolve("auto", odd, KVFormat.of(odd), _gpu()) == "xla"
  for choice in ("xla", "legacy"):
    assert da.resolve(choice, bf16, KVFormat.of(bf16), _gpu()) == choice
  with pytest.raises(ValueError, match="CUDA GPU"):
    da.resolve("pallas", bf16, KVFormat.of(bf16), cpu)
  with pytest.raises(ValueError, match="power of two"):
    da.resolve("pallas", odd, KVFormat.of(odd), _gpu())
  with pytest.raises(ValueError, match="must be one of"):
    da.resolve("flash", bf16, KVFormat.of(bf16), cpu)


def test_resolve_checks_the_kernel_on_rows_as_it_reads_them():
  bf16 = dataclasses.replace(helpers.tiny_config().model, dtype="bfloat16", head_dim=128)
  with mock.patch.object(da, "pallas_check", return_value=None) as check:
    for kv_dtype, packed in (("int8", "int8"), ("int4", None), ("float8_e4m3fn", None), ("model", None)):
      assert da.resolve("auto", bf16, KVFormat.of(bf16, kv_dtype), _gpu()) == "pallas"
      assert check.call_args.kwargs["packed"] == packed, kv_dtype


def test_resolve_falls_back_when_the_check_fails():
  bf16 = dataclasses.replace(helpers.tiny_config().model, dtype="bfloat16", head_dim=128)
  with mock.patch.object(da, "pallas_check", lambda *args, **kwargs: "relative error 0.3 > 0.01"):
    assert da.resolve("auto", bf16, KVFormat.of(bf16), _gpu()) == "xla"
    with pytest.raises(ValueError, match="relative error 0.3"):
      da.resolve("pallas", bf16, KVFormat.of(bf16), _gpu())


def test_the_check_passes_the_interpreted_kernel_and_reports_one_that_cannot_run():
  cpu = jax.devices("cpu")[0]
  assert da.pallas_check.__wrapped__(cpu, "float32", 4, 2, 16, interpret=True) is None
  assert da.pallas_check.__wrapped__(cpu, "bfloat16", 4, 2, 32, interpret=True, packed="int8") is None
  error = da.pallas_check.__wrapped__(cpu, "float32", 4, 2, 16)  # Triton needs a GPU.
  assert error and "Error" in error


def _engine(impl: str, placement: str = "device") -> engine_lib.Engine:
  cfg = helpers.tiny_config()
  cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, decode_attention=impl))
  cfg = dataclasses.replace(cfg, kv=dataclasses.replace(cfg.kv, placement=placement, pipeline_depth=1))
  return engine_lib.Engine(cfg, helpers.mesh(1), helpers.params(1))


def test_the_engine_runs_the_xla_leaves_on_cpu_and_refuses_the_kernel():
  auto, legacy = _engine("auto"), _engine("legacy")
  assert (auto.stage_fns[0].decode_attention, legacy.stage_fns[0].decode_attention) == ("xla", "legacy")
  prompts = helpers.prompts([20, 7])
  a, b = auto.generate(prompts, 6, keep_logits=True), legacy.generate(prompts, 6, keep_logits=True)
  assert a.tokens == b.tokens
  np.testing.assert_allclose(a.logits, b.logits, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="engine.decode_attention pallas needs"):
    _engine("pallas")


def _server_requests():
  rng = np.random.default_rng(5)
  target = serving.Request(tuple(rng.integers(2, 250, 20).tolist()), 12, seed=0)
  longer = [
      serving.Request(tuple(rng.integers(2, 250, n).tolist()), 12, seed=i + 1) for i, n in enumerate((60, 50, 70))
  ]
  return target, longer


@pytest.mark.parametrize("impl, placement", [("xla", "device"), ("xla", "host"), ("legacy", "device")])
def test_a_request_among_longer_ones_gets_its_bits_alone_through_the_server(impl, placement):
  """With the prefix cache on, every prompt is prefilled alone from row 0 (its rows depend on it only), so the
  decode decides: the target's logits are bitwise those it gets alone (rows [0, 20)) among longer requests (its
  rows at [50, 70) of its slot, the window 40 rows longer) with the leaves; not with the legacy attention."""
  engine = _engine(impl, placement)
  target, longer = _server_requests()
  alone = serving.Server(engine, 1, prefix_cache_bytes=1).serve([target]).results[0]
  among = serving.Server(engine, 4, prefix_cache_bytes=1).serve(longer[:2] + [target] + longer[2:]).results[2]
  assert (alone.first_row, among.first_row) == (0, 50)
  assert among.tokens == alone.tokens
  assert (among.logits_sha256 == alone.logits_sha256) == (impl != "legacy")
