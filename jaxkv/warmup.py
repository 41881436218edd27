"""Warm-up: a server's decode and prefill programs compiled for its capacity before it serves.

With kv.window_buckets a decode window takes one of O(log(capacity / block)) shapes (jaxkv.cache.window_rows), so a
server can compile them all at start-up (`python3 -m jaxkv.serve --warmup`) instead of in the first requests that
reach each. For each bucket of A rows, `warm_up` runs the programs a request meets there on a cache of zeros of the
server's batch: a slot's insert (jaxkv.cache.KVCache.insert_slot), a decode pass (every decode group at A rows), the
pass whose open pages fill inside the bucket (A -> A) and the one that crosses into the next (A -> its next bucket).

A prefill's programs follow its chunks' windows (jaxkv.engine.prefill_window_rows: exact up to 16 chunks, then
buckets) and its last chunk, one of log2(chunk / block) + 1 sizes (jaxkv.engine.last_chunk_rows). For each chunk
index and last-chunk size that a prompt within the capacity meets, `warm_up` then runs, on zeros, one layer of each
stage (every layer of a stage is the same program) over the chunk's window as the prefill computes it, the token
embedding, the last row's read, the grown window of a whole chunk, and the place into a slot's window of each bucket
that such a prompt can enter (jitted.Fns.place): a prompt of a new length then compiles nothing (chunk indices that
share a window reuse its programs). With the prefix cache on, its block copies and a hit's first chunk (over its
blocks joined exact, padded inside the call) and place still compile with the first prompt of each shape, as does
the prompt logprobs' head.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import decode
from jaxkv import distributed
from jaxkv import engine as engine_lib
from jaxkv import mesh as mesh_lib


def buckets(cache) -> list[tuple[int, int, int]]:
  """(A, first W, last W) of each window bucket of a cache (jaxkv.cache.KVCache): the allocated rows A and the
  smallest and largest window W that a decode pass meets (whole blocks below the capacity) allocated at A, smallest
  first. A = 0: no window yet."""
  out: dict[int, list[int]] = {}
  for w in range(0, (cache.capacity - 1) // cache.block * cache.block + 1, cache.block):
    out.setdefault(cache.window_rows(w, 0), []).append(w)  # A server's cache: every layer's the same.
  return [(a, ws[0], ws[-1]) for a, ws in sorted(out.items())]


def prefill_shapes(capacity: int, block: int, chunk: int) -> list[tuple[int, int, int]]:
  """(W0, C, L) of each last prefill chunk that a prompt of up to `capacity` tokens meets: the rows before it W0 (a
  multiple of the chunk), its rows C (jaxkv.engine.last_chunk_rows) and the shortest prompt that ends there L;
  by W0, then C."""
  out = []
  for w0 in range(0, capacity, chunk):
    shortest = {}
    for left in range(1, min(chunk, capacity - w0) + 1):
      shortest.setdefault(engine_lib.last_chunk_rows(left, block, chunk), w0 + left)
    out += [(w0, c, length) for c, length in shortest.items()]
  return out


def warm_up(engine, batch: int, report: Callable[[str], None] | None = None) -> dict:
  """Runs every window bucket's decode programs of `engine` (jaxkv.engine.Engine) for `batch` slots on a
  generation of zeros, reporting one line per bucket ("warm-up: window 512 rows (3/5), 4.1 s"), then every
  prefill shape's programs (prefill_shapes) on a generation of one sequence placed as the server's scratch
  (jaxkv.serving.slots), one line per chunk index ("warm-up: prefill chunk 2 (3/4), 256 to 1024 rows, 2.0 s").
  Returns {"decode": each bucket's rows and seconds, "prefill": each chunk index's rows before it and seconds}. The
  tokens computed are thrown away; a server's requests run later in generations of their own."""
  out = dict(decode=[], prefill=[])
  gen = engine.start(batch)
  try:
    sizes = buckets(gen.cache)
    for i, (a, first, last) in enumerate(sizes):
      t0 = time.perf_counter()
      _bucket(engine, gen, first, last)
      out["decode"].append(dict(rows=a, seconds=time.perf_counter() - t0))
      if report is not None:
        report(f"warm-up: window {a} rows ({i + 1}/{len(sizes)}), {out['decode'][-1]['seconds']:.1f} s")
    windows, slot_rows = [a for a, _, _ in sizes], functools.partial(gen.cache.window_rows, layer=0)  # A slot's.
  finally:
    gen.close()
  cfg = engine.config
  shapes = prefill_shapes(cfg.engine.capacity, cfg.kv.block, cfg.engine.prefill_chunk)
  chunks = sorted({w0 for w0, _, _ in shapes})
  own = engine.start(1)
  try:
    for i, w0 in enumerate(chunks):
      t0 = time.perf_counter()
      mine = [(c, length) for w, c, length in shapes if w == w0]
      for c, length in mine:
        entered = [a for a in windows if a >= slot_rows(length // cfg.kv.block * cfg.kv.block)]
        _prefill(engine, own.cache, w0, c, length, entered)
      out["prefill"].append(dict(rows=w0, seconds=time.perf_counter() - t0))
      if report is not None:
        report(
            f"warm-up: prefill chunk {i} ({i + 1}/{len(chunks)}), {mine[0][0]} to {mine[-1][0]} rows, "
            f"{out['prefill'][-1]['seconds']:.1f} s"
        )
  finally:
    own.close()
  return out


def _prefill(engine, cache, w0: int, c: int, length: int, windows: list[int]) -> None:
  """The programs of a last prefill chunk of `c` rows after `w0` (the shortest prompt ending there: `length` tokens)
  in `cache` (a scratch generation's): its embedding, one layer of each stage (zeros as the window before it), the
  grown window where it is a whole chunk before others, its last row's read, and its place into a slot's window of
  each of `windows` rows (the server's buckets that such a prompt can enter)."""
  cfg, layout = engine.config, engine.layout
  block, chunk, capacity = cfg.kv.block, cfg.engine.prefill_chunk, cfg.engine.capacity
  a0 = engine_lib.prefill_window_rows(w0, chunk, capacity, block)  # The window's rows, padded at its start.
  tokens = distributed.put_host(np.zeros((1, c), np.int32), mesh_lib.replicated(layout.first))
  x = engine.layer_fns(0).embed(engine.top, tokens)
  xs, metas = engine.to_stages(x), engine.to_stages(engine.meta(np.full(1, a0 - w0, np.int32), w0))
  out = []
  for stage in range(len(layout.meshes)):
    l = layout.stage_of.index(stage)  # Its first layer: every layer of a stage runs the same program.
    fns = engine.layer_fns(l)
    window = _zeros(cache, l, a0) if w0 else None
    x, rows = fns.prefill(engine.params["layers"][l], xs[stage], window, metas[stage], rows=a0)
    out.append(x)
    if c == chunk and w0 + c < capacity:
      out.append(fns.grow(window, rows, to=engine_lib.prefill_window_rows(w0 + c, chunk, capacity, block)))
    w_rows = length // block * block
    for a in windows:
      out.append(fns.place(window, rows, np.int32(a - w_rows - (a0 - w0)), a_rows=a, block=block))
  out.append(engine.fns.last_row(x, engine.put(length - 1 - w0, np.int32)))
  jax.block_until_ready(out)


def _bucket(engine, gen, first: int, last: int) -> None:
  """The programs of one bucket: each slot inserted at window `first` (rows of zeros), a pass there, the pass that
  fills the open pages there, and that of window `last`, which grows into the next bucket."""
  cache, block = gen.cache, gen.cache.block
  cache.clear()
  cache.store_empty_slots(first)
  for l in range(cache.model.num_layers):
    window = None if not first else _zeros(cache, l, cache.window_rows(first, l))
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
