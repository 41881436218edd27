"""Prefill: the fused attention's split-and-merge against the plain XLA attention, the choice of implementation, and
host placement keeping the prompt's earlier rows on the devices (same bits, no re-delivery)."""

import dataclasses
import importlib.util
import pathlib
import types
from unittest import mock

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import tiny
from jaxkv import config as config_lib
from jaxkv import engine as engine_lib
from jaxkv import model
from jaxkv import residency
from jaxkv import run as run_lib
from jaxkv.kv_quant import KVFormat

ROOT = pathlib.Path(__file__).resolve().parent.parent


def emulated_kernel(q, k, v, q_len, kv_len, causal):
  """model.cudnn_attention's contract in plain jnp (f32 softmax): q [B, T, H, Dh]; k, v [B, S, K, Dh]; queries
  [0, q_len) and keys [0, kv_len) valid; causal: top-left. Rows past q_len come back NaN, so a caller that read them
  would fail."""
  b, t, h, dh = q.shape
  s_rows, kh = k.shape[1], k.shape[2]
  qg = q.reshape(b, t, kh, h // kh, dh).astype(jnp.float32)
  s = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32)) / np.sqrt(dh)
  i, j = jnp.arange(t)[:, None], jnp.arange(s_rows)[None, :]
  mask = (j[None] < kv_len[:, None, None]) & ((j <= i)[None] if causal else True)  # [B, T, S]
  s = jnp.where(mask[:, None, None], s, -jnp.inf)
  lse = jax.nn.logsumexp(s, axis=-1)  # [B, K, G, T]
  o = jnp.einsum("bkgts,bskd->btkgd", jnp.exp(s - lse[..., None]), v.astype(jnp.float32)).reshape(b, t, h, dh)
  valid_q = jnp.arange(t)[None, :] < q_len[:, None]  # [B, T]
  o = jnp.where(valid_q[:, :, None, None], o, jnp.nan).astype(q.dtype)
  lse = jnp.where(valid_q[:, None, :], lse.reshape(b, h, t), jnp.nan)
  return o, lse


def _xla_reference(q, chunk_kv, prefix_kv, start):
  """prefill_layer's XLA attention over [prefix, chunk] with its mask."""
  w = 0 if prefix_kv is None else prefix_kv.shape[3]
  c = q.shape[1]
  kv = chunk_kv if prefix_kv is None else jnp.concatenate([prefix_kv, chunk_kv], axis=3)
  rows = w + jnp.arange(c)
  keys = jnp.arange(w + c)
  mask = (keys[None, None, :] <= rows[None, :, None]) & (keys[None, None, :] >= start[:, None, None])
  return model.attention(q, kv, mask | (keys[None, None, :] == rows[None, :, None]))


@pytest.mark.parametrize("w", [0, 16])
def test_fused_prefill_attention_matches_the_xla_attention(w):
  """Left padding ending in the prefix, at its end, inside the chunk, and past the chunk (all padding), GQA."""
  rng = np.random.default_rng(w)
  c, h, k, dh = 8, 4, 2, 8
  start = jnp.array([0, 5, w, w + 3, w + c + 2], jnp.int32)
  b = len(start)
  q = jnp.asarray(rng.standard_normal((b, c, h, dh)), jnp.float32)
  chunk_kv = jnp.asarray(rng.standard_normal((2, b, k, c, dh)), jnp.float32)
  prefix_kv = jnp.asarray(rng.standard_normal((2, b, k, w, dh)), jnp.float32) if w else None
  fused = jax.jit(model.fused_prefill_attention, static_argnums=4)(q, chunk_kv, prefix_kv, start, emulated_kernel)
  ref = _xla_reference(q, chunk_kv, prefix_kv, start)
  assert np.isfinite(np.asarray(fused)).all()
  np.testing.assert_allclose(fused, ref, rtol=2e-6, atol=2e-6)


def _gpu(capability="9.0"):
  return types.SimpleNamespace(platform="gpu", compute_capability=capability)


