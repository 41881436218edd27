"""A streamed layer's window delivered in chunks, each attended on arrival: the geometry and the jitted device calls.

A window of W rows larger than a chunk of C rows (`chunk_rows`: kv.delivery_chunk_mib per device, whole leaves and
blocks) reaches the devices as n = ceil(W / C) deliveries, oldest first (`chunks`): chunk k's own rows are
[kC, min((k + 1) C, W)), and its buffer starts a leaf (S = jaxkv.decode_attention.LEAF_ROWS rows) earlier, at
max(kC - S, 0). The layer then runs as calls of its own (`Calls`): its query (which writes the new row into the open
page), the partials of each older chunk's leaves (`chunk_partials`: the leaves whose newest row the chunk owns, each
wholly in its buffer), and the end of the layer (`chunked_out`) with the newest chunk and the open page: their leaves,
every chunk's partials placed at their leaves (jaxkv.decode_attention.placed), one fold, then the rest of the layer.
The leaves and the fold are the unchunked window's, so the bits are too (tests/test_chunked.py checks them against
every placement). With host attention the delivered tail, rows [r1, W), is chunked the same way from r1, and its
last call (`Calls.tail`) returns the device's partial that the host's is merged with (jaxkv.host.decode). The ring
then holds chunks, not windows (jaxkv.transport, jaxkv.residency.ring_bytes). A speculative verify pass of T tokens
(jaxkv.spec_decode) runs the same calls (`calls(..., tokens=T)`), each token with its leaves anchored at its own row
(`token_steps`): a chunk's partials are each token's, and the end folds each token's as its one-token step would.

Where the open page fills (one step in kv.block), the grown window is assembled on the devices from that step's
deliveries: one zero buffer of W + P rows, each chunk written into it in place as it arrives (`Calls.write`, the
buffer donated), then the open page (`Calls.flush`); it is stored, and has landed in pinned host memory, before
another window grows. The window does not cross the link once more, and the devices hold one window beside the
ring for it, not the old and the grown one (jaxkv.residency.workspace_bytes).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jaxkv import cache as cache_lib
from jaxkv import decode_attention as da
from jaxkv import mesh as mesh_lib
from jaxkv import model
from jaxkv.config import ModelConfig
from jaxkv.kv_quant import KVFormat
from jaxkv.meta import Meta


@dataclasses.dataclass(frozen=True)
class Chunk:
  """Delivery `index` of `count` of a layer's window: its buffer holds rows [first_row, first_row + rows)."""

  index: int
  count: int
  first_row: int
  rows: int


