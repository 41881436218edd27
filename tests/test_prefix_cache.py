"""The prefix cache: the store (hash chain, partial hits, LRU under a byte budget, pinned entries kept, a chain
dropped), and served requests whose prompts share prefixes: hits, partial hits, eviction under pressure and a prefix
shared by concurrent slots all give the bits of the same schedule with no hit; one multi-turn exchange over HTTP."""

import helpers
import numpy as np
import pytest

from jaxkv import engine as engine_lib
from jaxkv import serving
from jaxkv.serving import prefix_cache

BLOCK = 4


def _store(budget_blocks):
  return prefix_cache.PrefixCache(budget_blocks * 10, BLOCK)


def _fill(cache, prompt):
  """Stores every usable block of `prompt` not cached yet (rows: the block's index)."""
  keys, found = cache.match(prompt)
  cache.add(keys, [[i] for i in range(len(found), len(keys))], 10)
  cache.release(found)
  return keys


def test_keys_chain_the_whole_prefix():
  cache = _store(8)
  a = cache.keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 2)
  b = cache.keys([1, 2, 3, 4, 5, 6, 7, 0, 9], 2)
  c = cache.keys([0, 2, 3, 4, 5, 6, 7, 8, 9], 2)
  assert a[0] == b[0] and a[1] != b[1]  # Block 1 differs.
  assert a[1] != c[1]  # Same tokens in block 1, different block 0.
  assert cache.usable_blocks(8) == 1 and cache.usable_blocks(9) == 2  # The last token is always prefilled.


def test_full_and_partial_hits():
  cache = _store(8)
  _fill(cache, list(range(13)))  # Blocks 0, 1, 2.
  assert len(cache) == 3 and cache.bytes == 30
  keys, found = cache.match(list(range(13)))
  assert [e.rows for e in found] == [[0], [1], [2]]
  cache.release(found)
  keys, found = cache.match(list(range(6)) + [99] * 7)  # Shares block 0 only.
  assert len(keys) == 3 and [e.rows for e in found] == [[0]]
  cache.release(found)
  _, found = cache.match([99] * 13)
  assert not found
  assert cache.summary()["hits"] == 2 and cache.summary()["hit_tokens"] == 4 * BLOCK
  assert cache.summary()["lookups"] == 4


def test_lru_under_the_budget_evicts_deepest_blocks_first():
  cache = _store(4)
  a = _fill(cache, [1] * 13)  # 3 blocks.
  _fill(cache, [2] * 9)  # 2 more: one of a's goes, its deepest.
  assert cache.bytes == 40 and cache.summary()["evictions"] == 1
  assert a[0] in cache and a[1] in cache and a[2] not in cache
  _, found = cache.match([1] * 13)  # a is now the most recent.
  cache.release(found)
  assert len(found) == 2
  _fill(cache, [3] * 9)  # 2 more: the [2] chain goes, deepest first.
  assert cache.match([2] * 9)[1] == [] and len(cache.match([1] * 13)[1]) == 2


def test_pinned_entries_are_not_evicted():
  cache = _store(2)
  _fill(cache, [1] * 9)
  _, pinned = cache.match([1] * 9)
  _fill(cache, [2] * 9)  # Over the budget: only the new, unpinned blocks may go.
  assert len(cache.match([1] * 9)[1]) == 2 and cache.bytes <= 20
  cache.release(pinned)
  cache.release(pinned)  # Matched twice above.
  _fill(cache, [2] * 9)
  assert cache.match([1] * 9)[1] == [] and len(cache.match([2] * 9)[1]) == 2


def test_drop_removes_unpinned_entries_and_entry_neither_counts_nor_touches():
  cache = _store(8)
  keys = _fill(cache, list(range(13)))  # 3 blocks.
  other = _fill(cache, [9] * 5)
  before = cache.summary()
  assert cache.entry(keys[2]).rows == [2] and cache.entry(b"none") is None and cache.summary() == before
  _, found = cache.match(list(range(9)))  # Pins blocks 0 and 1.
  assert cache.drop(keys) == 1 and keys[2] not in cache and cache.bytes == 30
  cache.release(found)
  assert cache.drop(keys) == 2 and len(cache) == 1 and cache.bytes == 10 and other[0] in cache


