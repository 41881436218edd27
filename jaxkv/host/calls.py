"""The jitted device calls of a split layer (host attention): one set per mesh and KV dtype.

A split layer runs as its query on the devices (which also writes the layer's new row into its open page), the
device's partial over the tail and the open page, and the merge with the host's partial (jaxkv.host.decode). The
merge of one split layer rides on the next one's query (`merge_query`): one dispatch where there were two. With
kv.host_attention_wait "device" q reaches the host, and the host's partial the devices, through jaxkv.host.wait.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxkv import cache as cache_lib
from jaxkv import decode_attention
from jaxkv import mesh as mesh_lib
from jaxkv import model
from jaxkv.config import ModelConfig
from jaxkv.host import wait as wait_lib
from jaxkv.kv_quant import KVFormat
from jaxkv.meta import Meta


@dataclasses.dataclass(frozen=True)
class Calls:
  """One stage's split-layer calls (B = batch, K = kv heads, G = query heads per kv head, Dh = head_dim)."""

  query: object  # (p, x, open_page, meta) -> q f32[B, K, G, Dh], q in pinned host memory, open_page. A verify pass
  #   (x [B, T, D]): q f32[B, K, T * G, Dh] (model.decode_query), the partials likewise: the host's kernel attends
  #   the T tokens as T * G query heads per kv head (every token reads all of the head's rows).
  query_published: object  # (p, x, open_page, meta, q_slot=) -> q, open_page: q reaches the host through q_slot.
  tail_partial: object  # (q, tail, open_page, meta) -> o f32[B, K, G, Dh], lse f32[B, K, G].
  merge: object  # (p, x, o, lse, host_part, slot=) -> x.
  merge_query: object  # merge, then the next split layer's query.
  merge_query_published: object
  flush: object  # (window, open_page) -> the grown window, a zero open page.
  pinned_heads: jax.sharding.Sharding  # q's copy for the host and the host's partial (jaxkv.host.attention.HandBack).


@functools.lru_cache(maxsize=None)
def calls(cfg: ModelConfig, mesh: jax.sharding.Mesh, kv_dtype: str, decode_attention_choice: str) -> Calls:
  """The host-attention path's jitted calls on one mesh and KV dtype; the device's tail partial attends with
  engine.decode_attention (jaxkv.decode_attention.resolve)."""
  rep = mesh_lib.replicated(mesh)
  kv = mesh_lib.sharding(mesh, mesh_lib.CACHE_AXES, "device")
  heads = mesh_lib.sharding(mesh, (mesh_lib.BATCH, mesh_lib.KV_HEADS, None, None))  # q and the partials' o.
  pinned_heads = mesh_lib.sharding(mesh, (mesh_lib.BATCH, mesh_lib.KV_HEADS, None, None), "pinned_host")
  lse_heads = mesh_lib.sharding(mesh, (mesh_lib.BATCH, mesh_lib.KV_HEADS, None))  # The partials' lse.
  fmt = KVFormat.of(cfg, kv_dtype)
  decode_impl = decode_attention.resolve(decode_attention_choice, cfg, fmt, mesh.local_devices[0])

  def tail_partial(q, tail, open_page, meta):
    """A verify pass (q f32[B, K, T * G, Dh], model.decode_query): each token's partial, its leaves anchored at its
    row (model.token_row), concatenated as q's query heads."""
    kw = dict(kv_format=fmt, attention_impl=decode_impl, mesh=mesh)
    qs = model.token_queries(q, cfg.num_heads // cfg.num_kv_heads)
    if len(qs) == 1:
      return model.decode_tail_partial(q, tail, open_page, Meta.start(meta), Meta.end(meta), **kw)
    rows = [model.token_row(Meta.end(meta), i, open_page.shape[3]) for i in range(len(qs))]
    parts = [model.decode_tail_partial(qi, tail, open_page, Meta.start(meta), r, **kw) for qi, r in zip(qs, rows)]
    return tuple(jnp.concatenate(a, axis=2) for a in zip(*parts))

  def query(p, x, open_page, meta, q_slot=None):
    q, open_page = model.decode_query(p, x, open_page, Meta.start(meta), Meta.end(meta), cfg=cfg, kv_format=fmt)
    if q_slot is None:
      return q, q, open_page  # The second lands in pinned host memory when the call ends, for the host's kernel.
    return wait_lib.publish(q, q_slot, heads), open_page  # The devices write q to the host themselves.

  def merge(p, x, o, lse, host_part, slot=None):
    # The host's partial f32[B, K, G, Dh + 1] (its o, then its lse) moves here, inside the call, not by a put of its
    # own on the copy stream behind the queued deliveries (docs/design.md): host_part (pinned host memory), or with
    # a slot of the host-wait op, copied on the devices once the host signals it (host_part None; jaxkv.host.wait).
    if slot is None:
      host_part = jax.device_put(host_part, jax.memory.Space.Device)
    else:
      host_part = wait_lib.wait(slot, (*o.shape[:-1], o.shape[-1] + 1), heads)
    return model.decode_merge(p, x, o, lse, host_part[..., :-1], host_part[..., -1], cfg=cfg)

  def merge_query(p_prev, x, o, lse, host_part, p, open_page, meta, slot=None, q_slot=None):
    """A split layer's merge, then the next split layer's query: one dispatch where there were two. The barrier
    keeps x as the merge returns it (in the model dtype) for the query, so the bits are those of the two calls."""
    x = jax.lax.optimization_barrier(merge(p_prev, x, o, lse, host_part, slot))
    return (x, *query(p, x, open_page, meta, q_slot))

  def flush(window, open_page):
    return cache_lib.grow(window, open_page), jnp.zeros_like(open_page)

  return Calls(
      query=jax.jit(query, out_shardings=(heads, pinned_heads, kv), donate_argnums=(2,)),
      query_published=jax.jit(query, out_shardings=(heads, kv), donate_argnums=(2,), static_argnames=("q_slot",)),
      tail_partial=jax.jit(tail_partial, out_shardings=(heads, lse_heads)),
      merge=jax.jit(merge, out_shardings=rep, static_argnames=("slot",)),
      merge_query=jax.jit(merge_query, out_shardings=(rep, heads, pinned_heads, kv), donate_argnums=(6,)),
      merge_query_published=jax.jit(
          merge_query,
          out_shardings=(rep, heads, kv),
          donate_argnums=(6,),
          static_argnames=("slot", "q_slot"),
      ),
      flush=jax.jit(flush, out_shardings=kv, donate_argnums=(1,)),
      pinned_heads=pinned_heads,
  )
