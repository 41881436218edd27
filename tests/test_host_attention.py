"""Host attention: the CPU kernel against an f64 reference in every stored format, the split-K merge, a split layer
against decode_layer, greedy decoding with split layers against the engine, determinism, and zero-copy views.

Tolerances: the kernel and the merge compute in f32 over at most ~600 rows of Dh = 64; each score, exp and
product carries a relative rounding error of ~2^-24 and the sums grow it by at most a few hundred ulps, so outputs of
magnitude <= 4 agree with the f64 reference to 2e-6 (observed: 2e-7) and lse to 4e-6. Unpacking is exact: the
reference attends over the values jaxkv.kv_quant unpacks, so no quantization error enters the comparison.
"""

import concurrent.futures
import functools
import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import helpers
import jax
import jax.numpy as jnp
import numba
import numba.core.codegen
import numpy as np
import pytest

from jaxkv import cache as cache_lib
from jaxkv.host import attention as host_attention
from jaxkv import mesh as mesh_lib
from jaxkv import model
from jaxkv.kv_quant import KVFormat

FORMATS = ("float32", "bfloat16", "float16", "int8", "int4", "float8_e4m3fn")
BLOCK = host_attention.ROW_BLOCK
ROOT = pathlib.Path(__file__).absolute().parent.parent


def stored_rows(name, shape, seed=0, dh=64):
  """(stored [*shape, E] in format `name`, its values f64[*shape, Dh]) for N(0, 1) values."""
  fmt = KVFormat(name, dh, "float32")
  x = jax.random.normal(jax.random.key(seed), (*shape, dh), jnp.float32)
  stored = jax.jit(fmt.pack)(x)
  values = fmt.unpack(stored) if fmt.quantized else stored
  return fmt, np.asarray(stored), np.asarray(values.astype(jnp.float32), np.float64)


def reference(values, q, start, r0, r1, row0=0):
  """f64 attention over rows [r0, r1) of values [2, B, K, R, Dh] -> (o, lse); o = 0, lse = -inf without rows."""
  rows = np.arange(values.shape[3])
  valid = (rows >= r0) & (rows < r1) & (row0 + rows[None, :] >= start[:, None])  # [B, R]
  s = np.einsum("bkgd,bkrd->bkgr", q.astype(np.float64), values[0]) / math.sqrt(q.shape[-1])
  s = np.where(valid[:, None, None, :], s, -np.inf)
  m = np.max(s, axis=-1, keepdims=True)
  e = np.exp(s - np.where(np.isfinite(m), m, 0.0))
  total = e.sum(-1)
  o = np.einsum("bkgr,bkrd->bkgd", e, values[1]) / np.where(total > 0, total, 1.0)[..., None]
  with np.errstate(divide="ignore"):
    return o, np.log(total) + m[..., 0]


def query(b, k, g, dh, seed=1):
  return np.random.default_rng(seed).standard_normal((b, k, g, dh)).astype(np.float32)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize(
    "r0, r1", [(0, 2 * BLOCK + 37), (BLOCK, 2 * BLOCK), (5, BLOCK + 3), (2 * BLOCK, 2 * BLOCK + 1)], ids=str
)
def test_kernel_matches_the_f64_reference(name, r0, r1):
  fmt, stored, values = stored_rows(name, (2, 3, 2, 2 * BLOCK + 37))
  q = query(3, 2, 4, 64)
  start = np.array([0, 300, 2 * BLOCK + 37], np.int32)  # The last sequence has no valid row.
  o, lse = host_attention.attend(stored, q, start, r0, r1, fmt)
  ref_o, ref_lse = reference(values, q, start, r0, r1)
  np.testing.assert_allclose(o, ref_o, rtol=0, atol=2e-6)
  np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=4e-6)
  assert np.all(o[2] == 0) and np.all(lse[2] == -np.inf)


def test_rows_are_masked_by_their_cache_row():
  """An array whose row 0 is cache row row0 (a host share that does not start at row 0)."""
  fmt, stored, values = stored_rows("bfloat16", (2, 2, 1, 300))
  q = query(2, 1, 2, 64)
  start = np.array([150, 0], np.int32)
  o, lse = host_attention.attend(stored, q, start, 0, 300, fmt, row0=100)
  ref_o, ref_lse = reference(values, q, start, 0, 300, row0=100)
  np.testing.assert_allclose(o, ref_o, rtol=0, atol=2e-6)
  np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=4e-6)


