"""A streamed window delivered in chunks, each attended on arrival (jaxkv.chunked): its geometry, its attention bit
for bit the whole window's (XLA leaves and the interpreted kernel), and decode with chunked windows bit for bit the
device placement's, with a ring of chunks."""

import functools

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import llama3_8b
from jaxkv import cache as cache_lib
from jaxkv import chunked
from jaxkv import config as config_lib
from jaxkv import decode_attention as da
from jaxkv import residency
from jaxkv.host import memory
from jaxkv.kv_quant import KVFormat

S = da.LEAF_ROWS


def test_chunks_cut_the_window_with_a_leaf_of_overlap():
  assert chunked.chunks(700, 0) == [chunked.Chunk(0, 1, 0, 700)]
  assert chunked.chunks(512, 512) == [chunked.Chunk(0, 1, 0, 512)]  # Not larger than a chunk: whole.
  assert chunked.chunks(1100, 512) == [
      chunked.Chunk(0, 3, 0, 512),
      chunked.Chunk(1, 3, 512 - S, 512 + S),
      chunked.Chunk(2, 3, 1024 - S, 76 + S),
  ]
  # kv.delivery_chunk_mib in whole units of lcm(S, block) rows, at least one.
  assert chunked.chunk_rows(1, 1024, 8) == 1024 and chunked.chunk_rows(0.01, 1024, 8) == S
  assert chunked.chunk_rows(512, 2**12, 256) == 2**17  # The 8B geometry's 1M window: 4 KiB a row, 32 chunks.
  assert chunked.chunk_rows(1, 1024, 384) == 768  # lcm(256, 384).
  assert chunked.slot_bytes(100 * 1024, 0, 1024, 256) == 100 * 1024
  assert chunked.slot_bytes(100 * 1024, 512, 1024, 256) == 100 * 1024
  # A chunk's buffer, twice where it is put as runs (the runs and their stacked copy), once where it is sliced.
  assert chunked.slot_bytes(2000 * 1024, 512, 1024, 256) == (512 + S) * 1024
  assert chunked.slot_bytes(2000 * 1024, 512, 1024, -(-cache_lib.MIN_RUN_BYTES // (512 + S))) == 2 * (512 + S) * 1024


def test_the_planner_counts_the_ring_in_chunks():
  kv = config_lib.KVConfig(placement="auto", delivery_chunk_mib=512.0)
  assert residency.delivery_chunk_rows(kv, 1, 2**12) == 2**17
  assert residency.delivery_chunk_rows(kv, 2, 2**12) == 0  # Groups of several layers: whole windows.
  assert residency.delivery_chunk_rows(config_lib.KVConfig(placement="auto", delivery_chunk_mib=0.0), 1, 2**12) == 0
  with pytest.raises(ValueError, match="delivery_chunk_mib must be >= 0"):
    config_lib.KVConfig(delivery_chunk_mib=-1.0)


@pytest.mark.parametrize("impl,kv_dtype", [("xla", "float32"), ("pallas", "float32"), ("pallas", "int8")])
def test_chunked_attention_is_the_whole_windows_bit_for_bit(impl, kv_dtype):
  """Windows cut into chunks of 2 leaves (the last one partial), ends at several offsets from a leaf boundary, a
  sequence starting mid-window: the same o and lse as the whole window's attention, bit for bit; int8 rows read
  packed by the kernel (jaxkv.decode_attention.attention_rows), each chunk's leaves too."""
  rng = np.random.default_rng(0)
  b, k, g, dh, page, c_rows = 2, 2, 2, 32, 16, 2 * S
  fmt = KVFormat(kv_dtype, dh, "float32")
  interpret = impl == "pallas"
  attend = jax.jit(functools.partial(da.attend, impl=impl, interpret=interpret, kv_format=fmt))
  partials = jax.jit(
      functools.partial(chunked.chunk_partials, num_leaves=c_rows // S, kv_format=fmt, impl=impl, interpret=interpret)
  )
  attention = jax.jit(
      functools.partial(chunked.chunked_attention, c_rows=c_rows, impl=impl, interpret=interpret, kv_format=fmt)
  )
  cases = [(5 * S + 24, 3), (4 * S, 15)] if impl == "xla" else [(5 * S + 24, 3)]
  for w_rows, offset in cases:
    rows = fmt.pack(jnp.asarray(rng.standard_normal((2, b, k, w_rows + page, dh)), jnp.float32))
    q = jnp.asarray(rng.standard_normal((b, k, g, dh)), jnp.float32)
    window, open_page = da.attention_rows(impl, fmt, (rows[:, :, :, :w_rows], rows[:, :, :, w_rows:]))
    start, end = jnp.asarray([0, 300], jnp.int32), jnp.int32(w_rows + offset)
    want = attend(q, (window, open_page), jnp.int32(0), start, end)
    pieces = chunked.chunks(w_rows, c_rows)
    assert len(pieces) == -(-w_rows // c_rows) >= 2
    buffers = [window[:, :, :, c.first_row : c.first_row + c.rows] for c in pieces]
    older = tuple(partials(q, buf, jnp.int32(c.first_row), start, end) for c, buf in zip(pieces[:-1], buffers))
    got = attention(q, buffers[-1], open_page, older, start, end)
    for x, y in zip(got, want):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


LENGTHS = (800, 790)
ZERO_ROWS = 768  # A synthetic context: windows of 784-800 rows, 4 chunks of 256 rows.
NEW = 10  # Crosses a block boundary (block 8): the chunked windows grow.


@functools.lru_cache(maxsize=None)
def _reference(kv_dtype: str):
  cfg = helpers.tiny_config(head_dim=32) if kv_dtype == "int8" else None
  eng = helpers.engine(2, placement="device", capacity=832, chunk=256, group_layers=1, kv_dtype=kv_dtype, cfg=cfg)
  return eng.generate(helpers.prompts(LENGTHS), NEW, keep_logits=True, zero_rows=ZERO_ROWS)


@pytest.mark.parametrize(
    "placement,depth,kv_dtype,runs",
    [("host", 2, "model", True), ("host", 2, "model", False), ("auto", 1, "model", False), ("host", 1, "int8", True)],
)
def test_decode_with_chunked_windows_is_the_device_placements_bit_for_bit(
    placement, depth, kv_dtype, runs, monkeypatch
):
  # runs: chunks put as their (K or V, sequence, head) runs, else cut by a jitted slice (the tiny model's runs are
  # under cache_lib.MIN_RUN_BYTES).
  if runs:
    monkeypatch.setattr(cache_lib, "MIN_RUN_BYTES", 0)
  cfg = helpers.tiny_config(head_dim=32) if kv_dtype == "int8" else None
  kw = dict(capacity=832, chunk=256, group_layers=1, kv_dtype=kv_dtype, cfg=cfg)
  eng = helpers.engine(2, placement=placement, depth=depth, **kw)
  layer = helpers.layer_bytes(eng, len(LENGTHS))
  budget = dict(device_budget_gib=(2 * layer + layer // 2) / 2**30) if placement == "auto" else {}
  row = layer // (832 + 8)  # Rows bound: capacity plus a block.
  eng = helpers.with_kv(eng, delivery_chunk_mib=S * row / 2**20, **budget)
  res = eng.generate(helpers.prompts(LENGTHS), NEW, keep_logits=True, zero_rows=ZERO_ROWS)
  reference = _reference(kv_dtype)
  np.testing.assert_array_equal(res.logits, reference.logits)
  assert res.tokens == reference.tokens
  t = res.transport
  assert t["delivery_chunk_rows"] == S
  # The ring holds chunks of S + S rows, not the 784-800-row windows: depth + 2 of them at most.
  assert 0 < t["ring_high_water_bytes_per_device"] <= (t["depth"] + 2) * 2 * S * row
  copies = 2 if runs else 1  # The runs and their stacked copy, or the slice.
  assert t["ring_bytes_per_device_configured"] == (t["depth"] + 2) * copies * 2 * S * row
  if placement == "auto":
    assert t["residency"]["resident_layers"] == 2


def test_decode_after_a_prefill_moves_promoted_windows_in_chunks_and_keeps_the_bits(monkeypatch):
  """auto from free device memory, windows delivered in chunks: after the prefill, the decode plan
  (residency.decode_plan) makes a streamed layer resident, its window moved to the devices a chunk at a time into a
  buffer of the generation's largest window (KVCache.promote); decode then gives the device placement's bits."""
  # The prefill's workspace a layer over decode's: no scores, and the XLA leaves' copy counted as one window.
  monkeypatch.setattr(residency, "WORKSPACE_SCORE_BLOCKS", 0)
  monkeypatch.setattr(residency, "XLA_LEAVES_WINDOWS", 1)
  eng = helpers.engine(2, placement="auto", depth=1, capacity=832, chunk=256, group_layers=1)
  layer = helpers.layer_bytes(eng, len(LENGTHS))
  eng = helpers.with_kv(eng, delivery_chunk_mib=S * (layer // (832 + 8)) / 2**20)
  cfg = eng.config
  groups = residency.decode_groups((0,) * cfg.model.num_layers, 1)
  plan = residency.auto_plan(cfg.model, cfg.kv, len(LENGTHS), 832, 256, groups, 2, 0)  # Its ring and workspace.
  helpers.device_memory(monkeypatch, plan.ring_bytes + plan.workspace_bytes + cfg.kv.headroom_mib * 2**20 + 2 * layer)
  moved = []
  write = cache_lib._write_fn  # pylint: disable=protected-access
  monkeypatch.setattr(cache_lib, "_write_fn", lambda *key: lambda *a: moved.append(a[2]) or write(*key)(*a))
  res = eng.generate(helpers.prompts(LENGTHS), NEW, keep_logits=True, zero_rows=ZERO_ROWS)
  t = res.transport["residency"]
  assert t["resident_layers"] - len(t["promoted"]) == 2 and len(t["promoted"]) == 1
  # 800 rows in chunks of S at the end of 816 (800 + 9): the last one ends at row 800, one chunk size.
  assert moved == [16, 16 + S, 16 + 2 * S, 16 + 800 - S]
  reference = _reference("model")
  np.testing.assert_array_equal(res.logits, reference.logits)
  assert res.tokens == reference.tokens


def test_host_attention_with_chunked_tails_gives_the_bits_of_whole_tails():
  """Host attention on a quarter of each window: the delivered tail (about 600 rows) in chunks of S rows gives the
  bits of the tail delivered whole, with a ring of chunks."""
  eng = helpers.engine(
      2, placement="host", depth=2, capacity=832, chunk=256, host_attention=True, host_attention_fraction=0.25
  )
  row = helpers.layer_bytes(eng, len(LENGTHS)) // (832 + 8)
  run = lambda mib: helpers.with_kv(eng, delivery_chunk_mib=mib).generate(
      helpers.prompts(LENGTHS), NEW, keep_logits=True, zero_rows=ZERO_ROWS
  )
  whole, chunks = run(0.0), run(S * row / 2**20)
  np.testing.assert_array_equal(chunks.logits, whole.logits)
  assert chunks.tokens == whole.tokens
  assert (whole.transport["delivery_chunk_rows"], chunks.transport["delivery_chunk_rows"]) == (0, S)
  assert chunks.transport["ring_high_water_bytes_per_device"] <= 4 * 2 * S * row
  assert whole.transport["ring_high_water_bytes_per_device"] > 4 * 2 * S * row
