"""The jitted functions of prefill and decode: one set per mesh, KV dtype and attentions.

Each layer is ONE jitted function, shared by every delivery mode: only where its KV window comes from changes
(jaxkv.transport). Decode runs consecutive layers as one call (a group, jaxkv.residency.decode_groups) in which each
layer is that same computation, fenced off from its neighbours, so the grouping changes the host's dispatches and not
the bits. A split layer of host attention runs as calls of its own (jaxkv.host.calls). One head serves every run:
it samples each row with that row's settings (jaxkv.sampling).

The layers read the decode state meta i32[B + 1] = start[B], end by name (jaxkv.meta.Meta); the head reads and
writes a jaxkv.meta.DecodeState.
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
from jaxkv import sampling
from jaxkv.config import ModelConfig
from jaxkv.kv_quant import KVFormat
from jaxkv.meta import DecodeState, HeadOut, Meta


@dataclasses.dataclass(frozen=True)
class Fns:
  """One stage's functions (jaxkv.layout: the mesh of its layers)."""

  prefill: object  # (p, x, window, meta, rows=None) -> x, the chunk's rows (the window padded to rows, static).
  decode_group: object  # (ps, x, windows, opens, meta) -> x, opens.
  decode_group_full: object  # The same when the open pages fill (static grow_to): -> x, grown windows, zero pages.
  grow: object  # (window, rows, to=None) -> the window grown by rows (jaxkv.cache.grow; static `to`).
  tail: object  # (window, rows=R) -> its last R rows (a prefill window without its padding).
  join: object  # Blocks of rows on the devices, concatenated (a prompt's rows from the prefix cache).
  place: object  # A prompt's rows prefilled from row 0 moved to a slot's window and open page.
  block: object  # A block of rows, to pinned host memory (the prefix cache's).
  head: object  # (top, DecodeState) -> HeadOut, the next step's DecodeState.
  verify: object  # (top, x [B, T, D], drafts, lengths, params, index) -> logits, tokens, accepted (verify_head).
  enter: object  # (state, b, row) -> state with row b replaced (DecodeState.with_row).
  allow: object  # (state, b, allowed bool[V]) -> state with row b's allowed tokens replaced (DecodeState.allow).
  embed: object
  logits: object  # (top, x [..., D]) -> f32 logits [..., V]: a prefill's rows through the head (prompt logprobs).
  last_row: object
  prefill_attention: str  # The prefill attention that runs: "xla" or "cudnn" (model.prefill_attention_impl).
  decode_attention: str  # The decode attention that runs: "xla", "pallas" or "legacy" (decode_attention.resolve).


