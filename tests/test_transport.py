"""Host placement and the delivery pipeline: exactness across modes, the ring, budgets, telemetry."""

import contextlib
import dataclasses
import threading

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import config as config_lib
from jaxkv import decode_attention
from jaxkv import jitted
from jaxkv import kv_quant
from jaxkv import transport as transport_lib
from jaxkv.host import memory

BLOCK = 8
# Prompt lengths at the block boundaries: 1, block - 1, block, block + 1 (and one past two blocks).
LENGTHS = (1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 3)
NEW = 14  # Crosses a block boundary for every sequence: the open page is flushed into the window.
# (placement, depth, kv.group_layers, the depth it runs at). The tiny model's layers are small: automatic groups
# (0) put all 6 in one call, which caps the depth at 0; group_layers 1 is one call per layer, as the device
# placement runs in tests/test_decode_groups.py.
MODES = [
    ("device", 1, 0, 1),
    ("host", 0, 1, 0),
    ("host", 1, 2, 1),
    ("host", 2, 1, 2),
    ("host", 4, 1, 4),
    ("host", 2, 0, 0),
]
SAMPLINGS = {
    "greedy": config_lib.SamplingConfig(),
    "seeded": config_lib.SamplingConfig(temperature=0.8, top_k=50, top_p=0.95),
}


def _check_every_mode_is_bitwise_identical(tensor, sampling, kv_dtype="model", cfg=None):
  results = {}
  for mode in MODES:
    placement, depth, group_layers, _ = mode
    eng = helpers.engine(
        tensor,
        placement=placement,
        depth=depth,
        sampling=SAMPLINGS[sampling],
        kv_dtype=kv_dtype,
        group_layers=group_layers,
        cfg=cfg,
    )
    results[mode] = eng.generate(helpers.prompts(LENGTHS), NEW, seed=7, keep_logits=True)
  ref = results[MODES[0]]
  assert ref.transport["h2d_bytes"] == 0
  for mode, res in results.items():
    assert res.tokens == ref.tokens, mode
    np.testing.assert_array_equal(res.logits, ref.logits, err_msg=str(mode))
    assert (res.tokens_sha256, res.logits_sha256) == (ref.tokens_sha256, ref.logits_sha256)
    assert len(res.transport["decode_groups"]) == 6 // (mode[2] or 6)
    if mode[0] == "host":
      assert res.transport["depth"] == mode[3]
      assert res.transport["h2d_bytes"] > 0 and res.transport["d2h_bytes"] > 0


# Greedy on every mesh; seeded sampling on meshes 1 and 8 (8 KV heads on one device, one a device) only: what a mode
# could get wrong in a seeded run beyond greedy's logits is the draw's key (its seed, stream and step), which no mesh
# changes.
@pytest.mark.parametrize(
    "sampling,tensor", [*(("greedy", t) for t in helpers.MESH_SIZES), ("seeded", 1), ("seeded", 8)]
)
def test_every_delivery_mode_is_bitwise_identical(sampling, tensor):
  _check_every_mode_is_bitwise_identical(tensor, sampling)


# The gate for every other KV dtype ("float32" is the tiny model's own dtype, gated above greedy at every mesh and
# seeded at 1 and 8). To keep the suite fast each runs greedy on one mesh, not the 8 x 2 x 5 matrix: packing acts on
# one head row at a time, so the mesh only decides which device holds a row, and sampling reads only the logits. The
# meshes that cover both, 1 (unsharded) and 4 (two heads per device), each run packed rows with their scales (int4 and
# float8 on 1, int8 on 4); bfloat16 (a plain cast) runs on 4. Each case compiles programs of its own (a dtype on a
# mesh): a case more costs the suite 10 to 25 s. head_dim 32, as int8 and int4 need.
@pytest.mark.parametrize("kv_dtype,tensor", [("int8", 4), ("int4", 1), ("float8_e4m3fn", 1), ("bfloat16", 4)])
def test_every_delivery_mode_is_bitwise_identical_for_each_kv_dtype(kv_dtype, tensor):
  _check_every_mode_is_bitwise_identical(tensor, "greedy", kv_dtype, helpers.tiny_config(head_dim=32))