def test_bad_budget_is_an_error():
  with pytest.raises(ValueError, match="positive budget"):
    prefix_cache.PrefixCache(0, BLOCK)
  with pytest.raises(ValueError, match=">= 0"):
    serving.Server(helpers.engine(1, placement="device"), 1, prefix_cache_bytes=-1)


def test_a_budget_past_the_pinned_pool_is_an_error(monkeypatch):
  monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "2")
  with pytest.raises(ValueError, match="XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"):
    serving.Server(helpers.engine(1, placement="device"), 1, prefix_cache_bytes=3 * 2**30)


# Served: the tiny config's prefill chunk (the cache's block) is 16 rows; a 40-token shared prefix is 2 whole blocks.
def _requests():
  rng = np.random.default_rng(4)
  shared = rng.integers(2, 250, 40).tolist()
  tails = [3, 9, 30, 1, 17, 6]
  reqs = [serving.Request(tuple(shared + rng.integers(2, 250, n).tolist()), 6, seed=i) for i, n in enumerate(tails)]
  reqs.append(serving.Request(tuple(rng.integers(2, 250, 35).tolist()), 5, seed=9))  # Shares nothing.
  reqs.append(serving.Request(reqs[2].prompt[:50] + (7, 7), 4, seed=10))  # Shares 3 blocks with request 2.
  return reqs


@pytest.fixture(scope="module")
def engine():
  return helpers.engine(2, placement="host", depth=1)


@pytest.fixture(scope="module")
def cold(engine):
  """A cache that stores nothing (a budget below one block): every request prefilled whole, the same way."""
  out = serving.Server(engine, 3, prefix_cache_bytes=1).serve(_requests())
  assert out.transport["prefix_cache"]["hits"] == 0 and out.transport["prefix_cache"]["entries"] == 0
  return out


def test_hits_give_the_bits_of_a_cold_prefill(engine, cold):
  server = serving.Server(engine, 3, prefix_cache_bytes=2**30)
  first = server.serve(_requests())  # Later requests hit the shared prefix, also while the first ones decode.
  again = server.serve(_requests())  # Every request hits, partially or (request 7) up to its last block.
  for out in (first, again):
    assert out.transcript_sha256 == cold.transcript_sha256
    for a, b in zip(out.results, cold.results):
      assert (a.tokens, a.logits_sha256) == (b.tokens, b.logits_sha256)
  s1, s2 = first.transport["prefix_cache"], again.transport["prefix_cache"]
  assert s1["hits"] >= 5 and s1["hit_tokens"] >= 5 * 32
  assert s2["hits"] - s1["hits"] == 8 and s2["evictions"] == 0
  assert s2["hit_tokens"] - s1["hit_tokens"] == 16 * (2 + 3 + 4 + 2 + 3 + 2 + 2 + 3)  # Whole blocks, last one left.
  # Several slots decoded the shared prefix's rows at once.
  assert len({r.slot for r in first.results[:3]}) == 3 and first.results[0].epoch == first.results[2].epoch


def test_one_slot_hits_give_the_bits_of_a_cold_prefill(engine):
  reqs = _requests()[2:4] + _requests()[7:]  # Each request an epoch's first, or a reused slot's.
  want = serving.Server(engine, 1, prefix_cache_bytes=1).serve(reqs)
  server = serving.Server(engine, 1, prefix_cache_bytes=2**30)
  for _ in range(2):
    assert server.serve(reqs).transcript_sha256 == want.transcript_sha256
  assert server.prefix_cache.summary()["hits"] == 5