def chunk_rows(chunk_mib: float, row_bytes: int, block: int, leaf_rows: int = da.LEAF_ROWS) -> int:
  """C: the rows of chunk_mib MiB (row_bytes: a stored row's bytes per device), in whole units of lcm(S, block)
  rows, at least one unit."""
  unit = math.lcm(leaf_rows, block)
  return max(1, int(chunk_mib * 2**20) // max(row_bytes * unit, 1)) * unit


def chunks(w_rows: int, c_rows: int, leaf_rows: int = da.LEAF_ROWS) -> list[Chunk]:
  """The deliveries of a window of w_rows rows in chunks of c_rows (0: whole), oldest first (module docstring); one
  (the whole window) where it is not larger than a chunk."""
  if not c_rows or w_rows <= c_rows:
    return [Chunk(0, 1, 0, w_rows)]
  n = -(-w_rows // c_rows)
  firsts = [max(k * c_rows - leaf_rows, 0) for k in range(n)]
  return [Chunk(k, n, f, min((k + 1) * c_rows, w_rows) - f) for k, f in enumerate(firsts)]


def slot_bytes(
    window_bytes: int, c_rows: int, row_bytes: int, head_row_bytes: int, leaf_rows: int = da.LEAF_ROWS
) -> int:
  """A ring slot's bytes per device for a layer's window of window_bytes (row_bytes a row, head_row_bytes one head's
  row): where the window is chunked, the largest chunk's buffer, C + S rows, twice where it is delivered as runs
  (the runs and their stacked copy, both on the devices until the stacking call runs: jaxkv.cache.put_rows),
  else the window."""
  if not c_rows or window_bytes <= c_rows * row_bytes:
    return window_bytes
  copies = 2 if cache_lib.delivers_runs(c_rows + leaf_rows, head_row_bytes) else 1
  return copies * (c_rows + leaf_rows) * row_bytes


def chunk_partials(
    q, chunk, first_row, start, end, *, num_leaves: int, kv_format: KVFormat, impl: str, mesh=None, interpret=False
):
  """The partials of the num_leaves leaves whose newest row lies in the chunk's own rows, the last num_leaves * S
  of its buffer. q f32[B, K, G, Dh] (model.decode_query); chunk [2, B, K, R, E] rows [first_row, first_row + R)
  (first_row i32[]) as jaxkv.decode_attention.attention_rows(impl, kv_format, ...) gives them (int8 packed for the
  kernel, else values); start i32[B]; end i32[] past the chunk; impl, mesh, interpret: as
  jaxkv.decode_attention.leaf_partials'. Returns jaxkv.decode_attention.Partials [n, ...]."""
  first_leaf = (end - first_row - chunk.shape[3]) // da.LEAF_ROWS + 1
  qg = q.astype(kv_format.values_dtype)
  kw = dict(first_leaf=first_leaf, impl=impl, mesh=mesh, interpret=interpret, kv_format=kv_format)
  return da.leaf_partials(qg, (chunk,), first_row, start, end, num_leaves, **kw)


def chunked_attention(
    q,
    last,
    open_page,
    older,
    start,
    end,
    origin=0,
    *,
    c_rows: int,
    impl: str,
    mesh=None,
    interpret=False,
    kv_format: KVFormat | None = None,
):
  """Attention over a chunked window (or a host-attention tail) and the open page: the leaves of the newest chunk and
  the open page, the older chunks' partials placed at their leaves, one fold. q [B, K, G, Dh] in the values' dtype;
  the chunked rows are [origin, W) (origin i32[]: 0, or a tail's first row r1), T = W - origin; last [2, B, K, R,
  E], the newest chunk's buffer, rows [W - R, W), and open_page [2, B, K, P, E] rows [W, W + P), both as
  jaxkv.decode_attention.attention_rows(impl, kv_format, ...) gives them (kv_format None: values); older:
  chunk_partials of chunks 0 .. n - 2, C = c_rows rows each; start i32[B]; end i32[]. Returns o f32[B, K, G, Dh]
  and lse f32[B, K, G], those of jaxkv.decode_attention.attend over the rows [origin, W) and the open page (rows
  before origin masked)."""
  t_rows = len(older) * c_rows + last.shape[3] - da.LEAF_ROWS
  newest_leaves = da.leaf_count(last.shape[3] + open_page.shape[3])
  first_row = jnp.asarray(origin, jnp.int32) + t_rows - last.shape[3]
  kw = dict(impl=impl, mesh=mesh, interpret=interpret, kv_format=kv_format)
  newest = da.leaf_partials(q, (last, open_page), first_row, start, end, newest_leaves, **kw)
  # Chunk i's first leaf is the one whose newest row is its last, origin + (i + 1) C - 1; later pieces overwrite
  # earlier ones.
  first_leaf = lambda i: (end - origin - (i + 1) * c_rows) // da.LEAF_ROWS + 1
  pieces = [(newest, 0)] + [(older[i], first_leaf(i)) for i in reversed(range(len(older)))]
  return da.normalized(da.fold(da.placed(da.leaf_count(t_rows + open_page.shape[3]), pieces)))


def token_steps(q, end, g: int, page: int) -> list[tuple]:
  """Each token's query [B, K, G, Dh] and row i32[] in a pass's q [B, K, T * G, Dh] (model.decode_query; g = G) from
  row end (page: the open page's rows): q and end for one token; a verify pass's model.token_queries, each with its
  model.token_row, the row its leaves are anchored at."""
  qs = model.token_queries(q, g)
  return [(q, end)] if len(qs) == 1 else [(qi, model.token_row(end, i, page)) for i, qi in enumerate(qs)]


def chunked_out(p, x, q, last, open_page, older, start, end, *, c_rows: int, cfg: ModelConfig, kv_format, impl, mesh):
  """The end of a chunked layer: chunked_attention, then the rest of the layer (as model.decode_layer's). x [B, D],
  the layer's input; q f32[B, K, G, Dh]; last, open_page stored [2, B, K, R, E] (chunked_attention's, in
  kv_format), the new row written: passed on as attention_rows gives them, unpacked once. Returns x [B, D]. A
  verify pass (model.decode_layer's T tokens): x [B, T, D], q f32[B, K, T * G, Dh], older[c] a tuple of each
  token's partials of chunk c; token i attends as a one-token step at its row (token_steps), and the rest of the
  layer runs over the B * T rows."""
  last_kv, page_kv = da.attention_rows(impl, kv_format, (last, open_page))
  b, t = x.shape[0], 1 if x.ndim == 2 else x.shape[1]
  k, dh = q.shape[1], q.shape[3]
  kw = dict(c_rows=c_rows, impl=impl, mesh=mesh, kv_format=kv_format)
  outs = []
  for i, (qi, row) in enumerate(token_steps(q, end, cfg.num_heads // cfg.num_kv_heads, open_page.shape[3])):
    qg = jax.lax.optimization_barrier(qi.astype(kv_format.values_dtype))
    token_older = older if t == 1 else tuple(c[i] for c in older)
    o, _ = chunked_attention(qg, last_kv, page_kv, token_older, start, row, **kw)
    outs.append(jax.lax.optimization_barrier(o))
  o = outs[0] if t == 1 else jnp.stack(outs, axis=1)  # [B, K, G, Dh] or [B, T, K, G, Dh]
  o = o.reshape(b * t, 1, cfg.num_heads, dh).astype(x.dtype)
  return model.attn_out_and_mlp(p, x.reshape(b * t, 1, -1), o, cfg, batch=b).reshape(x.shape)


@dataclasses.dataclass(frozen=True)
class Calls:
  """One stage's calls of a chunked layer (B = batch, K = kv heads, G = query heads per kv head, Dh = head_dim)."""

  query: object  # (p, x, open_page, meta) -> q f32[B, K, G, Dh] ([B, K, T * G, Dh]), open_page with the new rows.
  partials: object  # (q, chunk, first_row, meta, num_leaves=, page=) -> Partials of the chunk's leaves (per token).
  out: object  # (p, x, q, last, open_page, older, meta, c_rows=) -> x.
  tail: object  # (q, last, open_page, older, origin, meta, c_rows=) -> o f32[B, K, G, Dh], lse f32[B, K, G]
  #   (per token: [B, K, T * G, ...]).
  write: object  # (grown, chunk, first_row) -> grown [2, B, K, W + P, E] with the chunk's rows at first_row, in place.
  flush: object  # (grown, open_page, rows) -> grown with the open page at row `rows` (W), in place; a zero page.


@functools.lru_cache(maxsize=None)
def calls(
    cfg: ModelConfig, mesh: jax.sharding.Mesh, kv_dtype: str, decode_attention_choice: str, tokens: int = 1
) -> Calls:
  """The chunked layer's jitted calls on one mesh and KV dtype, attending with engine.decode_attention
  (jaxkv.decode_attention.resolve), for passes of `tokens` tokens per sequence (T > 1: a verify pass,
  jaxkv.spec_decode; `partials` then returns a tuple of each token's, its leaves anchored at its row)."""
  rep = mesh_lib.replicated(mesh)
  kv = mesh_lib.sharding(mesh, mesh_lib.CACHE_AXES, "device")
  heads = mesh_lib.sharding(mesh, (mesh_lib.BATCH, mesh_lib.KV_HEADS, None, None))
  lse_heads = mesh_lib.sharding(mesh, (mesh_lib.BATCH, mesh_lib.KV_HEADS, None))
  stats = mesh_lib.sharding(mesh, (None, mesh_lib.BATCH, mesh_lib.KV_HEADS, None))
  leaves = da.Partials(stats, stats, mesh_lib.sharding(mesh, (None, mesh_lib.BATCH, mesh_lib.KV_HEADS, None, None)))
  fmt = KVFormat.of(cfg, kv_dtype)
  g = cfg.num_heads // cfg.num_kv_heads
  impl = da.resolve(decode_attention_choice, cfg, fmt, mesh.local_devices[0])
  if impl == "legacy":
    raise ValueError("a window delivered in chunks needs engine.decode_attention xla, pallas or auto, not legacy")

  def query(p, x, open_page, meta):
    return model.decode_query(p, x, open_page, Meta.start(meta), Meta.end(meta), cfg=cfg, kv_format=fmt)

  def partials(q, chunk, first_row, meta, num_leaves, page):
    kw = dict(num_leaves=num_leaves, kv_format=fmt, impl=impl, mesh=mesh)
    (rows,) = da.attention_rows(impl, fmt, (chunk,))  # Once for every token.
    steps = [
        chunk_partials(qi, rows, first_row, Meta.start(meta), row, **kw)
        for qi, row in token_steps(q, Meta.end(meta), g, page)
    ]
    return steps[0] if tokens == 1 else tuple(steps)

  def out(p, x, q, last, open_page, older, meta, c_rows):
    kw = dict(c_rows=c_rows, cfg=cfg, kv_format=fmt, impl=impl, mesh=mesh)
    return chunked_out(p, x, q, last, open_page, older, Meta.start(meta), Meta.end(meta), **kw)

  def tail(q, last, open_page, older, origin, meta, c_rows):
    """A host-attention layer's device partial over its chunked tail (rows [origin, W)) and the open page: that of
    jaxkv.host.calls' tail_partial (a verify pass: each token's, concatenated as q's query heads)."""
    last_kv, page_kv = da.attention_rows(impl, fmt, (last, open_page))
    kw = dict(c_rows=c_rows, impl=impl, mesh=mesh, kv_format=fmt)
    steps = token_steps(q, Meta.end(meta), g, open_page.shape[3])
    parts = [
        chunked_attention(
            qi.astype(fmt.values_dtype),
            last_kv,
            page_kv,
            older if tokens == 1 else tuple(c[i] for c in older),
            Meta.start(meta),
            row,
            origin,
            **kw,
        )
        for i, (qi, row) in enumerate(steps)
    ]
    return parts[0] if tokens == 1 else tuple(jnp.concatenate(a, axis=2) for a in zip(*parts))

  def write(grown, chunk, first_row):
    return jax.lax.dynamic_update_slice_in_dim(grown, chunk, first_row, axis=3)

  def flush(grown, open_page, rows):
    return write(grown, open_page, rows), jnp.zeros_like(open_page)

  return Calls(
      query=jax.jit(query, out_shardings=(heads, kv), donate_argnums=(2,)),
      partials=jax.jit(
          partials, out_shardings=leaves if tokens == 1 else (leaves,) * tokens, static_argnames=("num_leaves", "page")
      ),
      out=jax.jit(out, out_shardings=rep, static_argnames="c_rows"),
      tail=jax.jit(tail, out_shardings=(heads, lse_heads), static_argnames="c_rows"),
      write=jax.jit(write, out_shardings=kv, donate_argnums=(0,)),
      flush=jax.jit(flush, out_shardings=kv, donate_argnums=(0, 1)),
  )
