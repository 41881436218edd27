"""Warm-up: a server's decode programs compiled for every window bucket of its capacity before it serves.

With kv.window_buckets a decode window takes one of O(log(capacity / block)) shapes (jaxkv.cache.window_rows), so a
server can compile them all at start-up (`python3 -m jaxkv.serve --warmup`) instead of in the first requests that
reach each. For each bucket of A rows, `warm_up` runs the programs a request meets there on a cache of zeros of the
server's batch: a slot's insert (jaxkv.cache.KVCache.insert_slot), a decode pass (every decode group at A rows), the
pass whose open pages fill inside the bucket (A -> A) and the one that crosses into the next (A -> its next bucket).
The prefill's programs follow a prompt's length, not the window's, and compile with the first prompt of each.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import decode
from jaxkv import distributed


def buckets(cache) -> list[tuple[int, int, int]]:
  """(A, first W, last W) of each window bucket of a cache (jaxkv.cache.KVCache): the allocated rows A and the
  smallest and largest window W that a decode pass meets (whole blocks below the capacity) allocated at A, smallest
  first. A = 0: no window yet."""
  out: dict[int, list[int]] = {}
  for w in range(0, (cache.capacity - 1) // cache.block * cache.block + 1, cache.block):
    out.setdefault(cache.window_rows(w), []).append(w)
  return [(a, ws[0], ws[-1]) for a, ws in sorted(out.items())]


def warm_up(engine, batch: int, report: Callable[[str], None] | None = None) -> list[dict]:
  """Runs every window bucket's decode programs of `engine` (jaxkv.engine.Engine) for `batch` slots on a
  generation of zeros, reporting one line per bucket ("warm-up: window 512 rows (3/5), 4.1 s"). Returns each
  bucket's rows and seconds. The tokens computed are thrown away; a server's requests run later in generations of
  their own."""
  gen = engine.start(batch)
  out = []
  try:
    sizes = buckets(gen.cache)
    for i, (a, first, last) in enumerate(sizes):
      t0 = time.perf_counter()
      _bucket(engine, gen, first, last)
      out.append(dict(rows=a, seconds=time.perf_counter() - t0))
      if report is not None:
        report(f"warm-up: window {a} rows ({i + 1}/{len(sizes)}), {out[-1]['seconds']:.1f} s")
  finally:
    gen.close()
  return out


def _bucket(engine, gen, first: int, last: int) -> None:
  """The programs of one bucket: each slot inserted at window `first` (rows of zeros), a pass there, the pass that
  fills the open pages there, and that of window `last`, which grows into the next bucket."""
  cache, block = gen.cache, gen.cache.block
  cache.clear()
  cache.store_empty_slots(first)
  for l in range(cache.model.num_layers):
    window = None if not first else _zeros(cache, l, cache.window_rows(first))
    for b in range(cache.batch):
      cache.insert_slot(l, b, window, _zeros(cache, l, block))
  x = engine.put(np.zeros((cache.batch, engine.config.model.d_model)), jnp.dtype(engine.config.model.dtype))
  for end in [first, first + block - 1] + ([last + block - 1] if last > first else []):
    cache.rows = end // block * block
    gen.start, gen.end = np.full(cache.batch, end, np.int32), end
    out, _ = decode.decode_pass(engine, gen, x, engine.meta(gen.start, end), next_pass=False, run_ahead=False)
    jax.block_until_ready(out)


def _zeros(cache, layer: int, rows: int) -> jax.Array:
  """[2, 1, K, rows, E] zeros of the cache's dtype on layer's devices: one slot's rows."""
  shape = (2, 1, cache.model.num_kv_heads, rows, cache.row_width)
  return distributed.put_host(np.zeros(shape, cache.dtype), cache.device_shardings[layer])