@mock.patch.object(model, "cudnn_check", lambda *args: None)  # cuDNN runs (and matches) on the fake GPU.
def test_prefill_attention_impl_picks_cudnn_only_where_it_runs():
  bf16 = dataclasses.replace(helpers.tiny_config().model, dtype="bfloat16", head_dim=128)
  f32 = dataclasses.replace(bf16, dtype="float32")
  cpu = jax.devices("cpu")[0]
  impl = model.prefill_attention_impl
  assert impl("auto", bf16, KVFormat.of(bf16), _gpu()) == "cudnn"
  assert impl("auto", bf16, KVFormat.of(bf16, "int8"), _gpu()) == "cudnn"  # Unpacked to bf16.
  assert impl("auto", bf16, KVFormat.of(bf16, "int4"), _gpu()) == "cudnn"
  assert impl("auto", bf16, KVFormat.of(bf16, "float32"), _gpu()) == "xla"  # f32 values: not the model dtype.
  assert impl("auto", f32, KVFormat.of(f32), _gpu()) == "xla"
  assert impl("auto", bf16, KVFormat.of(bf16), cpu) == "xla"
  assert impl("xla", bf16, KVFormat.of(bf16), _gpu()) == "xla"
  wide = dataclasses.replace(bf16, head_dim=256)
  assert impl("auto", wide, KVFormat.of(wide), _gpu("9.0")) == "cudnn"
  assert impl("auto", wide, KVFormat.of(wide), _gpu("8.0")) == "xla"
  with pytest.raises(ValueError, match="CUDA GPU"):
    impl("cudnn", bf16, KVFormat.of(bf16), cpu)
  with pytest.raises(ValueError, match="bfloat16 or float16"):
    impl("cudnn", f32, KVFormat.of(f32), _gpu())


def test_prefill_attention_impl_falls_back_when_the_cudnn_check_fails():
  bf16 = dataclasses.replace(helpers.tiny_config().model, dtype="bfloat16", head_dim=128)
  with mock.patch.object(model, "cudnn_check", lambda *args: "relative error 0.3 > 0.02"):
    assert model.prefill_attention_impl("auto", bf16, KVFormat.of(bf16), _gpu()) == "xla"
    with pytest.raises(ValueError, match="relative error 0.3"):
      model.prefill_attention_impl("cudnn", bf16, KVFormat.of(bf16), _gpu())


def test_the_cudnn_check_reports_a_kernel_that_cannot_run():
  """On CPU cuDNN is missing: the check says why instead of raising."""
  error = model.cudnn_check.__wrapped__(jax.devices("cpu")[0], "bfloat16", 4, 2, 16)
  assert error and "cuDNN" in error


def test_the_engine_runs_the_xla_prefill_on_cpu_and_refuses_cudnn():
  cfg = helpers.tiny_config()
  auto = helpers.engine(2)
  assert auto.stage_fns[0].prefill_attention == "xla"
  xla_cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, prefill_attention="xla"))
  xla = engine_lib.Engine(xla_cfg, helpers.mesh(2), helpers.params(2))
  prompts = helpers.prompts([20, 7])
  a, b = auto.generate(prompts, 3), xla.generate(prompts, 3)
  assert (a.tokens_sha256, a.logits_sha256) == (b.tokens_sha256, b.logits_sha256)
  assert a.transport["prefill"]["attention"] == "xla"
  cudnn_cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, prefill_attention="cudnn"))
  with pytest.raises(ValueError, match="engine.prefill_attention cudnn needs"):
    engine_lib.Engine(cudnn_cfg, helpers.mesh(2), helpers.params(2))


LENGTHS = (40, 23)  # Chunks of 16: three of the first prompt, two of the second (each prefilled alone).


def _prefill_h2d(res) -> int:
  return sum(s["h2d_bytes"] for s in res.transport["steps"] if s["kind"] == "prefill")


@pytest.mark.parametrize("tensor", [1, 4])
def test_host_prefill_keeps_earlier_rows_on_the_devices_with_the_same_bits(tensor):
  prompts = helpers.prompts(LENGTHS)
  ref = helpers.engine(tensor).generate(prompts, 4, keep_logits=True)
  res = helpers.engine(tensor, placement="host", depth=2, debug=1).generate(prompts, 4, keep_logits=True)
  np.testing.assert_array_equal(res.logits, ref.logits)
  assert (res.tokens_sha256, res.logits_sha256) == (ref.tokens_sha256, ref.logits_sha256)
  plan = res.transport["prefill"]
  assert plan["keep"] and "stay on the devices" in plan["reason"]
  assert _prefill_h2d(res) == 0  # No chunk got a window from the host.
  cfg = helpers.tiny_config().model
  row = 2 * cfg.num_kv_heads * cfg.head_dim * 4  # K and V of one row of one sequence, f32.
  # Each prompt is prefilled alone: the plan of the largest prefill, the 40-token prompt's 3 chunks.
  assert plan["bytes_per_device"] == cfg.num_layers * row // tensor * 48
  # The rows reached the host once: each prompt's rows in its slot of the batch's 40 // 8 * 8 = 40 full-block rows.
  prefill_d2h = sum(s["d2h_bytes"] for s in res.transport["steps"] if s["kind"] == "prefill")
  assert prefill_d2h == cfg.num_layers * row * len(LENGTHS) * 40


