"""The residency planner (kv.placement "auto"): resident and streamed layers, bit-identical output."""

import dataclasses
from unittest import mock

import helpers
import jax
import numpy as np
import pytest

from experiments import llama3_8b
from jaxkv import cache as cache_lib
from jaxkv import chunked
from jaxkv import config as config_lib
from jaxkv import engine as engine_lib
from jaxkv import jitted
from jaxkv import model
from jaxkv import residency
from jaxkv import serving

LENGTHS = (9, 17, 1, 30)
NEW = 14  # Crosses block boundaries (block 8): windows grow and are stored back in their memory.


def test_spread_keeps_the_resident_layers_apart():
  assert residency.spread(6, 0) == (True,) * 6
  assert residency.spread(6, 6) == (False,) * 6
  assert residency.spread(6, 3) == (True, False, True, False, True, False)
  s = residency.spread(32, 19)
  runs = "".join("rs"[x] for x in s).split("r")  # Runs of streamed layers between resident ones.
  assert s.count(False) == 19 and max(len(r) for r in runs) == 1


def test_free_device_bytes_takes_the_fullest_device():
  class Dev:

    def __init__(self, limit, used):
      self.stats = dict(bytes_limit=limit, bytes_in_use=used)

    def memory_stats(self):
      return self.stats

  assert residency.free_device_bytes([Dev(100, 10), Dev(100, 60)]) == 40
  assert residency.free_device_bytes(jax.devices()[:1]) is None  # CPU: no stats.


def test_device_budget_from_free_memory_or_the_override():
  gib, mib = 2**30, 2**20
  budget, source = residency.device_budget(10 * gib, None, ring_bytes=gib, workspace=300 * mib, headroom_mib=512)
  assert source == "free device memory"
  assert budget == 10 * gib - gib - 300 * mib - 512 * mib
  assert residency.device_budget(10 * gib, 2.0, gib, mib, 0) == (2 * gib, "kv.device_budget_gib")
  assert residency.device_budget(None, None, gib, mib, 0) == (None, "no device memory limit")
  with pytest.raises(ValueError, match="more than the free memory"):
    residency.device_budget(gib, 2.0, 0, mib, 0)
  with pytest.raises(ValueError, match="must be >= 0"):
    residency.device_budget(None, -1.0, 0, mib, 0)