def test_an_empty_range_gives_no_rows():
  fmt, stored, _ = stored_rows("int8", (2, 1, 2, 40))
  o, lse = host_attention.attend(stored, query(1, 2, 3, 64), np.zeros(1, np.int32), 17, 17, fmt)
  assert o.shape == (1, 2, 3, 64) and lse.shape == (1, 2, 3)
  assert np.all(o == 0) and np.all(lse == -np.inf)


@pytest.mark.parametrize("name", FORMATS)
def test_rows_are_widened_exactly(name):
  """With one row the output is that row's V, bit for bit: widening (and the f16 scales) is exact."""
  dh = 64
  fmt = KVFormat(name, dh, "float32")
  if name == "float16":  # Every finite float16, subnormals included.
    bits = np.arange(2**16, dtype=np.uint16)
    v = bits.view(np.float16)[np.isfinite(bits.view(np.float16))]
    v = np.resize(v, (len(v) + dh - 1) // dh * dh).reshape(-1, dh)
  else:  # Spans values whose int8 / int4 / fp8 scales are float16 subnormals.
    v = np.random.default_rng(0).standard_normal((512, dh)) * np.logspace(-9, 2, 512)[:, None]
  stored = np.asarray(jax.jit(fmt.pack)(jnp.asarray(v, jnp.float32)))  # [N, E]
  kv = np.stack([np.zeros_like(stored), stored])[:, None, :, None, :]  # [2, 1, N, 1, E]: one row per head.
  o, _ = host_attention.attend(kv, np.ones((1, len(v), 1, dh), np.float32), np.zeros(1, np.int32), 0, 1, fmt)
  want = fmt.unpack(jnp.asarray(stored)) if fmt.quantized else jnp.asarray(stored)
  np.testing.assert_array_equal(o[0, :, 0], np.asarray(want.astype(jnp.float32)))


def test_numba_may_use_512_bit_vectors_where_the_cpu_has_them():
  features = numba.core.codegen.get_host_cpu_features()
  if "NUMBA_CPU_FEATURES" in os.environ:
    assert numba.config.CPU_FEATURES == os.environ["NUMBA_CPU_FEATURES"]
  elif "+avx512f" in features.split(","):
    assert numba.config.CPU_FEATURES == features + ",-prefer-256-bit"
  else:
    assert numba.config.CPU_FEATURES is None
  codegen = numba.core.registry.cpu_target.target_context.codegen()
  assert codegen.magic_tuple()[2] == (numba.config.CPU_FEATURES or features)


def test_cpu_features_the_user_gave_numba_win():
  mine = numba.core.codegen.get_host_cpu_features()
  code = "import numba; from jaxkv.host import attention; print(numba.config.CPU_FEATURES)"
  env = dict(os.environ, NUMBA_CPU_FEATURES=mine, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
  assert out.stdout.strip() == mine


def test_exp_is_accurate():
  x = np.linspace(-87.0, 0.0, 1_000_001, dtype=np.float32)
  y = x.copy()
  host_attention._exp_nonpositive(y, y.size, np.empty(y.size, np.uint32))  # pylint: disable=protected-access
  ref = np.exp(x.astype(np.float64))
  assert np.max(np.abs(y - ref) / ref) < 2.0**-23


def test_the_kernel_is_deterministic_across_runs_and_thread_counts():
  fmt, stored, _ = stored_rows("bfloat16", (2, 2, 2, 3 * BLOCK + 5))
  q, start = query(2, 2, 4, 64), np.array([7, 0], np.int32)
  most = numba.config.NUMBA_NUM_THREADS
  runs = [host_attention.attend(stored, q, start, 0, 3 * BLOCK + 5, fmt, threads=t) for t in (1, 1, most, most)]
  for o, lse in runs[1:]:
    np.testing.assert_array_equal(o, runs[0][0])
    np.testing.assert_array_equal(lse, runs[0][1])
  numba.set_num_threads(most)


def test_a_call_does_not_see_an_earlier_calls_scratch():
  """The blocks' partials live in a scratch buffer of the calling thread: a call whose V rows are inf leaves inf
  partials there, and a later call on that thread whose first blocks are all padding must match a fresh thread's."""
  fmt, stored, _ = stored_rows("float32", (2, 1, 2, 4 * BLOCK))
  poison = stored.copy()
  poison[1] = np.inf
  q, start = query(1, 2, 4, 64), np.array([2 * BLOCK + 3], np.int32)
  with concurrent.futures.ThreadPoolExecutor(1) as fresh:
    want = fresh.submit(host_attention.attend, stored, q, start, 0, 4 * BLOCK, fmt).result()
  with concurrent.futures.ThreadPoolExecutor(1) as used:
    o, _ = used.submit(host_attention.attend, poison, q, np.zeros(1, np.int32), 0, 4 * BLOCK, fmt).result()
    assert np.isinf(o).all()  # The scratch holds inf partials now.
    got = used.submit(host_attention.attend, stored, q, start, 0, 4 * BLOCK, fmt).result()
  assert np.isfinite(got[0]).all()
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)


def test_merge_of_partials_equals_single_pass():
  _, _, values = stored_rows("float32", (2, 2, 2, 70))
  kv = jnp.asarray(values, jnp.float32)
  q = jnp.asarray(query(2, 2, 4, 64))
  rows = jnp.arange(70)
  start = jnp.array([0, 30])
  valid = rows[None, :] >= start[:, None]
  whole = model.partial_attention(q, kv, valid)
  for split in (31, 50):  # Sequence 1 has no valid row before 30.
    lo = model.partial_attention(q, kv[:, :, :, :split], valid[:, :split])
    hi = model.partial_attention(q, kv[:, :, :, split:], valid[:, split:])
    o, lse = model.merge_partials(*lo, *hi)
    np.testing.assert_allclose(o, whole[0], rtol=0, atol=2e-6)
    np.testing.assert_allclose(lse, whole[1], rtol=0, atol=4e-6)
  ref_o, ref_lse = reference(values, np.asarray(q), np.asarray(start), 0, 70)
  np.testing.assert_allclose(whole[0], ref_o, rtol=0, atol=2e-6)
  np.testing.assert_allclose(whole[1], ref_lse, rtol=0, atol=4e-6)
  o, lse = model.merge_partials(jnp.zeros_like(whole[0]), jnp.full(whole[1].shape, -jnp.inf), *whole)
  np.testing.assert_array_equal(o, whole[0])  # A partial without rows changes nothing.
  np.testing.assert_array_equal(lse, whole[1])


@functools.lru_cache(maxsize=None)
def split_fns(cfg, fmt):
  query_fn = jax.jit(functools.partial(model.decode_query, cfg=cfg, kv_format=fmt))
  tail_fn = jax.jit(functools.partial(model.decode_tail_partial, kv_format=fmt))
  merge_fn = jax.jit(functools.partial(model.decode_merge, cfg=cfg))
  return query_fn, tail_fn, merge_fn


def split_layer(p, x, window, open_page, start, end, r1, cfg, fmt):
  """One layer with rows [0, r1) of the window attended on the host: the data path of --kv_host_attention."""
  query_fn, tail_fn, merge_fn = split_fns(cfg, fmt)
  q, open_page = query_fn(p, x, open_page, start, end)
  host = np.asarray(window) if window is not None else None
  if r1:
    host_o, host_lse = host_attention.attend(host, np.asarray(q), np.asarray(start), 0, r1, fmt)
  else:
    host_o, host_lse = np.zeros(q.shape, np.float32), np.full(q.shape[:3], -np.inf, np.float32)
  tail = None if window is None or r1 == window.shape[3] else window[:, :, :, r1:]
  o, lse = tail_fn(q, tail, open_page, start, end)
  return merge_fn(p, x, o, lse, host_o, host_lse), open_page


@pytest.mark.parametrize("r1", [0, 8, 19, 24])
def test_a_split_layer_matches_decode_layer(r1):
  cfg = helpers.tiny_config().model
  fmt = KVFormat.of(cfg)
  p = helpers.params(1)["layers"][0]
  b, k, w, page = 3, cfg.num_kv_heads, 24, 8
  window = jax.random.normal(jax.random.key(0), (2, b, k, w, cfg.head_dim))
  open_page = jax.random.normal(jax.random.key(1), (2, b, k, page, cfg.head_dim))
  x = jax.random.normal(jax.random.key(2), (b, cfg.d_model))
  start, end = jnp.array([0, 5, 20], jnp.int32), jnp.int32(w + 3)
  want_x, want_page = jax.jit(functools.partial(model.decode_layer, cfg=cfg))(p, x, window, open_page, start, end)
  got_x, got_page = split_layer(p, x, window, open_page, start, end, r1, cfg, fmt)
  np.testing.assert_array_equal(got_page, want_page)
  np.testing.assert_allclose(got_x, want_x, rtol=1e-5, atol=1e-5)


def split_generate(prompts, new, host_rows, cfg, kv_dtype="model"):
  """Greedy decoding of the tiny model on one device, every layer split at row min(host_rows, W): a plain driver
  of the split path (prefill in one chunk; blocks move to the window when the open page fills)."""
  fmt = KVFormat.of(cfg, kv_dtype)
  params = helpers.params(1, 0, cfg)
  block = helpers.tiny_config().kv.block
  lens = np.array([len(p) for p in prompts])
  longest = int(lens.max())
  start = jnp.asarray(longest - lens, jnp.int32)
  rows = -(-longest // block) * block
  tokens = np.zeros((len(prompts), rows), np.int32)
  for b, prompt in enumerate(prompts):
    tokens[b, longest - len(prompt) : longest] = prompt
  prefill = jax.jit(functools.partial(model.prefill_layer, cfg=cfg, kv_format=fmt))
  x = model.embed(params, jnp.asarray(tokens))
  w_rows = longest // block * block
  windows, opens = [], []
  for p in params["layers"]:
    x, chunk = prefill(p, x, None, start)
    chunk = jnp.pad(chunk, ((0, 0),) * 3 + ((0, block), (0, 0)))  # The open page: zeros past the chunk.
    windows.append(chunk[:, :, :, :w_rows] if w_rows else None)
    opens.append(chunk[:, :, :, w_rows : w_rows + block])
  out = [[] for _ in prompts]
  tok = jnp.argmax(model.logits(params, x[:, longest - 1], cfg), axis=-1)
  for end in range(longest, longest + new - 1):
    for b in range(len(prompts)):
      out[b].append(int(tok[b]))
    x = model.embed(params, tok)
    for l, p in enumerate(params["layers"]):
      r1 = min(host_rows, w_rows)
      x, opens[l] = split_layer(p, x, windows[l], opens[l], start, jnp.int32(end), r1, cfg, fmt)
      if end - w_rows == block - 1:
        windows[l], opens[l] = cache_lib.grow(windows[l], opens[l]), jnp.zeros_like(opens[l])
    w_rows += block if end - w_rows == block - 1 else 0
    tok = jnp.argmax(model.logits(params, x, cfg), axis=-1)
  for b in range(len(prompts)):
    out[b].append(int(tok[b]))
  return out


@pytest.mark.parametrize("kv_dtype, host_rows", [("model", 8), ("model", 1000), ("int8", 16), ("int4", 16)])
def test_greedy_tokens_match_the_device_placement(kv_dtype, host_rows):
  cfg = helpers.tiny_config(head_dim=32) if kv_dtype in ("int8", "int4") else helpers.tiny_config()
  prompts = helpers.prompts((5, 12, 1, 9))
  want = helpers.engine(1, cfg=cfg, kv_dtype=kv_dtype).generate(prompts, 12).tokens
  assert split_generate(prompts, 12, host_rows, cfg.model, kv_dtype) == want


def test_views_alias_the_shards_of_a_host_array():
  mesh = helpers.mesh(2)
  fmt, stored, values = stored_rows("bfloat16", (2, 2, 4, 50))
  window_sharding = mesh_lib.sharding(mesh, mesh_lib.CACHE_AXES, "pinned_host")
  window = jax.device_put(stored, window_sharding)
  views = host_attention.shard_views(window)
  assert len(views) == 2
  for (index, view), shard in zip(views, window.addressable_shards):
    assert index == shard.index and view.shape == shard.data.shape == (2, 2, 2, 50, 64)
    assert view.ctypes.data == shard.data.unsafe_buffer_pointer()  # The shard's own memory: no copy.
    assert not view.flags.writeable
    np.testing.assert_array_equal(view, stored[index])
  q, start = query(2, 4, 2, 64), np.array([3, 0], np.int32)
  o, lse = host_attention.attend_array(window, q, start, 10, 50, fmt)
  del window  # The views keep the shards alive.
  np.testing.assert_array_equal(views[1][1], stored[:, :, 2:])
  want_o, want_lse = host_attention.attend(stored, q, start, 10, 50, fmt)
  np.testing.assert_array_equal(o, want_o)
  np.testing.assert_array_equal(lse, want_lse)
  # The kernel's views (made once, then read every step): each head shard's bytes, in place and read-only.
  raws = host_attention.kernel_views(jax.device_put(stored, window_sharding), fmt)
  assert [heads.indices(4) for heads, _ in raws] == [(0, 2, 1), (2, 4, 1)]
  for (heads, raw), (_, view) in zip(raws, views):
    assert raw.dtype == np.uint8 and raw.shape == (2, 2, 2, 50, 128) and not raw.flags.writeable
    np.testing.assert_array_equal(raw, stored[:, :, heads].view(np.uint8))
  o, lse = host_attention.attend_views(raws, q, start, 10, 50, fmt)
  np.testing.assert_array_equal(o, want_o)
  np.testing.assert_array_equal(lse, want_lse)
  with pytest.raises(ValueError, match="not within"):
    host_attention.attend_views(raws, q, start, 10, 51, fmt)
  with pytest.raises(ValueError, match="not stored as"):
    host_attention.kernel_views(jax.device_put(stored, window_sharding), stored_rows("float32", (1, 1, 1, 1))[0])


@pytest.mark.parametrize("devices", [1, 2, 4])
def test_hand_back_is_written_in_place_and_read_by_a_device_call(devices):
  mesh = helpers.mesh(devices)
  sharding = mesh_lib.sharding(mesh, (mesh_lib.BATCH, mesh_lib.KV_HEADS, None, None), "pinned_host")
  hand_back = host_attention.HandBack((2, 4, 3, 9), sharding)
  pointers = [s.data.unsafe_buffer_pointer() for s in hand_back.array.addressable_shards]
  read = jax.jit(lambda a: jax.device_put(a, jax.memory.Space.Device) * 1.0)
  rng = np.random.default_rng(0)
  for _ in range(3):  # Each write is seen by the next call; the array stays the same memory.
    o, lse = rng.standard_normal((2, 4, 3, 8), np.float32), rng.standard_normal((2, 4, 3), np.float32)
    hand_back.write(o, lse)
    got = np.asarray(read(hand_back.array))
    np.testing.assert_array_equal(got[..., :-1], o)
    np.testing.assert_array_equal(got[..., -1], lse)
    assert [s.data.unsafe_buffer_pointer() for s in hand_back.array.addressable_shards] == pointers


def test_the_probe_runs_and_writes_its_json(tmp_path):
  spec = importlib.util.spec_from_file_location("probe", ROOT / "tools" / "probe_host_attention.py")
  probe = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(probe)
  out = tmp_path / "probe.json"
  rows = probe.run(
      batches=(1,),
      contexts=(512,),
      dtypes=("bfloat16", "int8"),
      threads=(1,),
      stream_mib=8,
      repeats=2,
      kernels=("attend", "read"),
      fractions=(1.0, 0.6),
  )
  probe.write(rows, str(out))
  assert json.loads(out.read_text()) == rows
  assert {(r["kv_dtype"], r["kernel"], r["rows_per_call"]) for r in rows} == {
      (d, k, n) for d in ("bfloat16", "int8") for k in ("attend", "read") for n in (512, 256)  # 0.6 x 512, in blocks.
  }
  assert all(r["alone_gbps"] > 0 and r["streaming_gbps"] > 0 for r in rows)
  words = np.arange(7 * 40, dtype=np.uint64).reshape(7, 40)[:, :25]  # The read's segments: the first rows of each.
  assert probe._read(words, 3) == words.sum()  # pylint: disable=protected-access