@pytest.mark.parametrize("span,rows", [(None, 0), (2, 32), (1, 16 + 32 + 16)])
def test_host_prefill_past_the_device_budget_redelivers_each_span_with_the_same_bits(span, rows):
  """With no room for the prompt's rows on the devices, each span of chunks (model.prefill_span; default: every
  chunk of the tiny model's prompts) gets its windows through the transport: with spans of 2 chunks the 40-token
  prompt's chunk 2 gets rows [0, 32); with 1, its chunks 1 and 2 get rows [0, 16) and [0, 32) and the 23-token
  one's chunk 1 rows [0, 16). The bits of the prefill that keeps every row on the devices, in every case."""
  prompts = helpers.prompts(LENGTHS)
  cfg = helpers.tiny_config().model
  kept = helpers.engine(2, placement="host", depth=2, debug=1).generate(prompts, 4)
  hidden = model.SPAN_HIDDEN_BYTES if span is None else span * 16 * cfg.d_model * 4  # Chunks of 16 rows, f32.
  with mock.patch.object(residency, "free_device_bytes", lambda devices: 0):  # A full device.
    with mock.patch.object(model, "SPAN_HIDDEN_BYTES", hidden):
      res = helpers.engine(2, placement="host", depth=2, debug=1).generate(prompts, 4)
  assert (res.tokens_sha256, res.logits_sha256) == (kept.tokens_sha256, kept.logits_sha256)
  plan = res.transport["prefill"]
  assert not plan["keep"] and "exceed the free device memory" in plan["reason"]
  row = 2 * cfg.num_kv_heads * cfg.head_dim * 4
  assert _prefill_h2d(res) == cfg.num_layers * row * rows


def test_prefill_windows_are_m_times_powers_of_two_of_chunks():
  """Exact up to 2 PREFILL_BUCKETS chunks; past that m * 2^s chunks, m in [PREFILL_BUCKETS, 2 PREFILL_BUCKETS), at
  most 1 / PREFILL_BUCKETS of padding; never past the cache's largest window, never below the window."""
  b, chunk = engine_lib.PREFILL_BUCKETS, 16
  rows = lambda n, capacity=10**6: engine_lib.prefill_window_rows(n * chunk, chunk, capacity, 8) // chunk
  assert [rows(n) for n in range(2 * b)] == list(range(2 * b))
  assert [rows(n) for n in (2 * b + 1, 4 * b - 1, 4 * b + 1, 511)] == [2 * b + 2, 4 * b, 4 * b + 4, 512]
  for n in range(1, 2000):
    assert n <= rows(n) <= n * (b + 1) / b
  # 16 exact, 8 a doubling from 16 to 512 chunks, and 512: a 1M prompt's 512 chunks of 2,048 rows.
  assert len({rows(n) for n in range(512)}) == 2 * b + 5 * b + 1
  assert engine_lib.prefill_window_rows(17 * 16, 16, 280, 8) == 280  # 18 chunks past the largest window, 280 rows.


