"""Window buckets (kv.window_buckets, jaxkv.cache.window_rows): decode windows allocated at powers of two of blocks,
padded at their start, give the bits of exact windows; a sequence that crosses many blocks compiles a decode program
per bucket, not per block; and a server warmed up for its capacity (jaxkv.warmup) compiles no decode program while it
serves."""

import dataclasses

import helpers
import numpy as np
import pytest

from jaxkv import cache as cache_lib
from jaxkv import compile_cache
from jaxkv import serving
from jaxkv import warmup


def test_window_rows_are_powers_of_two_of_blocks_from_a_leaf_to_the_capacity():
  rows = lambda w, block=8, capacity=2048: cache_lib.window_rows(w, block, capacity, True)
  assert [rows(w) for w in (0, 8, 256, 264, 512, 520, 1024, 1032, 2048)] == [0, 256, 256, 512, 512, 1024, 1024] + [
      2048
  ] * 2
  assert rows(1032, capacity=1100) == 1104  # Capped at the capacity rounded up to a block.
  assert rows(768, block=384) == 768 and rows(1152, block=384) == 1536  # Blocks of any size: powers of two of them.
  assert cache_lib.window_rows(264, 8, 2048, False) == 264


@pytest.fixture(scope="module")
def wide_blocks():
  """The tiny model with 64-row blocks at capacity 1024: a sequence of 600 rows crosses 9 blocks and 3 buckets."""
  return helpers.engine(2, placement="host", depth=1, block=64, chunk=64, capacity=1024)


def test_buckets_give_the_bits_of_exact_windows(wide_blocks):
  prompts = helpers.prompts([150, 37, 90], seed=3)
  exact = helpers.with_kv(wide_blocks, window_buckets=False).generate(prompts, 420, keep_logits=True)
  bucketed = wide_blocks.generate(prompts, 420, keep_logits=True)
  assert bucketed.tokens == exact.tokens
  np.testing.assert_array_equal(bucketed.logits, exact.logits)
  decode_shapes = lambda res: res.transport["compiled_shapes"]
  assert decode_shapes(bucketed) < decode_shapes(exact)


def test_legacy_attention_and_host_attention_keep_exact_windows(wide_blocks):
  """Legacy attention reduces the whole window (its bits would follow A); host attention splits it at rows of W."""
  assert wide_blocks.start(1).cache.buckets
  cfg = wide_blocks.config
  legacy = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, decode_attention="legacy"))
  assert not type(wide_blocks)(legacy, wide_blocks.mesh, wide_blocks.params).start(1).cache.buckets
  host = helpers.with_kv(wide_blocks, host_attention=True, host_attention_fraction=0.5)
  assert not host.start(1).cache.buckets


def test_a_sequence_across_many_blocks_compiles_a_decode_program_per_bucket():
  """Blocks of 8 rows: 20 prompt rows and 600 new ones cross 77 blocks, and 3 buckets (256, 512, 1024 rows)."""
  eng = helpers.engine(2, placement="device", capacity=2048)
  fns = eng.layer_fns(0)
  before = fns.decode_group._cache_size() + fns.decode_group_full._cache_size()
  res = eng.generate(helpers.prompts([20], seed=1), 600)
  assert res.transport["compiled_shapes"] == 3 + 2  # 3 decode windows, 2 prefill chunks.
  added = fns.decode_group._cache_size() + fns.decode_group_full._cache_size() - before
  # Each bucket: a pass (decode_group), a pass that fills the pages inside it and one that grows into the next.
  assert added <= 3 * 3


def test_a_warm_server_compiles_no_decode_program():
  eng = helpers.engine(2, placement="host", depth=1, capacity=600)
  lines = []
  done = warmup.warm_up(eng, 2, lines.append)
  assert [d["rows"] for d in done] == [0, 256, 512, 600] == [int(l.split()[2]) for l in lines]
  assert lines[1].startswith("warm-up: window 256 rows (2/4), ")
  fns = eng.layer_fns(0)
  sizes = lambda: (fns.decode_group._cache_size(), fns.decode_group_full._cache_size())
  warm = sizes()
  with compile_cache.CompileCounter() as counter:
    out = serving.Server(eng, 2).serve([serving.Request(tuple(p), 300) for p in helpers.prompts([30, 290, 45], 2)])
  assert all(r.error is None for r in out.results)
  assert sizes() == warm
  assert counter.counts()["programs_compiled"] + counter.counts()["programs_from_cache"] > 0  # Its prefills'.