@functools.lru_cache(maxsize=None)
def functions(
    cfg: ModelConfig,
    mesh: jax.sharding.Mesh,
    kv_dtype: str = "model",
    prefill_attention: str = "auto",
    decode_attention_choice: str = "auto",
) -> Fns:
  """The jitted functions of every engine on one mesh, KV dtype and attentions (engine.prefill_attention and
  engine.decode_attention, resolved for the mesh's devices: model.prefill_attention_impl, decode_attention.resolve),
  whatever its delivery mode and sampling."""
  rep = mesh_lib.replicated(mesh)
  kv = mesh_lib.sharding(mesh, mesh_lib.CACHE_AXES, "device")
  kv_host = mesh_lib.sharding(mesh, mesh_lib.CACHE_AXES, "pinned_host")
  fmt = KVFormat.of(cfg, kv_dtype)
  attention_impl = model.prefill_attention_impl(prefill_attention, cfg, fmt, mesh.local_devices[0])
  decode_impl = decode_attention.resolve(decode_attention_choice, cfg, fmt, mesh.local_devices[0])

  def prefill(p, x, window, meta, rows=None):
    """model.prefill_layer over `window` padded at its start to `rows` rows (jaxkv.engine.prefill_window_rows;
    static; None: as it is)."""
    if window is not None and rows is not None:
      window = cache_lib.pad_front(window, rows)
    return model.prefill_layer(p, x, window, Meta.start(meta), cfg=cfg, kv_format=fmt, attention_impl=attention_impl)

  def decode(p, x, window, open_page, meta):
    return model.decode_layer(
        p,
        x,
        window,
        open_page,
        Meta.start(meta),
        Meta.end(meta),
        cfg=cfg,
        kv_format=fmt,
        attention_impl=decode_impl,
        mesh=mesh,
    )

  def decode_group(ps, x, windows, opens, meta, full=False, grow_to=None):
    """Consecutive layers (weights ps, windows [2, B, K, A, E] or None, open pages [2, B, K, P, E]) in one call.
    Each layer is `decode`, its output x behind an optimization barrier, so that no fusion crosses a layer boundary:
    a layer compiles to the same computation in a group of any size, and the bits do not depend on the grouping
    (the windows and open pages are each layer's own arguments and need no barrier).
    full (the open pages fill at this step): also grows each window by its open page to grow_to rows (its
    allocation for W + P rows: jaxkv.cache.grow) and returns x, the grown windows and fresh zero open pages; else x
    and the open pages."""
    out = []
    for p, window, open_page in zip(ps, windows, opens):
      x, open_page = decode(p, x, window, open_page, meta)
      x = jax.lax.optimization_barrier(x)
      out.append(cache_lib.grow(window, open_page, grow_to) if full else open_page)
    if full:
      return x, out, [jnp.zeros_like(o) for o in opens]
    return x, out

  def head(top, state: DecodeState) -> tuple[HeadOut, DecodeState]:
    """Logits of state.x [B, D], shaped and sampled with each row's settings and token index (HeadOut keeps the
    model's own), and the next step's state: the tokens' embeddings, meta's end + 1, each row's index + 1, the
    tokens counted."""
    s = state.sampling
    logits = model.logits(top, state.x, cfg)
    shaped = sampling.shape(logits, s, state.counts, state.prompt, state.index, state.allowed)
    tokens = sampling.sample(shaped, s, state.index)
    counts = sampling.count(state.counts, tokens)
    nxt = DecodeState(
        model.embed(top, tokens), Meta.advance(state.meta), state.index + 1, s, counts, state.prompt, state.allowed
    )
    return HeadOut(logits, tokens), nxt

  def joined(window, chunk):
    """A prefill's rows [0, R) from its two parts (jaxkv.engine.PrefilledLayer: window or None, last chunk)."""
    return chunk if window is None else jnp.concatenate([window, chunk], axis=3)

  def place(window, chunk, at, a_rows, block):
    """A prompt prefilled at rows [0, L): its rows [0, R), R >= L, in the prefill's two parts (window [2, 1, K, W0,
    E] or None, chunk [2, 1, K, R - W0, E]: jaxkv.engine.PrefilledLayer) -> a slot's window [2, 1, K, a_rows, E] and
    open page [2, 1, K, block, E] (laid out as jaxkv.cache's: the window's a_rows rows, then the page's) with the
    prompt's rows at their positions [at, at + L) (i32[], 0 <= at < a_rows + block: the prompt ends in the page at
    the latest; traced, so the program depends on W0, R and a_rows, not on the prompt's length or where the slot's
    rows end). Rows before `at` are zeros; rows after the prompt's are the last chunk's padding, then zeros, and
    decode masks them until it writes them. Two slices of the rows padded with zeros on both sides (XLA:CPU
    writes the padded rows whole: a_rows + R + 2 block rows of workspace)."""
    pad = ((0, 0),) * 3 + ((a_rows + block, block), (0, 0))  # Row i of the prompt at a_rows + block + i.
    padded = jnp.pad(joined(window, chunk), pad)
    first = a_rows + block - at
    return (
        jax.lax.dynamic_slice_in_dim(padded, first, a_rows, axis=3),
        jax.lax.dynamic_slice_in_dim(padded, first + a_rows, block, axis=3),
    )

  def block(window, chunk, first, size):
    """A prefill's rows (window, chunk: its two parts, as place's) on the devices -> rows [first, first + size), in
    pinned host memory."""
    return jax.device_put(
        jax.lax.dynamic_slice_in_dim(joined(window, chunk), first, size, axis=3), jax.memory.Space.Host
    )

  return Fns(
      prefill=jax.jit(prefill, static_argnames="rows", out_shardings=(rep, kv)),
      decode_group=jax.jit(decode_group, out_shardings=(rep, kv), donate_argnums=(3,)),
      decode_group_full=jax.jit(
          functools.partial(decode_group, full=True),
          static_argnames="grow_to",
          out_shardings=(rep, kv, kv),
          donate_argnums=(3,),
      ),
      grow=jax.jit(cache_lib.grow, static_argnames="to", out_shardings=kv),
      tail=jax.jit(
          lambda window, rows: window[:, :, :, window.shape[3] - rows :], static_argnames="rows", out_shardings=kv
      ),
      join=jax.jit(lambda blocks: jnp.concatenate(blocks, axis=3), out_shardings=kv),
      place=jax.jit(place, static_argnames=("a_rows", "block"), out_shardings=kv),
      block=jax.jit(block, static_argnames="size", out_shardings=kv_host),
      head=jax.jit(head, out_shardings=rep),
      verify=jax.jit(functools.partial(verify_head, cfg=cfg), out_shardings=rep),
      enter=jax.jit(DecodeState.with_row, out_shardings=rep, donate_argnums=(0,)),
      allow=jax.jit(DecodeState.allow, out_shardings=rep, donate_argnums=(0,)),
      embed=jax.jit(model.embed, out_shardings=rep),
      logits=jax.jit(functools.partial(model.logits, cfg=cfg), out_shardings=rep),
      last_row=jax.jit(lambda x, i: jax.lax.dynamic_index_in_dim(x, i, axis=1, keepdims=False), out_shardings=rep),
      prefill_attention=attention_impl,
      decode_attention=decode_impl,
  )


def verify_head(top, x, drafts, lengths, params: sampling.SamplingParams, index, *, cfg: ModelConfig):
  """The head of a speculative verify pass (jaxkv.spec_decode): x [B, T, D], the pass's output at rows
  end .. end + T - 1 (or [B, D], T = 1); drafts i32[B, T - 1], row b's proposed tokens for positions 0 .., lengths[b]
  of them real; params, each row's settings (no penalties: config.check_speculate); index i32[B], the token index of
  each row's position 0. Returns logits f32[B, T, V] (the model's), tokens i32[B, T] and accepted i32[B]: row b's
  tokens[:accepted + 1] follow its row end (jaxkv.sampling.verify_row; greedy rows: each position's largest logit, as
  jaxkv.sampling.sample takes it, and the longest prefix of the draft equal to them)."""
  if x.ndim == 2:  # A one-token pass: x [B, D].
    x = x[:, None]
  logits = model.logits(top, x, cfg, batch=x.shape[0])

  def greedy(lg):
    tokens = jnp.argmax(lg, axis=-1).astype(jnp.int32)
    agree = (drafts == tokens[:, :-1]) & (jnp.arange(drafts.shape[1])[None, :] < lengths[:, None])
    return tokens, jnp.sum(jnp.cumprod(agree.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)

  def drawn(lg):
    p = params
    return jax.vmap(sampling.verify_row)(
        lg, drafts, lengths, p.temperature, p.top_k, p.top_p, p.min_p, p.seed, p.stream, index
    )

  tokens, accepted = jax.lax.cond(jnp.all(params.temperature == 0.0), greedy, drawn, logits)
  return logits, tokens, accepted