def test_padded_prefill_windows_give_every_placement_the_same_bits(monkeypatch):
  """With two window sizes a doubling (engine.PREFILL_BUCKETS = 2), a 118-token prompt's chunks 5 and 7 run at
  windows of 96 and 128 rows padded at their start: the device placement, host placement keeping the rows and host
  placement re-delivering each chunk's windows give the same bits, and the prefill records those shapes."""
  monkeypatch.setattr(engine_lib, "PREFILL_BUCKETS", 2)
  prompts = helpers.prompts([118, 90])
  ref = helpers.engine(2).generate(prompts, 4, keep_logits=True)
  kept = helpers.engine(2, placement="host", depth=2).generate(prompts, 4, keep_logits=True)
  with mock.patch.object(residency, "free_device_bytes", lambda devices: 0):
    with mock.patch.object(model, "SPAN_HIDDEN_BYTES", 1):  # One chunk a span.
      res = helpers.engine(2, placement="host", depth=2).generate(prompts, 4, keep_logits=True)
  assert not res.transport["prefill"]["keep"] and kept.transport["prefill"]["keep"]
  for other in (kept, res):
    np.testing.assert_array_equal(other.logits, ref.logits)
    assert other.tokens_sha256 == ref.tokens_sha256
  eng = helpers.engine(2)
  gen = eng.start(1)
  try:
    eng.prefill_prompts(gen, prompts[:1], next_pass=False)
    windows = sorted({w for kind, w, _ in gen.shapes if kind == "prefill"})
  finally:
    gen.close()
  assert windows == [0, 16, 32, 48, 64, 96, 128]  # Chunks 0 to 4 exact, 5 (80 rows) and 6 at 96, 7 (112) at 128.


@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_host_prefill_with_zero_rows_and_host_attention_keeps_the_bits(fraction):
  """A synthetic context (rows below the first chunk prefilled are zeros, delivered once) and host attention's
  head/tail store: keeping the rows on the devices gives the bits of re-delivering them."""
  prompts = helpers.prompts(LENGTHS)
  kw = dict(placement="host", depth=1, host_attention=bool(fraction), host_attention_fraction=fraction)
  kept = helpers.engine(2, **kw).generate(prompts, 4, zero_rows=16, keep_logits=True)
  assert kept.transport["prefill"]["keep"]
  with mock.patch.object(residency, "free_device_bytes", lambda devices: 0):
    res = helpers.engine(2, **kw).generate(prompts, 4, zero_rows=16, keep_logits=True)
  assert not res.transport["prefill"]["keep"]
  np.testing.assert_array_equal(res.logits, kept.logits)
  if not fraction:
    device = helpers.engine(2).generate(prompts, 4, zero_rows=16, keep_logits=True)
    np.testing.assert_array_equal(kept.logits, device.logits)


def check_script():
  spec = importlib.util.spec_from_file_location("check_prefill", ROOT / "tools" / "check_prefill.py")
  script = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(script)
  return script


def test_the_gpu_check_script_reports_a_cudnn_failure_and_times_the_placements():
  """tools/check_prefill.py on CPU with the tiny model: cuDNN's failure is a row, not a crash; the placements give
  the same bits and the host keeps the rows on the devices."""
  script = check_script()
  acc = script.accuracy(helpers.tiny_config(dtype="bfloat16").model, 8, [0, 8], [[0], [0, 11]])
  assert [r["ok"] for r in acc] == [False] * 4 and all("cuDNN" in r["error"] and r["xla_ms"] > 0 for r in acc)
  cd = tiny.get_config()
  cd.mesh.tensor = 2
  mesh, params, _ = run_lib.build(config_lib.from_config_dict(cd), 0)
  rows = script.prefill_times(cd, [40], ["device", "host"], ["xla"], mesh, params)
  assert [(r["placement"], r["attention"]) for r in rows] == [("device", "xla"), ("host", "xla")]
  assert all(r["same_bits_as_placements"] and r["same_bits_twice"] and r["warm_prefill_s"] > 0 for r in rows)
  assert rows[1]["keep"] and rows[1]["prefill_h2d_bytes"] == 0 < rows[1]["prefill_d2h_bytes"]
  assert "| 40 | xla (xla) | host | 16 |" in script._table(acc, rows)  # pylint: disable=protected-access