def test_workspace_counts_a_prefill_calls_largest_temporary():
  """The 8B geometry's two cells that ran out of device memory on the H200 (docs/design.md): 32 sequences x 32k,
  whose prefill MLP rows (5.75 GiB) outgrow a layer's window, and 1M tokens at batch 1, whose window does; beside
  them the hidden states of the chunks a prefill computes layer by layer (model.prefill_span: 1 GiB)."""
  cfg = config_lib.from_config_dict(llama3_8b.get_config()).model
  gib, scores = 2**30, residency.WORKSPACE_SCORE_BLOCKS * model.SCORE_BUDGET_BYTES
  layer = 4 * gib  # 32 x 32k rows, or 1M rows of one sequence, of bf16 K and V.
  ws, hidden = residency.workspace_bytes, gib
  assert model.prefill_span(cfg, 32, 2048) * 32 * 2048 * cfg.d_model * 2 == hidden
  assert model.prefill_span(cfg, 1, 2048) * 2048 * cfg.d_model * 2 == hidden
  assert ws(cfg, "model", 32, 2**15, 2048, 1, 1, False) == 2 * layer + 5.75 * gib + hidden + layer + scores
  assert ws(cfg, "model", 1, 2**20, 2048, 1, 1, False) == 2 * layer + layer + hidden + layer + scores
  assert ws(cfg, "model", 1, 2**20, 0, 1, 1, False) == 2 * layer + layer + scores  # No prefill.
  # Windows grown from their chunks (jaxkv.chunked): one window grows at a time.
  assert ws(cfg, "model", 1, 2**20, 2048, 1, 1, True) == layer + layer + hidden + layer + scores
  # int8 rows: the attention's copy holds the window's values in bf16, about twice its stored bytes.
  stored = cache_lib.row_bytes(cfg, "int8", 1) * 2**20
  assert stored < 0.6 * layer
  assert ws(cfg, "int8", 1, 2**20, 2048, 1, 1, False) == 2 * stored + layer + hidden + stored + scores
  # Over 4 devices each holds a quarter of the heads and of the MLP's columns; groups of 2 layers.
  mlp = 32 * 2048 * (cfg.d_model + 3 * cfg.mlp_dim // 4) * 2
  assert ws(cfg, "model", 32, 2**15, 2048, 2, 4, False) == 4 * gib + mlp + hidden + gib + scores


def test_the_1m_plan_keeps_a_layer_more_resident_with_windows_grown_from_their_chunks():
  """The 8B at 1M (bf16, auto, one sequence) on a 139 GiB device with JAX's pool at 0.95, less the weights
  (tools/plan_residency.py): windows grown from their chunks leave a workspace of one window for growth, 16 GiB where
  two windows made it 20, and a layer more resident."""
  c = config_lib.from_config_dict(llama3_8b.get_config())
  kv = dataclasses.replace(c.kv, placement="auto")
  gib, rows = 2**30, cache_lib.rows_bound(2**20, c.kv.block)
  layer = cache_lib.row_bytes(c.model, "model", 1) * rows
  free = int(0.95 * 139 * gib) - 2 * c.model.num_params()
  groups = residency.decode_groups((0,) * c.model.num_layers, 1)
  after = residency.auto_plan(c.model, kv, 1, 2**20, c.engine.prefill_chunk, groups, 1, free)
  scores = residency.WORKSPACE_SCORE_BLOCKS * model.SCORE_BUDGET_BYTES
  assert (
      after.workspace_bytes == 3 * layer + 2**30 + scores and after.ring_bytes == 4 * 2 * (2**17 + 256) * layer // rows
  )
  before = after.workspace_bytes + layer  # Two windows for growth.
  budget, _ = residency.device_budget(free, None, after.ring_bytes, before, c.kv.headroom_mib)
  assert residency.plan(groups, layer, budget, "free device memory").resident_layers == 23
  assert after.resident_layers == 24 and round(after.workspace_bytes / gib) == 16


def test_decode_after_a_1m_prefill_keeps_as_many_layers_resident_with_host_attention():
  """The same 1M plan (tools/plan_residency.py): decode's own plan after the prefill. Host attention's tails grow into
  one buffer like plain streamed windows (jaxkv.host.decode.Growth), their heads taking rows a delivery chunk at a
  time: decode's workspace is one window and one chunk, and decode keeps 27 layers resident either way (host
  attention's prefill, whose windows are split on the devices, keeps one fewer)."""
  c = config_lib.from_config_dict(llama3_8b.get_config())
  gib, rows = 2**30, cache_lib.rows_bound(2**20, c.kv.block)
  row = cache_lib.row_bytes(c.model, "model", 1)
  free = int(0.95 * 139 * gib) - 2 * c.model.num_params()
  groups = residency.decode_groups((0,) * c.model.num_layers, 1)
  plans = {}
  for ha in (False, True):
    kv = dataclasses.replace(c.kv, placement="auto", host_attention=ha)
    prefill = residency.auto_plan(c.model, kv, 1, 2**20, c.engine.prefill_chunk, groups, 1, free)
    c_rows = residency.delivery_chunk_rows(kv, 1, row)
    placed = residency.Placement(prefill.streamed, groups, prefill, c_rows)
    plans[ha] = (prefill, residency.decode_plan(c.model, kv, 1, 2**20, 1, placed, "pallas"), c_rows)
  (prefill, decode, c_rows), (ha_prefill, ha_decode, _) = plans[False], plans[True]
  assert decode.workspace_bytes == rows * row and ha_decode.workspace_bytes == (rows + c_rows) * row
  assert (prefill.resident_layers, ha_prefill.resident_layers) == (24, 23)
  assert decode.resident_layers == ha_decode.resident_layers == 27


def _auto(tensor, depth, layers):
  """An auto engine whose budget holds `layers` whole layers of the tiny model, in groups of one layer (its automatic
  groups hold every layer: one group, resident or streamed whole)."""
  eng = helpers.engine(tensor, placement="auto", depth=depth, group_layers=1)
  layer = helpers.layer_bytes(eng, len(LENGTHS))
  return helpers.with_kv(eng, device_budget_gib=(layers * layer + layer // 2) / 2**30), layer


@pytest.mark.parametrize("tensor", [1, 2, 4])
def test_auto_split_is_bit_identical_to_device_and_host(tensor):
  prompts = helpers.prompts(LENGTHS)
  ref = helpers.engine(tensor, placement="device").generate(prompts, NEW, keep_logits=True)
  host = helpers.engine(tensor, placement="host", depth=2).generate(prompts, NEW)
  assert (host.tokens_sha256, host.logits_sha256) == (ref.tokens_sha256, ref.logits_sha256)
  for depth, layers in ((0, 3), (1, 2), (2, 4), (2, 0)):
    eng, layer = _auto(tensor, depth, layers)
    res = eng.generate(prompts, NEW, keep_logits=True)
    np.testing.assert_array_equal(res.logits, ref.logits)
    assert res.tokens == ref.tokens
    plan = res.transport["residency"]
    assert plan["resident_layers"] == layers and plan["streamed_layers"] == 6 - layers
    assert plan["layer_bytes_per_device"] == layer and plan["budget_source"] == "kv.device_budget_gib"
    # Capped at the streamed groups - 1: each run of streamed layers between resident ones is one group here.
    streamed_groups = sum(g[0] in plan["streamed"] for g in res.transport["decode_groups"])
    assert res.transport["depth"] == min(depth, streamed_groups - 1)
    # Only the streamed layers move: their share of the host placement's bytes.
    assert res.transport["h2d_bytes"] * 6 == host.transport["h2d_bytes"] * (6 - layers)


def test_auto_where_device_memory_is_unknown_keeps_every_layer_resident():
  res = helpers.engine(2, placement="auto").generate(helpers.prompts(LENGTHS), 4)
  assert res.transport["residency"]["resident_layers"] == 6 and res.transport["h2d_bytes"] == 0
  assert res.transport["residency"]["budget_source"] == "no device memory limit"
  assert res.transport["depth"] == 1 and res.transport["fallback_reason"] is None  # Nothing streamed: no cap.


def test_auto_serves_slots_with_the_same_transcript():
  reqs = [serving.Request(tuple(p), n) for p, n in zip(helpers.prompts((5, 12, 20, 3, 9, 30)), (6, 3, 9, 4, 7, 5))]
  ref = serving.Server(helpers.engine(2, placement="device"), 2).serve(reqs)
  out = serving.Server(_auto(2, 1, 3)[0], 2).serve(reqs)
  assert out.transcript_sha256 == ref.transcript_sha256 and out.transport["insertions"] >= 1


@pytest.mark.parametrize("depth, resident", [(1, 2), (2, 3)])
def test_auto_budget_from_free_device_memory_leaves_room_for_the_ring(monkeypatch, depth, resident):
  """With the devices' memory stats (no --kv_device_budget_gib), the prefill's budget is the free memory minus the
  ring of depth + 2 windows, the workspace and the headroom: half a layer more than `resident` layers fit after
  them. Its decode (residency.decode_plan) leaves out the prefill's workspace and makes every layer resident: the
  same bits."""
  prompts = helpers.prompts(LENGTHS)
  ref = helpers.engine(2, placement="device").generate(prompts, NEW, keep_logits=True)
  eng = helpers.engine(2, placement="auto", depth=depth, group_layers=1)  # A ring slot holds one layer's window.
  layer = helpers.layer_bytes(eng, len(LENGTHS))
  headroom = eng.config.kv.headroom_mib * 2**20
  rows = cache_lib.rows_bound(eng.config.engine.capacity, eng.config.kv.block)
  workspace = residency.workspace_bytes(
      eng.config.model, "model", len(LENGTHS), rows, eng.config.engine.prefill_chunk, 1, 2, False
  )
  assert workspace > 3 * layer + residency.WORKSPACE_SCORE_BLOCKS * model.SCORE_BUDGET_BYTES  # A prefill's too.
  free = (depth + 2) * layer + workspace + headroom + resident * layer + layer // 2
  helpers.device_memory(monkeypatch, free)
  res = eng.generate(prompts, NEW, keep_logits=True)
  plan = res.transport["residency"]
  assert plan["budget_source"] == "free device memory" and plan["prefill_workspace_bytes_per_device"] == workspace
  assert plan["resident_layers"] - len(plan["promoted"]) == resident  # The prefill's.
  decode_workspace = residency.decode_workspace_bytes(eng.config.model, "model", len(LENGTHS), rows, 1, 2, False, "xla")
  assert plan["workspace_bytes_per_device"] == decode_workspace == 5 * layer  # Two grown windows, the XLA leaves.
  assert plan["device_budget_bytes"] == free - (depth + 2) * layer - decode_workspace - headroom
  assert plan["resident_layers"] == 6 and plan["streamed_layers"] == 0
  assert res.transport["depth"] == depth and res.transport["fallback_reason"] is None
  np.testing.assert_array_equal(res.logits, ref.logits)
  assert res.tokens == ref.tokens


@pytest.mark.parametrize("lengths,host_attention", [(LENGTHS, False), ((30,), False), ((30,), True)])
def test_decode_after_a_prefill_keeps_more_layers_resident_in_full_windows(monkeypatch, lengths, host_attention):
  """Where the prefill's workspace is what keeps layers streamed, generate's decode (residency.decode_plan) plans
  the same free memory without it: two layers more resident, moved to the devices after the prefill, and every
  resident window allocated at the largest window, a size it keeps as it grows; the same bits as the device
  placement (prompts prefilled straight into the cache, or one by one into its slots; with host attention, the
  promoted layers' heads moved too, the others' split kept)."""
  # The prefill's workspace 1.5 layers over decode's: no scores, and the XLA leaves' copy counted as one window.
  monkeypatch.setattr(residency, "WORKSPACE_SCORE_BLOCKS", 0)
  monkeypatch.setattr(residency, "XLA_LEAVES_WINDOWS", 1)
  prompts = helpers.prompts(lengths)
  ref = helpers.engine(2, placement="device").generate(prompts, NEW, keep_logits=True)
  ha = dict(host_attention=True, host_attention_fraction=0.5) if host_attention else {}
  eng = helpers.engine(2, placement="auto", depth=1, group_layers=1, **ha)
  cfg, layer = eng.config, helpers.layer_bytes(eng, len(lengths))
  rows = cache_lib.rows_bound(cfg.engine.capacity, cfg.kv.block)
  prefill = residency.workspace_bytes(cfg.model, "model", len(lengths), rows, cfg.engine.prefill_chunk, 1, 2, False)
  decode = residency.decode_workspace_bytes(cfg.model, "model", len(lengths), rows, 1, 2, False, "xla")
  assert prefill - decode == 1.5 * layer
  helpers.device_memory(monkeypatch, 3 * layer + prefill + cfg.kv.headroom_mib * 2**20 + layer + layer // 2)
  windows, heads = [], []
  on_step = lambda step, cache: (
      windows.append([None if w is None else w.shape[3] for w in cache.windows]),
      heads.append([cache.head_rows(l) for l in range(6)]),
  )
  res = eng.generate(prompts, NEW, keep_logits=True, on_step=on_step)
  plan = res.transport["residency"]
  assert plan["resident_layers"] == 3 and plan["promoted"] == [1, 4]  # Of 0, 1, 2, 4, 5, the prefill's streamed.
  assert plan["streamed"] == [0, 2, 5] and plan["workspace_bytes_per_device"] == decode
  resident = [False, True, False, True, True, False]
  for step in windows:
    assert all(a == 48 for a, r in zip(step, resident) if r)  # The generation's largest: 30 + 14 - 1 rows.
  assert res.tokens == ref.tokens
  if host_attention:  # The streamed layers' heads host-attended (half of a window, whole blocks), not the promoted.
    assert {tuple(h) for h in heads} == {(16, 0, 16, 0, 0, 16)}
    return  # Split attention: the device placement's tokens, not its bits (tests/test_host_attention_engine.py).
  assert {a for step in windows for a, r in zip(step, resident) if not r} == {32, 40}  # Exact: grown by pages.
  np.testing.assert_array_equal(res.logits, ref.logits)


def test_the_largest_free_block_is_the_fullest_devices(monkeypatch):
  devices = list(helpers.mesh(2).devices.flat)
  assert residency.largest_free_block(devices) is None  # CPU: no stats.
  free = {d: 100 * (i + 1) for i, d in enumerate(devices)}
  monkeypatch.setattr(type(jax.devices()[0]), "memory_stats", lambda d: dict(largest_free_block_bytes=free[d]))
  assert residency.largest_free_block(devices) == 100
  free[next(iter(free))] = 0  # CUDA's async allocator: reported, always 0.
  assert residency.largest_free_block(devices) is None


@pytest.mark.parametrize("cause,group_layers", [("out of memory", 1), ("no free block", 1), ("out of memory", 2)])
def test_a_promoted_group_without_device_memory_stays_streamed(monkeypatch, cause, group_layers):
  """Where the devices have no memory for a group that decode's plan promotes (XLA's RESOURCE_EXHAUSTED while its
  windows move, or no free block of its windows and one more), it and the groups after it stay streamed, whole (a
  group of two fails at its second layer: neither moves), a warning says so, and the run gives the device
  placement's bits."""
  monkeypatch.setattr(residency, "WORKSPACE_SCORE_BLOCKS", 0)
  monkeypatch.setattr(residency, "XLA_LEAVES_WINDOWS", 1)
  prompts = helpers.prompts(LENGTHS)
  ref = helpers.engine(2, placement="device").generate(prompts, NEW, keep_logits=True)
  eng = helpers.engine(2, placement="auto", depth=1, group_layers=group_layers)
  cfg, layer = eng.config, helpers.layer_bytes(eng, len(LENGTHS))
  rows, chunk = cache_lib.rows_bound(cfg.engine.capacity, cfg.kv.block), cfg.engine.prefill_chunk
  prefill = residency.workspace_bytes(cfg.model, "model", len(LENGTHS), rows, chunk, group_layers, 2, False)
  resident = group_layers * layer  # One group: the prefill's; decode's takes 1.5 layers more, a group of one more.
  free = 3 * resident + prefill + cfg.kv.headroom_mib * 2**20 + resident + layer // 2  # Ring: depth + 2 groups.
  helpers.device_memory(monkeypatch, free)
  zeros, promote, moving = cache_lib.KVCache.device_zeros, cache_lib.KVCache.promote, []

  def promote_tracked(cache, layers):
    moving.append(list(layers))
    return promote(cache, layers)

  def zeros_failing(cache, l, rows):  # In promote: the second layer's buffer (1 layer a group: the second group's).
    if moving and sum(map(len, moving)) >= 2 and l == moving[-1][-1] and cause == "out of memory":
      raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.0KiB.")
    return zeros(cache, l, rows)

  monkeypatch.setattr(cache_lib.KVCache, "promote", promote_tracked)
  monkeypatch.setattr(cache_lib.KVCache, "device_zeros", zeros_failing)
  two = 2 * layer * 48 // rows  # Two windows of the generation's largest, per device (30 + 14 - 1 rows: 48).
  blocks = iter([two, two - 1] if cause == "no free block" else [])
  monkeypatch.setattr(residency, "largest_free_block", lambda devices: next(blocks, None))
  with mock.patch.object(engine_lib.logging, "warning") as warning:
    res = eng.generate(prompts, NEW, keep_logits=True)
  plan = res.transport["residency"]
  if group_layers == 1:
    assert moving == ([[1], [4]] if cause == "out of memory" else [[1]]) and plan["promoted"] == [1]
    assert plan["streamed"] == [0, 2, 4, 5] and warning.call_args[0][3] == [4]
  else:
    assert moving == [[4, 5]] and plan["promoted"] == [] and plan["streamed"] == [0, 1, 4, 5]
    assert warning.call_args[0][3] == [4, 5]
  assert "did not fit" in warning.call_args[0][0]
  np.testing.assert_array_equal(res.logits, ref.logits)
  assert res.tokens == ref.tokens


def test_depth_is_lowered_to_what_free_device_memory_holds(monkeypatch):
  """Host placement, depth 4 asked: free memory (less the headroom) holding 3.5 windows keeps a ring of 3 (depth 1),
  says why, and gives the same bits."""
  prompts = helpers.prompts(LENGTHS)
  ref = helpers.engine(2, placement="device").generate(prompts, NEW, keep_logits=True)
  eng = helpers.engine(2, placement="host", depth=4, group_layers=1)  # A ring slot holds one layer's window.
  layer = helpers.layer_bytes(eng, len(LENGTHS))
  helpers.device_memory(monkeypatch, eng.config.kv.headroom_mib * 2**20 + 3 * layer + layer // 2)
  res = eng.generate(prompts, NEW, keep_logits=True)
  t = res.transport
  assert t["depth_requested"] == 4 and t["depth"] == 1 and t["ring_slots"] == 3
  assert "free device memory" in t["fallback_reason"] and "using depth 1" in t["fallback_reason"]
  assert t["ring_bytes_per_device_configured"] == 3 * layer
  assert 0 < t["ring_high_water_bytes_per_device"] <= 3 * layer
  np.testing.assert_array_equal(res.logits, ref.logits)
  assert res.tokens == ref.tokens


@pytest.mark.parametrize("group_layers", [1, 2])
def test_stored_windows_in_flight_stay_within_the_workspace_the_planner_counts(monkeypatch, group_layers):
  """A synthetic fill stores every layer's window in turn: before a layer's D2H copy is issued past the largest
  group's worth, the oldest copies are waited for, so at most one group's device windows are held for them."""
  eng = helpers.engine(2, placement="host", depth=1, group_layers=group_layers)
  cfg = eng.config
  waited = []
  block = jax.block_until_ready
  monkeypatch.setattr(jax, "block_until_ready", lambda x: waited.append(x) or block(x))
  cache = helpers.kv_cache(cfg.model, cfg.kv, eng.mesh, 2, cfg.engine.capacity)
  cache.store_zeros(16)
  layers = cfg.model.num_layers
  assert len(cache._in_flight) == group_layers  # pylint: disable=protected-access
  assert [w[0] for w in waited] == cache.windows[: layers - group_layers]  # The oldest, in order.


def test_the_workspace_holds_what_xla_measures_for_the_prefill_and_decode_programs():
  """XLA's memory analysis of the compiled programs (CPU, the XLA attentions) against residency.workspace_bytes at a
  4096-row window: a prefill call's temporaries are its prefill term (the window's copy) and WORKSPACE_SCORE_BLOCKS
  blocks of that call's scores, within 5%; a decode step that grows the window needs, beside its arguments, its
  temporaries and the grown window, no more than the workspace without the scores, or than decode's own workspace
  (residency.decode_workspace_bytes). A window grown from its chunks
  (jaxkv.chunked) is written in place: each chunk and then the open page into the one grown buffer, donated, with
  no temporary beyond a page."""
  ws = residency.workspace_bytes
  cfg = helpers.tiny_config().model
  fns = jitted.functions(cfg, helpers.mesh(1), "model", "xla", "xla")
  p = helpers.params(1)["layers"][0]
  b, w, c, page = 1, 4096, 256, 8
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, np.float32)
  meta = jax.ShapeDtypeStruct((b + 1,), np.int32)
  window = f32(2, b, cfg.num_kv_heads, w, cfg.head_dim)
  prefill = fns.prefill.lower(p, f32(b, c, cfg.d_model), window, meta).compile().memory_analysis()
  term = ws(cfg, "model", b, w, c, 1, 1, False) - ws(cfg, "model", b, w, 0, 1, 1, False)
  qb = model.query_block(b, cfg.num_heads, c, w + c, model.SCORE_BUDGET_BYTES)
  scores = residency.WORKSPACE_SCORE_BLOCKS * b * cfg.num_heads * qb * (w + c) * 4
  assert 0.95 * (term + scores) <= prefill.temp_size_in_bytes <= term + scores
  opens = [f32(2, b, cfg.num_kv_heads, page, cfg.head_dim)]
  decode = fns.decode_group_full.lower([p], f32(b, cfg.d_model), [window], opens, meta).compile().memory_analysis()
  no_scores = ws(cfg, "model", b, w, c, 1, 1, False) - residency.WORKSPACE_SCORE_BLOCKS * model.SCORE_BUDGET_BYTES
  assert decode.temp_size_in_bytes + decode.output_size_in_bytes <= no_scores
  # Decode alone (residency.decode_plan): the grown window and the XLA leaves' temporaries.
  alone = residency.decode_workspace_bytes(cfg, "model", b, w, 1, 1, False, "xla")
  assert alone == (2 + residency.XLA_LEAVES_WINDOWS) * window.size * 4
  assert 2 * window.size * 4 < decode.temp_size_in_bytes <= residency.XLA_LEAVES_WINDOWS * window.size * 4
  assert decode.temp_size_in_bytes + decode.output_size_in_bytes <= alone
  calls = chunked.calls(cfg, helpers.mesh(1), "model", "xla")
  grown, page_bytes = f32(2, b, cfg.num_kv_heads, w + page, cfg.head_dim), opens[0].size * 4
  write = calls.write.lower(grown, f32(2, b, cfg.num_kv_heads, 512, cfg.head_dim), 0).compile().memory_analysis()
  flush = calls.flush.lower(grown, opens[0], w).compile().memory_analysis()
  assert write.temp_size_in_bytes == 0 and write.alias_size_in_bytes == write.output_size_in_bytes == grown.size * 4
  assert flush.temp_size_in_bytes <= 2 * page_bytes and flush.alias_size_in_bytes == grown.size * 4 + page_bytes
