"""The jitted functions of prefill and decode: one set per mesh, KV dtype and attentions; a head per sampling.

Each layer is ONE jitted function, shared by every delivery mode: only where its KV window comes from changes
(jaxkv.transport). Decode runs consecutive layers as one call (a group, jaxkv.residency.decode_groups) in which each
layer is that same computation, fenced off from its neighbours, so the grouping changes the host's dispatches and not
the bits. With host attention a split layer runs as three calls: its query, the device's partial over the tail, and
the merge with the host's partial (jaxkv.host_decode).

The functions read the decode state meta i32[B + 3] = start[B], end, step, seed, by name (jaxkv.meta.Meta).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxkv import cache as cache_lib
from jaxkv import decode_attention
from jaxkv import host_wait
from jaxkv import mesh as mesh_lib
from jaxkv import model
from jaxkv import sampling as sampling_lib
from jaxkv.config import ModelConfig, SamplingConfig
from jaxkv.kv_quant import KVFormat
from jaxkv.meta import Meta


@dataclasses.dataclass(frozen=True)
class Fns:
  """One stage's functions (jaxkv.layout: the mesh of its layers)."""

  prefill: object
  decode_group: object  # (ps, x, windows, opens, meta) -> x, opens.
  decode_group_full: object  # The same when the open pages fill: -> x, grown windows, zero open pages.
  flush: object
  grow: object
  split: object
  head: object
  embed: object
  last_row: object
  query: object
  query_published: object  # With kv.host_attention_wait "device": q reaches the host through jaxkv.host_wait.
  tail_partial: object
  merge: object
  merge_query: object
  merge_query_published: object
  pinned_heads: jax.sharding.Sharding  # q's copy for the host and the host's partial (jaxkv.host_attention.HandBack).
  prefill_attention: str  # The prefill attention that runs: "xla" or "cudnn" (model.prefill_attention_impl).
  decode_attention: str  # The decode attention that runs: "xla", "pallas" or "legacy" (decode_attention.resolve).


def functions(
    cfg: ModelConfig,
    mesh: jax.sharding.Mesh,
    sampling: SamplingConfig,
    kv_dtype: str = "model",
    prefill_attention: str = "auto",
    decode_attention_choice: str = "auto",
) -> Fns:
  """The jitted functions of an engine: the layers' (_layer_functions), shared whatever the sampling, and the head,
  which samples by `sampling` (its eos_id is the host's business: one head serves every eos_id)."""
  head = _head(cfg, mesh, dataclasses.replace(sampling, eos_id=SamplingConfig.eos_id))
  layers = _layer_functions(cfg, mesh, kv_dtype, prefill_attention, decode_attention_choice)
  return dataclasses.replace(layers, head=head)


@functools.lru_cache(maxsize=None)
def _head(cfg: ModelConfig, mesh: jax.sharding.Mesh, sampling: SamplingConfig):
  """(top, x, meta) -> logits, sampled tokens, their embeddings, and the next step's meta (end + 1, step + 1)."""

  def head(top, x, meta):
    lg = model.logits(top, x, cfg)
    key = jax.random.fold_in(jax.random.key(Meta.seed(meta)), Meta.step(meta))
    tok = sampling_lib.sample(lg, key, sampling)
    return lg, tok, model.embed(top, tok), Meta.advance(meta)

  return jax.jit(head, out_shardings=mesh_lib.replicated(mesh))