def test_hits_with_padded_prefill_windows_give_the_bits_of_a_cold_prefill(monkeypatch):
  """With one prefill window size a doubling (engine.PREFILL_BUCKETS = 1: chunk 3's 48 rows computed at 64), a hit
  joins its blocks exact and pads them inside the chunk's call, a miss grows its padded window, and the blocks a
  prefill stores are read past the padding: the bits of a cold prefill."""
  monkeypatch.setattr(engine_lib, "PREFILL_BUCKETS", 1)
  eng = helpers.engine(2, placement="host", depth=1)
  reqs = _requests()
  assert max(len(r.prompt) for r in reqs) > 3 * 16  # A chunk 3 (rows 48 to 64) with a padded window.
  want = serving.Server(eng, 1, prefix_cache_bytes=1).serve(reqs)
  server = serving.Server(eng, 1, prefix_cache_bytes=2**30)
  for _ in range(2):
    assert server.serve(reqs).transcript_sha256 == want.transcript_sha256
  assert server.prefix_cache.summary()["hits"] > 0


def test_hits_with_host_attention_give_the_bits_of_a_cold_prefill():
  split = helpers.engine(2, placement="host", depth=1, host_attention=True, host_attention_fraction=0.5)
  reqs = _requests()[:4]
  want = serving.Server(split, 2, prefix_cache_bytes=1).serve(reqs)
  server = serving.Server(split, 2, prefix_cache_bytes=2**30)
  for _ in range(2):
    assert server.serve(reqs).transcript_sha256 == want.transcript_sha256
  assert server.prefix_cache.summary()["hits"] == 3 + 4


def test_the_server_without_the_cache_gives_the_same_bits(engine, cold):
  off = serving.Server(engine, 3).serve(_requests())  # Every prompt prefilled alone from row 0 there too.
  assert off.transcript_sha256 == cold.transcript_sha256


def test_eviction_under_pressure_leaves_the_slots_alone(engine, cold):
  block_bytes = _block_bytes(engine)
  server = serving.Server(engine, 3, prefix_cache_bytes=3 * block_bytes)
  out = server.serve(_requests())
  s = out.transport["prefix_cache"]
  assert s["evictions"] > 0 and s["hits"] > 0 and s["bytes"] <= 3 * block_bytes
  assert out.transcript_sha256 == cold.transcript_sha256


def _block_bytes(engine):
  cfg = engine.config
  m = cfg.model
  return m.num_layers * 2 * m.num_kv_heads * cfg.engine.prefill_chunk * m.head_dim * 4  # f32 rows.


def test_multi_turn_over_http_hits_and_moves_the_metrics(engine):
  for extra in ("fastapi", "uvicorn", "prometheus_client", "httpx"):
    pytest.importorskip(extra, reason="the serve extra: pip install -e '.[serve]'")
  import httpx  # pylint: disable=g-import-not-at-top
  import serve_helpers  # pylint: disable=g-import-not-at-top

  def metric(url, name):
    lines = [l for l in httpx.get(url + "/metrics", timeout=60).text.splitlines() if l.startswith(name + " ")]
    return float(lines[0].split()[1])

  turn1 = helpers.prompts([37], seed=11)[0]
  with serve_helpers.running(engine, parallel=2, prefix_cache_bytes=2**30) as (url, _):
    out1 = httpx.post(url + "/v1/completions", json=dict(prompt=turn1, max_tokens=5), timeout=120).json()
    assert metric(url, "jaxkv_prefix_cache_hits_total") == 0
    assert metric(url, "jaxkv_prefix_cache_bytes") == 2 * _block_bytes(engine)
    turn2 = turn1 + out1["choices"][0]["token_ids"] + [3, 4, 5]
    out2 = httpx.post(url + "/v1/completions", json=dict(prompt=turn2, max_tokens=5), timeout=120).json()
    assert metric(url, "jaxkv_prefix_cache_hits_total") == 1
    assert metric(url, "jaxkv_prefix_cache_hit_tokens_total") == 32
    assert metric(url, "jaxkv_prefix_cache_evictions_total") == 0
  want = serving.Server(engine, 2, prefix_cache_bytes=1).serve([serving.Request(tuple(turn2), 5)]).results[0]
  assert out2["choices"][0]["token_ids"] == want.tokens
