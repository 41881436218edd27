"""Window buckets (kv.window_buckets, jaxkv.cache.window_rows): decode windows allocated at m * 2^s blocks, padded at
their start, give the bits of exact windows; a sequence that crosses many blocks compiles decode programs per bucket,
not per block; and a server warmed up for its capacity (jaxkv.warmup) compiles no decode program while it serves."""

import dataclasses

import helpers
import numpy as np
import pytest

from jaxkv import cache as cache_lib
from jaxkv import compile_cache
from jaxkv import engine as engine_lib
from jaxkv import serving
from jaxkv import warmup


def test_window_rows_are_m_times_powers_of_two_of_blocks_from_a_leaf_to_the_capacity():
  rows = lambda w, k=1, block=8, capacity=2048: cache_lib.window_rows(w, block, capacity, k)
  powers = [0, 256, 256, 512, 512, 1024, 1024, 2048, 2048]
  assert [rows(w) for w in (0, 8, 256, 264, 512, 520, 1024, 1032, 2048)] == powers
  assert rows(1032, capacity=1100) == 1104  # Capped at the capacity rounded up to a block.
  assert rows(768, block=384) == 768 and rows(1152, block=384) == 1536  # Blocks of any size: powers of two of them.
  # Four sizes per doubling: 32, 40, 48, 56, 64, 80, ... blocks of 8 rows (at most 1.25x the rows past the first).
  assert [rows(w, 4) for w in (8, 256, 264, 320, 328, 520, 1032, 1700)] == [256, 256, 320, 320, 384, 640, 1280, 1792]
  quarters = [1, 2, 3, 4, 5, 6, 7, 8, 10, 10, 12, 12, 14, 14, 16, 16]  # Blocks of 256 rows: exact up to 8 blocks.
  assert [rows(w, 4, 256, 4096) // 256 for w in range(256, 4097, 256)] == quarters
  assert rows(264, 0) == 264  # Exact windows.


@pytest.fixture(scope="module")
def wide_blocks():
  """The tiny model with 64-row blocks at capacity 1024 and 4 window sizes per doubling: sequences of up to 449 rows
  cross 5 blocks and 4 buckets (4 to 7 blocks: the first holds windows of 2 to 4 blocks)."""
  eng = helpers.engine(2, placement="device", block=64, chunk=64, capacity=1024)
  return helpers.with_kv(eng, window_buckets=4)


def test_buckets_give_the_bits_of_exact_windows(wide_blocks):
  prompts = helpers.prompts([150, 37, 90], seed=3)
  exact = helpers.with_kv(wide_blocks, window_buckets=0).generate(prompts, 300, keep_logits=True)
  bucketed = wide_blocks.generate(prompts, 300, keep_logits=True)
  streamed = helpers.with_kv(wide_blocks, placement="host", pipeline_depth=1).generate(prompts, 300, keep_logits=True)
  for other in (exact, streamed):
    assert bucketed.tokens == other.tokens
    np.testing.assert_array_equal(bucketed.logits, other.logits)
  decode_shapes = lambda res: res.transport["compiled_shapes"]
  assert decode_shapes(bucketed) < decode_shapes(exact)


def test_legacy_attention_and_streamed_windows_keep_exact_windows(wide_blocks):
  """Legacy attention reduces the whole window (its bits would follow A); a streamed window's padding would cross the
  link every step (and host attention splits it at rows of W)."""
  assert wide_blocks.start(1).cache.buckets
  assert not helpers.with_kv(wide_blocks, placement="host").start(1).cache.buckets
  cfg = wide_blocks.config
  legacy = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, decode_attention="legacy"))
  assert not type(wide_blocks)(legacy, wide_blocks.mesh, wide_blocks.params).start(1).cache.buckets


def test_a_sequence_across_many_blocks_compiles_decode_programs_per_bucket():
  """Blocks of 8 rows: 250 prompt rows (one prefill chunk) and 300 new ones cross 38 blocks, and 3 buckets of powers
  of two (256, 512 and 1024 rows)."""
  eng = helpers.engine(1, placement="device", capacity=2048, chunk=256)
  assert eng.config.kv.window_buckets == 1  # The default.
  fns = eng.layer_fns(0)
  programs = lambda: fns.decode_group._cache_size() + fns.decode_group_full._cache_size()
  before = programs()
  res = eng.generate(helpers.prompts([250], seed=1), 300)
  assert res.transport["compiled_shapes"] == 3 + 1  # 3 decode windows, 1 prefill chunk.
  # Each bucket: a pass (decode_group), a pass that fills the pages inside it and one that grows into the next.
  assert programs() - before <= 3 * 3


@pytest.mark.parametrize("prefill_buckets", [engine_lib.PREFILL_BUCKETS, 1])
def test_a_warm_server_compiles_nothing(monkeypatch, prefill_buckets):
  """Warmed up for its capacity, a started server (a first run of one-token requests on its slots: a run's batch is
  its requests', each size compiling its head) compiles no program for prompts of new lengths: neither decode's nor
  the prefill's, also where a prefill window is padded (one bucket a doubling: chunk 3's window of 384 rows is
  computed at 512)."""
  monkeypatch.setattr(engine_lib, "PREFILL_BUCKETS", prefill_buckets)
  eng = helpers.engine(2, placement="device", capacity=600, chunk=128)
  lines = []
  done = warmup.warm_up(eng, 2, lines.append)
  assert [d["rows"] for d in done["decode"]] == [0, 256, 512, 600] == [int(l.split()[2]) for l in lines[:4]]
  assert lines[1].startswith("warm-up: window 256 rows (2/4), ")
  # Chunk indices 0 to 4 (rows before them 0, 128, ..., 512), last chunks of 8 to 128 rows.
  assert [d["rows"] for d in done["prefill"]] == [0, 128, 256, 384, 512] and len(lines) == 4 + 5
  assert lines[4].startswith("warm-up: prefill chunk 0 (1/5), 8 to 128 rows, ")
  server = serving.Server(eng, 2)
  server.serve([serving.Request((0,), 2)] * 2)
  with compile_cache.CompileCounter() as counter:
    requests = [serving.Request(tuple(p), 300) for p in helpers.prompts([30, 290, 45], 2)]
    out = server.serve(requests + [serving.Request(tuple(helpers.prompts([450], 3)[0]), 100)])
  assert all(r.error is None for r in out.results)
  assert counter.counts() == dict(programs_compiled=0, programs_from_cache=0)


def test_a_new_prompt_length_whose_last_chunk_shares_a_size_compiles_nothing():
  """Prompts of 84 and 92 tokens in chunks of 64 rows: a whole chunk, then a last chunk of 20 and of 28 rows, each
  computed as 32 rows (jaxkv.engine.last_chunk_rows): the second request compiles no program (its decode passes
  are the first's: the same window bucket, no open page filled). A third of 100 tokens, whose last chunk is 64
  rows, compiles its prefill's."""
  eng = helpers.engine(1, placement="device", capacity=512, chunk=64)
  assert [engine_lib.last_chunk_rows(n, 8, 64) for n in (1, 8, 9, 20, 30, 33, 64)] == [8, 8, 16, 32, 32, 64, 64]
  server = serving.Server(eng, 1)
  prompts = [tuple(p) for p in helpers.prompts([84, 92, 100], 5)]
  counts = []
  for p in prompts:
    with compile_cache.CompileCounter() as counter:
      assert server.serve([serving.Request(p, 4)]).results[0].error is None
    counts.append(counter.counts()["programs_compiled"] + counter.counts()["programs_from_cache"])
  assert counts[0] > 0 and counts[1] == 0 and counts[2] > 0