@functools.lru_cache(maxsize=None)
def _layer_functions(
    cfg: ModelConfig, mesh: jax.sharding.Mesh, kv_dtype: str, prefill_attention: str, decode_attention_choice: str
) -> Fns:
  """The jitted per-layer functions (no head), shared by every engine (delivery mode and sampling) on one mesh, KV
  dtype and attentions (engine.prefill_attention and engine.decode_attention, resolved for the mesh's devices:
  model.prefill_attention_impl, decode_attention.resolve)."""
  rep = mesh_lib.replicated(mesh)
  kv = mesh_lib.sharding(mesh, mesh_lib.CACHE_AXES, "device")
  heads = mesh_lib.sharding(mesh, (mesh_lib.BATCH, mesh_lib.KV_HEADS, None, None))  # q and the partials' o.
  pinned_heads = mesh_lib.sharding(mesh, (mesh_lib.BATCH, mesh_lib.KV_HEADS, None, None), "pinned_host")
  lse_heads = mesh_lib.sharding(mesh, (mesh_lib.BATCH, mesh_lib.KV_HEADS, None))  # The partials' lse.
  fmt = KVFormat.of(cfg, kv_dtype)
  attention_impl = model.prefill_attention_impl(prefill_attention, cfg, fmt, mesh.local_devices[0])
  decode_impl = decode_attention.resolve(decode_attention_choice, cfg, fmt, mesh.local_devices[0])
  attend = dict(attention_impl=decode_impl, mesh=mesh)

  def prefill(p, x, window, meta):
    return model.prefill_layer(p, x, window, Meta.start(meta), cfg=cfg, kv_format=fmt, attention_impl=attention_impl)

  def decode(p, x, window, open_page, meta):
    return model.decode_layer(
        p, x, window, open_page, Meta.start(meta), Meta.end(meta), cfg=cfg, kv_format=fmt, **attend
    )

  def decode_group(ps, x, windows, opens, meta, full=False):
    """Consecutive layers (weights ps, windows [2, B, K, W, E] or None, open pages [2, B, K, P, E]) in one call.
    Each layer is `decode`, its output x behind an optimization barrier, so that no fusion crosses a layer boundary:
    a layer compiles to the same computation in a group of any size, and the bits do not depend on the grouping
    (the windows and open pages are each layer's own arguments and need no barrier).
    full (the open pages fill at this step): also grows each window by its open page and returns x, the grown
    windows and fresh zero open pages; else x and the open pages."""
    out = []
    for p, window, open_page in zip(ps, windows, opens):
      x, open_page = decode(p, x, window, open_page, meta)
      x = jax.lax.optimization_barrier(x)
      out.append(cache_lib.grow(window, open_page) if full else open_page)
    if full:
      return x, out, [jnp.zeros_like(o) for o in opens]
    return x, out

  def tail_partial(q, tail, open_page, meta):
    return model.decode_tail_partial(q, tail, open_page, Meta.start(meta), Meta.end(meta), kv_format=fmt, **attend)

  def query(p, x, open_page, meta, q_slot=None):
    q, open_page = model.decode_query(p, x, open_page, Meta.start(meta), Meta.end(meta), cfg=cfg, kv_format=fmt)
    if q_slot is None:
      return q, q, open_page  # The second lands in pinned host memory when the call ends, for the host's kernel.
    return host_wait.publish(q, q_slot, heads), open_page  # The devices write q to the host themselves.

  def merge(p, x, o, lse, host_part, slot=None):
    # The host's partial f32[B, K, G, Dh + 1] (its o, then its lse) moves here, inside the call, not by a put of its
    # own on the copy stream behind the queued deliveries (docs/design.md): host_part (pinned host memory), or with
    # a slot of the host-wait op, copied on the devices once the host signals it (host_part None; jaxkv.host_wait).
    if slot is None:
      host_part = jax.device_put(host_part, jax.memory.Space.Device)
    else:
      host_part = host_wait.wait(slot, (*o.shape[:-1], o.shape[-1] + 1), heads)
    return model.decode_merge(p, x, o, lse, host_part[..., :-1], host_part[..., -1], cfg=cfg)

  def merge_query(p_prev, x, o, lse, host_part, p, open_page, meta, slot=None, q_slot=None):
    """A split layer's merge, then the next split layer's query: one dispatch where there were two. The barrier
    keeps x as the merge returns it (in the model dtype) for the query, so the bits are those of the two calls."""
    x = jax.lax.optimization_barrier(merge(p_prev, x, o, lse, host_part, slot))
    return (x, *query(p, x, open_page, meta, q_slot))

  def flush(window, open_page):
    return cache_lib.grow(window, open_page), jnp.zeros_like(open_page)

  return Fns(
      prefill=jax.jit(prefill, out_shardings=(rep, kv)),
      decode_group=jax.jit(decode_group, out_shardings=(rep, kv), donate_argnums=(3,)),
      decode_group_full=jax.jit(
          functools.partial(decode_group, full=True), out_shardings=(rep, kv, kv), donate_argnums=(3,)
      ),
      flush=jax.jit(flush, out_shardings=kv, donate_argnums=(1,)),
      grow=jax.jit(cache_lib.grow, out_shardings=kv),
      split=jax.jit(cache_lib.split_prefilled, static_argnames=("w_rows", "block"), out_shardings=kv),
      head=None,  # functions() adds the head of a sampling config.
      embed=jax.jit(model.embed, out_shardings=rep),
      last_row=jax.jit(lambda x, i: jax.lax.dynamic_index_in_dim(x, i, axis=1, keepdims=False), out_shardings=rep),
      query=jax.jit(query, out_shardings=(heads, pinned_heads, kv), donate_argnums=(2,)),
      query_published=jax.jit(
          query,
          out_shardings=(heads, kv),
          donate_argnums=(2,),
          static_argnames=("q_slot",),
      ),
      tail_partial=jax.jit(tail_partial, out_shardings=(heads, lse_heads)),
      merge=jax.jit(merge, out_shardings=rep, static_argnames=("slot",)),
      merge_query=jax.jit(merge_query, out_shardings=(rep, heads, pinned_heads, kv), donate_argnums=(6,)),
      merge_query_published=jax.jit(
          merge_query,
          out_shardings=(rep, heads, kv),
          donate_argnums=(6,),
          static_argnames=("slot", "q_slot"),
      ),
      pinned_heads=pinned_heads,
      prefill_attention=attention_impl,
      decode_attention=decode_impl,
  )