def test_deliveries_carry_only_the_filled_window_and_each_device_its_heads():
  """Bytes moved: every layer's filled blocks once per decode step, never the capacity; D2H only on growth."""
  tensor, lengths, new = 4, [BLOCK + 1, 3], 2 * BLOCK
  eng = helpers.engine(tensor, placement="host", depth=2, debug=1, group_layers=2)
  res = eng.generate(helpers.prompts(lengths), new)
  cfg = helpers.tiny_config().model
  row = 2 * len(lengths) * cfg.num_kv_heads * cfg.head_dim * 4  # K and V, whole batch, f32.
  # Decode step t writes row end = 9 + t - 1 and sees the full blocks below the block holding `end`.
  windows = [(BLOCK + 1 + t - 1) // BLOCK * BLOCK for t in range(1, new)]
  assert res.transport["h2d_bytes"] == cfg.num_layers * row * sum(windows)  # Prefill had no full block yet.
  # A window grows by one block each time the open page fills; the grown window is stored once.
  grown = [w + BLOCK for t, w in enumerate(windows, 1) if (BLOCK + t) % BLOCK == BLOCK - 1]
  assert res.transport["d2h_bytes"] == cfg.num_layers * row * (BLOCK + sum(grown))  # + the prefill's block.
  # Ring: at most depth + 2 groups of 2 windows alive per device, each holding that device's heads.
  assert 0 < res.transport["ring_high_water_bytes_per_device"] <= 4 * 2 * row // tensor * max(windows)


def test_delivered_shards_hold_the_device_heads_and_the_ring_is_bounded():
  tensor, depth = 4, 2
  cfg = helpers.tiny_config()
  kv = dataclasses.replace(cfg.kv, placement="host", pipeline_depth=depth, group_layers=2)  # 3 groups.
  cache = helpers.kv_cache(cfg.model, kv, helpers.mesh(tensor), batch=2, capacity=64)
  shape = (2, 2, cfg.model.num_kv_heads, 3 * BLOCK, cfg.model.head_dim)
  for l in range(cfg.model.num_layers):
    cache.windows[l] = jax.device_put(np.full(shape, l, np.float32), cache.host_sharding)
  assert cache.windows[0].sharding.memory_kind == "pinned_host"
  tr = transport_lib.Transport(cache, depth)
  seen = []
  for _ in range(3):
    for d in tr.deliveries(next_pass=True):
      for l, window in zip(d.layers, d.windows):
        assert window.sharding.memory_kind == "device"
        for shard in window.addressable_shards:
          assert shard.data.shape[2] == cfg.model.num_kv_heads // tensor
        assert float(window[0, 0, 0, 0, 0]) == l
      seen.append(tr.in_flight())
  assert max(seen) == depth  # Groups issued ahead of the one being computed; + it + the previous = depth + 2.
  c = tr.take_counters()
  window_share = np.prod(shape) * 4 // tensor
  assert c["ring_high_water_bytes_per_device"] == (depth + 2) * 2 * window_share
  assert c["dispatches"] == 3 * 3  # One transfer a group.


def test_a_whole_window_larger_than_a_chunk_is_on_the_devices_alone():
  """A prefill pass (whole windows) where decode delivers chunks: a window larger than a chunk takes every ring slot,
  so that no other is issued while it is computed and the ring holds it and the previous one, not depth + 2 windows
  (the planner counts a ring of chunks and one window: jaxkv.residency.workspace_bytes)."""
  cfg, depth, rows = helpers.tiny_config(), 2, 3 * decode_attention.LEAF_ROWS
  row = kv_quant.KVFormat.of(cfg.model).row_bytes * 2 * 2 * cfg.model.num_kv_heads  # K and V of 2 sequences.
  kv = dataclasses.replace(
      cfg.kv,
      placement="host",
      pipeline_depth=depth,
      group_layers=1,
      delivery_chunk_mib=decode_attention.LEAF_ROWS * row / 2**20,
  )
  cache = helpers.kv_cache(cfg.model, kv, helpers.mesh(1), batch=2, capacity=rows)
  assert cache.chunk_rows == decode_attention.LEAF_ROWS
  shape = (2, 2, cfg.model.num_kv_heads, rows, cfg.model.head_dim)
  for l in range(cfg.model.num_layers):
    cache.windows[l] = jax.device_put(np.full(shape, l, np.float32), cache.host_sharding)
  tr = transport_lib.Transport(cache, depth)
  assert tr.depth == depth
  seen = []
  for d in tr.deliveries(next_pass=False, whole=True):
    assert d.chunk is None and float(d.windows[0][0, 0, 0, 0, 0]) == d.layers[0]
    seen.append(tr.in_flight())
  assert seen == [0] * cfg.model.num_layers
  assert tr.take_counters()["ring_high_water_bytes_per_device"] == 2 * rows * row
  tr.close()


def test_an_error_in_a_pass_frees_its_slot_and_close_returns():
  """A compute that raises mid-pass gives its ring slot back (the deliveries' iterator releases it when closed):
  close() drains the feeder, which may be waiting for that slot (it hung before), and the error reaches the
  caller."""
  cfg = helpers.tiny_config()
  kv = dataclasses.replace(cfg.kv, placement="host", pipeline_depth=0, group_layers=1)
  cache = helpers.kv_cache(cfg.model, kv, helpers.mesh(2), batch=2, capacity=64)
  shape = (2, 2, cfg.model.num_kv_heads, BLOCK, cfg.model.head_dim)
  for l in range(cfg.model.num_layers):
    cache.windows[l] = jax.device_put(np.zeros(shape, np.float32), cache.host_sharding)
  tr = transport_lib.Transport(cache, 0)  # One slot: the feeder's next delivery waits for the failed layer's.
  with pytest.raises(ValueError, match="compute failed"):
    with contextlib.closing(tr.deliveries(next_pass=True)) as deliveries:
      for d in deliveries:
        if d.layers == (2,):
          raise ValueError("compute failed")
  closed = threading.Thread(target=tr.close, daemon=True)  # A regression fails here, not hangs.
  closed.start()
  closed.join(timeout=30)
  assert not closed.is_alive()


def test_budget_falls_back_to_a_smaller_depth_with_the_same_output():
  full = helpers.engine(2, placement="host", depth=4, group_layers=1).generate(helpers.prompts(LENGTHS), NEW)
  # Per device, a ring slot is 2 x batch 5 x 4 kv heads x (112 + 8) rows x 16 x 4 B = 300 KiB: 1 MiB holds
  # three slots, so depth 1.
  eng = helpers.engine(2, placement="host", depth=4, capacity=112, budget_mib=1, group_layers=1)
  res = eng.generate(helpers.prompts(LENGTHS), NEW)
  t = res.transport
  assert (t["depth_requested"], t["depth"], t["ring_slots"]) == (4, 1, 3)
  assert "kv_pipeline_budget_mib=1" in t["fallback_reason"]
  assert t["ring_bytes_per_device_configured"] <= 2**20
  assert res.tokens_sha256 == full.tokens_sha256 and res.logits_sha256 == full.logits_sha256


def test_choose_depth_uses_the_fullest_device_and_the_headroom():
  mib = 2**20
  c = transport_lib.choose_depth(4, 32, slot_bytes=100 * mib, budget_mib=0, headroom_mib=512, free_bytes=1012 * mib)
  assert c.depth == 3 and c.ring_slots == 5 and "headroom_mib=512" in c.fallback_reason
  c = transport_lib.choose_depth(4, 32, slot_bytes=100 * mib, budget_mib=0, headroom_mib=512, free_bytes=None)
  assert c.depth == 4 and c.fallback_reason is None
  c = transport_lib.choose_depth(2, 32, slot_bytes=100 * mib, budget_mib=150, headroom_mib=0, free_bytes=None)
  assert c.depth == 0 and "even ordered does not fit" in c.fallback_reason
  c = transport_lib.choose_depth(8, 4, slot_bytes=1, budget_mib=0, headroom_mib=0, free_bytes=None)
  assert c.depth == 3 and "streamed groups - 1" in c.fallback_reason


def test_pinned_pool_limit_is_checked_before_allocating(monkeypatch):
  monkeypatch.setenv(memory.POOL_ENV, "0.001")
  eng = helpers.engine(1, placement="host", capacity=4096)
  with pytest.raises(ValueError, match=r"pinned host memory.*XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=\d+"):
    eng.generate(helpers.prompts([3]), 2)
  helpers.engine(1, placement="device", capacity=4096).generate(helpers.prompts([3]), 2)  # Device: no check.


def test_host_ram_is_checked_before_allocating(monkeypatch):
  """The RAM figure comes from the test: a host cache larger than it is refused, naming the GiB and what to lower."""
  eng = helpers.engine(1, placement="host", capacity=4096)
  monkeypatch.setattr(memory, "available_host_bytes", lambda: 2**20)  # 1 MiB of RAM available,
  monkeypatch.setattr(memory, "RESERVED", memory.Reserved())  # none held by the pinned pool.
  live = len(jax.live_arrays())
  with pytest.raises(ValueError, match=r"needs \d+\.\d\d GiB .* this host has 0\.00 GiB of RAM available.*--capacity"):
    eng.generate(helpers.prompts([3]), 2)
  assert len(jax.live_arrays()) == live  # Nothing was allocated.
  monkeypatch.setattr(memory, "available_host_bytes", lambda: 2**40)
  eng.generate(helpers.prompts([3]), 2)
  assert memory.RESERVED.held > 2**20
  monkeypatch.setattr(memory, "available_host_bytes", lambda: 2**20)  # The pool's memory is counted as free.
  eng.generate(helpers.prompts([3]), 2)
  cfg = helpers.tiny_config().model
  fmt = kv_quant.KVFormat.of(cfg, "model")
  memory.check_host_memory(10 * 2**30, 2, cfg, fmt, 1, 4096, 11 * 2**30, 11 * 2**30)  # Fits: no error.
  memory.check_host_memory(10 * 2**30, 2, cfg, fmt, 1, 4096, None, None)  # Unknown: not checked.
  with pytest.raises(ValueError, match=r"needs 10\.00 GiB .*\(2 streamed layers x .* has 9\.50 GiB of RAM available"):
    memory.check_host_memory(10 * 2**30, 2, cfg, fmt, 1, 4096, int(9.5 * 2**30), None)
  with pytest.raises(ValueError, match=r"needs 10\.00 GiB .* pinned pool is limited to 9\.00 GiB"):
    memory.check_host_memory(10 * 2**30, 2, cfg, fmt, 1, 4096, None, 9 * 2**30)


def test_debug_telemetry_has_per_step_and_per_layer_records():
  res = helpers.engine(2, placement="host", depth=1, debug=2).generate(helpers.prompts([5, 9]), 10)
  t = res.transport
  assert {
      "h2d_bytes",
      "d2h_bytes",
      "ring_high_water_bytes_per_device",
      "depth",
      "fallback_reason",
      "compiled_shapes",
      "steps",
      "layer_times_ms",
  } <= set(t)
  assert [s["kind"] for s in t["steps"]].count("decode") == 9
  for s in t["steps"]:
    assert {"h2d_bytes", "d2h_bytes", "ring_high_water_bytes_per_device", "window_rows"} <= set(s)
  assert all(ready >= issue for _, issue, ready in t["layer_times_ms"])
  assert t["compiled_shapes"] <= 4  # Window sizes 0, 8, 16 for decode; one prefill chunk.


def test_long_decode_keeps_device_memory_flat():
  """1,000 host-pipelined steps: live device buffers keep their count; bytes stay within the ring bound."""
  block = 128
  eng = helpers.engine(1, placement="host", depth=2, block=block, chunk=block, capacity=1152, group_layers=1)
  device_arrays = lambda: [a for a in jax.live_arrays() if a.sharding.memory_kind == "device"]
  before = {id(a) for a in device_arrays()}  # Weights and whatever other tests keep alive.
  counts, excess = [], []

  def on_step(step, cache):
    live = [a for a in device_arrays() if id(a) not in before]
    counts.append(len(live))
    ring = (2 + 2) * cache.row_bytes() * cache.window_rows(cache.rows, 0)  # depth + 2 windows, as allocated.
    excess.append(sum(a.nbytes for a in live) - sum(o.nbytes for o in cache.opens) - ring)

  res = eng.generate(helpers.prompts([100]), 1000, on_step=on_step)
  assert res.timing["decode_steps"] == 999 and len(counts) == 999
  # Live device buffers beyond the weights: 6 open pages, at most depth + 2 = 4 deliveries, and per step
  # dispatched but not yet read back (at most the reader's 4 queued + 2) its x, meta, logits and tokens, the decode
  # state's per-row arrays (penalty counts, prompt marks, the grammar mask), plus a few transients: bounded by 41
  # whatever the step count. A leak of one per step would add ~1,000.
  assert max(counts) <= 41, max(counts)
  assert max(counts[500:]) <= max(counts[:500]), (max(counts[:500]), max(counts[500:]))
  # Bytes beyond the open pages and the ring: only small per-step arrays (tokens, logits, meta, x).
  assert max(excess) < 64 * 1024, max(excess)


def test_zero_rows_are_stored_not_prefilled_and_every_mode_agrees():
  """generate(zero_rows=...) stores each prompt's rows [0, zero_rows) as zeros and prefills only the chunks after
  them; the delivery modes stay bitwise identical over that context, and bad values are refused before any work."""
  prompts = helpers.prompts((40, 33))  # Chunks of 16 rows: [0, 16), [16, 32), [32, 48) of each.
  results = {}
  for placement, depth in [("device", 1), ("host", 0), ("host", 2)]:
    eng = helpers.engine(2, placement=placement, depth=depth, chunk=16, debug=1)
    results[placement, depth] = eng.generate(prompts, 6, keep_logits=True, zero_rows=32)
  ref = results["device", 1]
  for mode, res in results.items():
    np.testing.assert_array_equal(res.logits, ref.logits, err_msg=str(mode))
  steps = results["host", 2].transport["steps"]
  assert [s["kind"] for s in steps].count("prefill") == len(prompts)  # Only each prompt's last chunk ran.
  full = helpers.engine(2, chunk=16).generate(prompts, 6, keep_logits=True)
  assert not np.array_equal(full.logits, ref.logits)  # The zero rows were attended, not the prompts' own.
  for bad in (8, 48, -16):
    with pytest.raises(ValueError, match="zero_rows must be a multiple"):
      helpers.engine(2, chunk=16).generate(prompts, 6, zero_rows=bad)


def test_on_chunk_reports_each_prefill_chunk():
  rows = []
  helpers.engine(1, placement="host").generate(helpers.prompts([37, 5]), 2, on_chunk=rows.append)
  # Each prompt alone, in chunks of engine.prefill_chunk (16) rows, the last to the block (8) past its length.
  assert rows == [16, 32, 40, 8]


def test_place_puts_a_prefills_rows_at_a_slots_rows_from_their_parts():
  """jitted.Fns.place: rows [0, R) of window + last chunk at rows [at, at + R) of a window of a_rows rows and the
  open page after it (zeros before `at` and past the rows), one program per (W0, C, a_rows) whatever `at`."""
  rng = np.random.default_rng(0)
  rows = lambda n: jnp.asarray(rng.standard_normal((2, 1, 2, n, 4)), jnp.float32)
  place = jitted.functions(helpers.tiny_config().model, helpers.mesh(1)).place
  before = place._cache_size()
  cases = [(0, 8, 0, 0), (0, 8, 3, 0), (0, 8, 0, 8), (8, 8, 0, 8), (8, 8, 5, 16), (8, 8, 11, 8), (8, 4, 0, 16)]
  for w0, c, at, a_rows in cases:
    window, chunk = (rows(w0) if w0 else None), rows(c)
    full = np.zeros((2, 1, 2, a_rows + 4 + w0 + c, 4), np.float32)
    full[:, :, :, at : at + w0 + c] = chunk if window is None else np.concatenate([window, chunk], 3)
    got_window, got_page = place(window, chunk, np.int32(at), a_rows=a_rows, block=4)
    np.testing.assert_array_equal(got_window, full[:, :, :, :a_rows])
    np.testing.assert_array_equal(got_page, full[:, :, :, a_rows : a_rows + 4])
  assert place._cache_size() - before == len({(w0, c, a_rows) for w0, c, _, a_rows in cases})