def _windows_beside_the_cache(eng, prompt_len: int, chunk_rows: int, free: int | None) -> tuple[list[int], dict]:
  """Prefills one prompt of prompt_len tokens (spans of 2 chunks) where the fullest device has `free` bytes free;
  after each call of every layer (jax.live_arrays) counts the windows larger than a delivery chunk on the devices
  that are not a resident layer's window in the cache. Returns the counts and the prefill's summary (its plan)."""
  counts = []

  def count(cache) -> None:
    own = {id(w) for w, s in zip(cache.windows, cache.streamed) if w is not None and not s}
    big = [a for a in jax.live_arrays() if a.ndim == 5 and a.shape[3] > chunk_rows and "host" not in str(a.aval)]
    counts.append(sum(id(a) not in own for a in big))

  layer_fns, store = eng.layer_fns, engine_lib.cache_lib.KVCache.store

  def counted_fns(layer):
    fns = layer_fns(layer)

    def counted(f):
      def call(*args, **kwargs):
        out = f(*args, **kwargs)
        count(gen.cache)
        return out

      return call

    return types.SimpleNamespace(**{n: counted(getattr(fns, n)) for n in ("prefill", "grow", "tail", "place")})

  def counted_store(cache, layer, window):
    out = store(cache, layer, window)
    count(cache)
    return out

  d_model = eng.config.model.d_model
  with (
      mock.patch.object(eng, "layer_fns", counted_fns),
      mock.patch.object(engine_lib.cache_lib.KVCache, "store", counted_store),
      mock.patch.object(residency, "free_device_bytes", lambda devices: free),
      mock.patch.object(model, "SPAN_HIDDEN_BYTES", 2 * eng.config.engine.prefill_chunk * d_model * 4),
  ):
    gen = eng.start(1)
    try:
      eng.prefill_prompts(gen, helpers.prompts([prompt_len]), next_pass=False)
    finally:
      gen.close()
  return counts, gen.prefill_summary


def _chunked_config(chunk_rows: int) -> config_lib.Config:
  """The tiny config with delivery chunks of chunk_rows rows."""
  cfg = helpers.tiny_config()
  row_bytes = 2 * cfg.model.num_kv_heads * cfg.model.head_dim * 4
  return dataclasses.replace(cfg, kv=dataclasses.replace(cfg.kv, delivery_chunk_mib=chunk_rows * row_bytes / 2**20))


def test_a_prefill_holds_three_windows_beside_the_cache():
  """The device memory a prefill past the device budget takes beside the cache's windows: after each call of every
  layer, at most three windows larger than a delivery chunk (each takes the whole ring, as a 1M prompt's 4 GiB
  windows do) are on the devices: the delivered one (its ring slot), the one grown by the chunks and the next size
  of it or the one placed for the cache, never a layer's before it (a reference held by the consumer, the prefill
  or the transport's feeder while the next layer computes: on the H200 a 1M prompt's last span ran out of memory
  with two such windows more)."""
  chunk_rows = 256  # One leaf (jaxkv.decode_attention.LEAF_ROWS), the smallest delivery chunk.
  cfg = _chunked_config(chunk_rows)
  eng = helpers.engine(1, placement="host", depth=2, capacity=1024, chunk=64, group_layers=1, cfg=cfg)
  counts, _ = _windows_beside_the_cache(eng, 600, chunk_rows, free=0)  # A full device.
  assert len(counts) > 10 * cfg.model.num_layers and max(counts) == 3, counts


def test_a_prefill_keeps_no_streamed_window_in_the_resident_layers_room():
  """auto's resident layers fill the device at the cache's capacity, so a long prompt's streamed windows go through
  the transport from span to span, not kept on the devices while the resident windows grow (on the H200 a 1M
  prompt, 24 layers resident, held all 8 streamed windows there and ran out of memory in its last span): at most
  three windows beside the resident ones, as where every layer streams. With room for them, they stay."""
  chunk_rows = 256
  cfg = _chunked_config(chunk_rows)
  capacity, resident = 2048, 3
  eng = helpers.engine(1, placement="auto", depth=1, capacity=capacity, chunk=64, group_layers=1, cfg=cfg)
  kv, layers = eng.config.kv, cfg.model.num_layers
  layer = engine_lib.cache_lib.row_bytes(cfg.model, kv.dtype, 1, 1) * engine_lib.cache_lib.rows_bound(
      capacity, kv.block
  )
  ample = residency.auto_plan(cfg.model, kv, 1, capacity, 64, tuple((l,) for l in range(layers)), 1, 2**40)
  full = resident * layer + ample.ring_bytes + ample.workspace_bytes + kv.headroom_mib * 2**20
  counts, summary = _windows_beside_the_cache(eng, 1400, chunk_rows, free=full)
  assert not summary["keep"] and max(counts) == 3, (summary, counts)
  _, summary = _windows_beside_the_cache(eng, 1400, chunk_rows, free=full + layer)  # One more resident: room.
  assert summary["keep"], summary
