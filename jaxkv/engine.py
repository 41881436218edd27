"""Batched prefill and decode, driven layer by layer from Python.

Prompts are right-aligned in the cache (left padding), so every sequence writes its next row at the same
row `end` and one `dynamic_update_slice` serves the whole batch. Prefill runs in chunks of
`engine.prefill_chunk` rows; decode produces one token per sequence per step. Each layer is ONE jitted
function, shared by every delivery mode: only where its KV window comes from changes (jaxkv.transport). Decode
runs consecutive layers as one call (a group, jaxkv.residency.decode_groups) in which each layer is that same
computation, fenced off from its neighbours, so the grouping changes the host's dispatches and not the bits.

Per-pass metadata meta i32[B + 3] = start[B], end, step, seed: one explicit host->device transfer per prefill
chunk; during decode the head computes the next step's meta on the device.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numba
import numpy as np
from absl import logging

from jaxkv import cache as cache_lib
from jaxkv import digest
from jaxkv import distributed
from jaxkv import host_attention
from jaxkv import host_wait
from jaxkv import layout as layout_lib
from jaxkv import mesh as mesh_lib
from jaxkv import model
from jaxkv import residency
from jaxkv import sampling as sampling_lib
from jaxkv.config import Config, ModelConfig, SamplingConfig
from jaxkv.kv_quant import KVFormat
from jaxkv.transport import Transport

HOST_THREAD_PARTS = ("query", "tail", "wait_host", "merge", "wait_query", "kernel")  # host_thread_ms.
READ_LAG = 2  # Decode steps between dispatching a step and reading its tokens back.


@dataclasses.dataclass
class GenerateResult:
  """tokens: generated ids per sequence (up to and including its EOS).
  tokens_sha256: sha256 of json.dumps(tokens).
  logits_sha256: sha256 over the f32 little-endian bits of every step's logits, in the order
    [step][sequence][vocab]; step 0 is the prompt's last row, every sequence of the batch every step.
  logits: f32[steps, B, V] when asked for (keep_logits=True), else None.
  transport: telemetry (jaxkv.transport.Transport.summary plus counters).
  timing: prefill_s (until the first token is on the host), decode_s (from then to the last token),
    decode_steps (steps whose tokens were kept; a step dispatched after every sequence ended is not counted).
  """

  tokens: list[list[int]]
  tokens_sha256: str
  logits_sha256: str
  logits: np.ndarray | None
  transport: dict
  timing: dict


@dataclasses.dataclass(frozen=True)
class _Fns:
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
  pinned_heads: jax.sharding.Sharding  # q's copy for the host and the host's partial (host_attention.HandBack).
  prefill_attention: str  # The prefill attention that runs: "xla" or "cudnn" (model.prefill_attention_impl).


class _HeldMerge(NamedTuple):
  """A split layer's merge, not dispatched yet: merge(p, x, o, lse, host_part, slot=slot) on the stage of `fns`, with
  host_part, slot = _hand_back_args(hand_back)."""

  fns: _Fns
  p: dict
  o: jax.Array  # f32[B, K, G, Dh], the device's partial.
  lse: jax.Array  # f32[B, K, G].
  hand_back: host_attention.HandBack


def _hand_back_args(hand_back: host_attention.HandBack) -> tuple[jax.Array | None, int | None]:
  """The merge's host_part and slot: the pinned array itself, or the slot the devices wait on (jaxkv.host_wait)."""
  if not hand_back.device_wait:
    return hand_back.array, None
  return None, hand_back.array_slot.id


def _poll(ready: Callable[[], bool], threads: int) -> None:
  """Polls ready() until it holds, releasing the GIL between polls, where a core is spare beside the kernel's
  `threads`, the dispatching thread and the feeder (cores: numba's count of the CPUs this process may run on);
  elsewhere returns at once (the caller then blocks: a poller without a core of its own slows the kernel down). The
  two waits on the path from one host-attention kernel to the next use it: a blocked thread's core idles and is slow
  to wake; on the H200 host decode steps at 32k, batch 1 ran 0-9% faster polled (medians, two machine starts;
  docs/design.md)."""
  if threads + 2 <= numba.config.NUMBA_DEFAULT_NUM_THREADS:
    while not ready():
      time.sleep(0)


@functools.lru_cache(maxsize=None)
def _functions(
    cfg: ModelConfig,
    mesh: jax.sharding.Mesh,
    sampling: SamplingConfig,
    kv_dtype: str = "model",
    prefill_attention: str = "auto",
) -> _Fns:
  """The jitted functions of an engine: the layers' (_layer_functions), shared whatever the sampling, and the head,
  which samples by `sampling` (its eos_id is the host's business: one head serves every eos_id)."""
  head = _head(cfg, mesh, dataclasses.replace(sampling, eos_id=SamplingConfig.eos_id))
  return dataclasses.replace(_layer_functions(cfg, mesh, kv_dtype, prefill_attention), head=head)


@functools.lru_cache(maxsize=None)
def _head(cfg: ModelConfig, mesh: jax.sharding.Mesh, sampling: SamplingConfig):
  """(top, x, meta) -> logits, sampled tokens, their embeddings, and the next step's meta (end + 1, step + 1)."""

  def head(top, x, meta):
    lg = model.logits(top, x, cfg)
    key = jax.random.fold_in(jax.random.key(meta[-1]), meta[-2])
    tok = sampling_lib.sample(lg, key, sampling)
    step = jnp.zeros_like(meta).at[-3:-1].set(1)
    return lg, tok, model.embed(top, tok), meta + step

  return jax.jit(head, out_shardings=mesh_lib.replicated(mesh))


@functools.lru_cache(maxsize=None)
def _layer_functions(cfg: ModelConfig, mesh: jax.sharding.Mesh, kv_dtype: str, prefill_attention: str) -> _Fns:
  """The jitted per-layer functions (no head), shared by every engine (delivery mode and sampling) on one mesh, KV
  dtype and prefill attention (engine.prefill_attention, resolved for the mesh's devices:
  model.prefill_attention_impl)."""
  rep = mesh_lib.replicated(mesh)
  kv = mesh_lib.sharding(mesh, mesh_lib.CACHE_AXES, "device")
  heads = mesh_lib.sharding(mesh, (mesh_lib.BATCH, mesh_lib.KV_HEADS, None, None))  # q and the partials' o.
  pinned_heads = mesh_lib.sharding(mesh, (mesh_lib.BATCH, mesh_lib.KV_HEADS, None, None), "pinned_host")
  lse_heads = mesh_lib.sharding(mesh, (mesh_lib.BATCH, mesh_lib.KV_HEADS, None))  # The partials' lse.
  fmt = KVFormat.of(cfg, kv_dtype)
  attention_impl = model.prefill_attention_impl(prefill_attention, cfg, fmt, mesh.local_devices[0])

  def prefill(p, x, window, meta):
    return model.prefill_layer(p, x, window, meta[:-3], cfg=cfg, kv_format=fmt, attention_impl=attention_impl)

  def decode(p, x, window, open_page, meta):
    return model.decode_layer(p, x, window, open_page, meta[:-3], meta[-3], cfg=cfg, kv_format=fmt)

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
    return model.decode_tail_partial(q, tail, open_page, meta[:-3], meta[-3], kv_format=fmt)

  def query(p, x, open_page, meta, q_slot=None):
    q, open_page = model.decode_query(p, x, open_page, meta[:-3], meta[-3], cfg=cfg, kv_format=fmt)
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

  return _Fns(
      prefill=jax.jit(prefill, out_shardings=(rep, kv)),
      decode_group=jax.jit(decode_group, out_shardings=(rep, kv), donate_argnums=(3,)),
      decode_group_full=jax.jit(
          functools.partial(decode_group, full=True), out_shardings=(rep, kv, kv), donate_argnums=(3,)
      ),
      flush=jax.jit(flush, out_shardings=kv, donate_argnums=(1,)),
      grow=jax.jit(cache_lib.grow, out_shardings=kv),
      split=jax.jit(cache_lib.split_prefilled, static_argnames=("w_rows", "block"), out_shardings=kv),
      head=None,  # _functions adds the head of a sampling config.
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
  )


def check_input(config: Config, prompts: Sequence[Sequence[int]], max_new_tokens: int, zero_rows: int = 0) -> None:
  """Raises ValueError for prompts and max_new_tokens that cannot run with `config` (its capacity, vocabulary).
  Needs no engine: the apps call it before they build one."""
  cap, chunk = config.engine.capacity, config.engine.prefill_chunk
  vocab = config.model.vocab_size
  if not prompts:
    raise ValueError("no prompts given")
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
  for i, p in enumerate(prompts):
    if len(p) == 0:
      raise ValueError(f"prompt {i} is empty")
    if len(p) > cap:
      raise ValueError(f"prompt {i} has {len(p)} tokens, longer than the cache capacity {cap} (engine.capacity)")
    bad = [t for t in p if not 0 <= t < vocab]
    if bad:
      raise ValueError(f"prompt {i} has token ids outside [0, {vocab}): {bad[:5]}")
  longest = max(len(p) for p in prompts)
  if longest + max_new_tokens - 1 > cap:
    raise ValueError(
        f"the longest prompt ({longest} tokens) plus max_new_tokens ({max_new_tokens}) needs "
        f"{longest + max_new_tokens - 1} cache rows, more than the capacity {cap}; raise engine.capacity "
        "or lower max_new_tokens"
    )
  if zero_rows % chunk or not 0 <= zero_rows < longest:
    raise ValueError(
        f"zero_rows must be a multiple of engine.prefill_chunk ({chunk}) below the longest prompt ({longest} "
        f"tokens), got {zero_rows}"
    )


class Engine:
  """Generates from a batch of prompts with a KV cache placed and delivered as `config.kv` says."""

  def __init__(self, config: Config, mesh: jax.sharding.Mesh, params: dict, layout: layout_lib.Layout | None = None):
    """layout: where each layer runs (jaxkv.layout; default: every layer on `mesh`, split mode tensor). The
    weights must be placed as it says (jaxkv.model.init_params with the same layout)."""
    self.layout = layout or layout_lib.Layout((mesh,), (0,) * config.model.num_layers, "tensor")
    for m in self.layout.meshes:
      mesh_lib.check_divisible(config.model, m)
    self.config, self.mesh, self.params = config, mesh, params
    lay = self.layout
    self.stage_fns = tuple(
        _functions(config.model, m, config.sampling, config.kv.dtype, config.engine.prefill_attention)
        for m in lay.meshes
    )
    self.fns = self.stage_fns[lay.stage_of[-1]]  # The head's: the last stage.
    self._first = self.stage_fns[lay.stage_of[0]]  # The embedding's.
    self._rep, self._rep_first = mesh_lib.replicated(lay.last), mesh_lib.replicated(lay.first)
    self._stage_reps = tuple(mesh_lib.replicated(m) for m in lay.meshes)
    self.top = {k: v for k, v in params.items() if k != "layers"}  # On the first stage.
    self.top_last = self.top  # The head's copy, on the last stage.
    if lay.last is not lay.first:
      shard = lambda a: jax.sharding.NamedSharding(lay.last, a.sharding.spec)
      self.top_last = jax.device_put(self.top, jax.tree.map(shard, self.top))

  def layer_fns(self, layer: int) -> _Fns:
    return self.stage_fns[self.layout.stage_of[layer]]

  def to_stages(self, a: jax.Array) -> tuple[jax.Array, ...]:
    """A replicated array on every stage (one explicit transfer per other stage in split mode layer)."""
    if len(self._stage_reps) == 1:
      return (a,)
    return tuple(jax.device_put(a, r) for r in self._stage_reps)

  def to_layer(self, x: jax.Array, layer: int) -> jax.Array:
    """x onto layer's stage: the hidden state crossing a stage boundary (split mode layer). Layer 0's input comes
    from the embedding (prefill) or the head on the last stage (decode)."""
    stage_of = self.layout.stage_of
    if len(self._stage_reps) == 1 or (layer and stage_of[layer] == stage_of[layer - 1]):
      return x
    return jax.device_put(x, self._stage_reps[stage_of[layer]])

  def validate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, zero_rows: int = 0) -> None:
    """Raises ValueError for input that cannot run, before any work (check_input)."""
    check_input(self.config, prompts, max_new_tokens, zero_rows)

  def meta(self, start: np.ndarray, end: int, step: int, seed: int) -> jax.Array:
    """The decode state the step functions read, i32[B + 3]: start[B], end, step, seed; on the last stage's devices."""
    return self.put(np.concatenate([start, [end, step, seed]]), np.int32)

  def put(self, value, dtype) -> jax.Array:
    """A host value as an array of `dtype`, replicated on the last stage's devices (where the head runs)."""
    return distributed.put_host(np.asarray(value, dtype), self._rep)

  def generate(
      self,
      prompts: Sequence[Sequence[int]],
      max_new_tokens: int,
      seed: int = 0,
      keep_logits: bool = False,
      on_step=None,
      zero_rows: int = 0,
      on_chunk=None,
  ) -> GenerateResult:
    """Generates up to max_new_tokens per prompt. on_step(step, cache), if given, runs after each decode
    step's tokens are back on the host, and on_chunk(rows) after each prefill chunk is dispatched, rows the prompt rows
    prefilled so far (for monitoring). zero_rows (a multiple of engine.prefill_chunk below the
    longest prompt): rows [0, zero_rows) are stored as zeros instead of prefilled through the model, a synthetic
    context for benchmarks (decode reads and attends them like any rows; the tokens differ from a full prefill's)."""
    self.validate(prompts, max_new_tokens, zero_rows)
    cfg = self.config
    batch = len(prompts)
    cache = cache_lib.KVCache(cfg.model, cfg.kv, self.mesh, batch, cfg.engine.capacity, self.layout)
    transport = Transport(cache, cfg.kv.pipeline_depth, cfg.kv.transport_debug)
    rec = _Recorder(batch, cfg.sampling.eos_id, max_new_tokens, keep_logits, cfg.kv.transport_debug, on_chunk)
    try:
      return self._generate(prompts, max_new_tokens, seed, on_step, cache, transport, rec, zero_rows)
    finally:
      transport.close()
      rec.digests.close()

  def prefill(self, cache, transport, tokens, start, longest, seed, finish, *, next_pass, shapes, counters, first=0):
    """Prefills right-aligned prompts in chunks of engine.prefill_chunk rows; returns the last prompt row's
    hidden state x [B, D].

    tokens i32[B, n * chunk] (prompt b at rows [start[b], longest)); chunks before `first` are skipped: their
    rows must already be in the cache (zeros are fine when they are left padding). The last chunk calls
    finish(l, window_rows_device, open_page) -> D2H bytes instead of storing its grown window: rows
    [0, longest // block * block) and the open page. counters(transport, d2h, rows) runs after each chunk.

    Where the prompt's rows fit in device memory (`prefill_plan`), each layer's grown window stays on the devices
    from one chunk to the next: the first chunk gets its window (the rows below `first`, if any) through the
    transport, the later chunks get it from the devices, and the rows reach the cache's memory once, in the last
    chunk (finish). Otherwise every chunk gets its window through the transport and stores it grown. Either way
    each layer's prefill function sees the same values: the same bits.
    """
    block, chunk = self.config.kv.block, self.config.engine.prefill_chunk
    layers, stage_of = self.params["layers"], self.layout.stage_of
    n_chunks = -(-longest // chunk)
    w_final = longest // block * block
    plan = prefill_plan(cache, n_chunks - first, chunk, self.config.kv.headroom_mib)
    cache.prefill_summary = dict(plan, attention=self.stage_fns[0].prefill_attention)
    kept: list = [None] * len(layers)  # With plan["keep"]: each layer's window so far, on the devices.
    x = None
    for c in range(first, n_chunks):
      last = c == n_chunks - 1
      x = self._first.embed(self.top, distributed.put_host(tokens[:, c * chunk : (c + 1) * chunk], self._rep_first))
      metas = self.to_stages(self.meta(start, c * chunk, 0, seed))
      d2h = 0

      def compute(l, window):  # window: layer l's rows [0, c * chunk) on the devices, or None.
        nonlocal x, d2h
        shapes.add(("prefill", 0 if window is None else window.shape[3]))
        fns = self.layer_fns(l)
        x, rows = fns.prefill(layers[l], self.to_layer(x, l), window, metas[stage_of[l]])
        if last:
          d2h += finish(l, *fns.split(window, rows, w_rows=w_final, block=block))
        elif plan["keep"]:
          kept[l] = fns.grow(window, rows)
        else:
          d2h += cache.store(l, fns.grow(window, rows))

      if plan["keep"] and c > first:  # The windows are on the devices: nothing to deliver.
        for l in range(len(layers)):
          compute(l, kept[l])
      else:  # With host attention the tail is delivered: the head is moved back and prepended.
        transport.run_pass(
            lambda l, tail: compute(l, cache.full_window(l, tail)),
            next_pass=next_pass if last else not plan["keep"],
        )
      counters(transport, d2h, (c + 1) * chunk)
    return self.fns.last_row(x, distributed.put_host(np.int32(longest - 1 - (n_chunks - 1) * chunk), self._rep))

  def decode_pass(
      self, cache, transport, x, meta, start: np.ndarray, end: int, next_pass: bool, shapes, run_ahead: bool = False
  ) -> tuple[jax.Array, int]:
    """One decode pass over every layer writing row `end` (== meta's end); returns x [B, D] before the head and
    the D2H bytes. When the open page fills, each layer's window grows by it and cache.rows by a block.

    start: i32[B] on the host, meta's starts (the host kernel's mask; read from meta, it would wait for the last
    pass). run_ahead: the pass returns without waiting for its host kernels (with device waits; the thread's wait
    has waited for each already), so this thread dispatches the next pass while they run; the caller collects them
    (`_kernels_collected`) before it changes the heads in place or ends."""
    block, layers, stage_of = self.config.kv.block, self.params["layers"], self.layout.stage_of
    full = end - cache.rows == block - 1
    metas = self.to_stages(meta)
    cache.dispatches += len(metas) - 1
    split = cache.host_split is not None
    if split:
      cache.host_times["steps"] += 1
    d2h = 0
    held = None  # The last split layer's merge, not dispatched yet.

    def compute(group, windows):
      nonlocal x, d2h, held
      shapes.add(("decode", 0 if windows[0] is None else windows[0].shape[3]))
      fns, first, meta_s = self.layer_fns(group[0]), group[0], metas[stage_of[group[0]]]
      if split and cache.head_rows(first):  # A streamed layer (alone with host attention) with head rows.
        x, held = self._decode_split(cache, first, fns, x, held, windows[0], meta_s, start)
        if full:
          grown, cache.opens[first] = fns.flush(windows[0], cache.opens[first])
          cache.dispatches += 1
          d2h += cache.store_tail(first, grown)
        return
      x, held = self._merge_held(cache, held, x), None
      moved = self.to_layer(x, first)
      cache.dispatches += (moved is not x) + 1
      args = ([layers[l] for l in group], moved, windows, [cache.opens[l] for l in group], meta_s)
      if full:
        x, grown, opens = fns.decode_group_full(*args)
      else:
        x, opens = fns.decode_group(*args)
      for l, open_page in zip(group, opens):
        cache.opens[l] = open_page
      if full:
        d2h += cache.store_group(group, grown)

    with self._kernels_collected(cache, wait=not run_ahead):
      transport.run_groups(compute, next_pass=next_pass)
      x = self._merge_held(cache, held, x)
    if full:
      cache.rows += block
    return x, d2h

  def _decode_split(self, cache, l, fns, x, held, tail, meta, start) -> tuple[jax.Array, _HeldMerge]:
    """Layer l with rows [0, r1) (cache.heads[l], r1 > 0) attended on the host CPU by the kernel's worker thread
    and the tail [r1, W) (delivered) and the open page on the devices.

    x [B, D] is the input of layer l, or with `held` (the previous split layer's merge) the input of that merge.
    Returns layer l's input and its own merge, held: the next split layer's query carries it (one dispatch per layer
    on the path from one kernel to the next), else `_merge_held` dispatches it.

    The query's call also writes q to pinned host memory; the worker waits for it there, attends the head and writes
    its partial in place into the stage's hand-back array, while this thread dispatches the device's partial over the
    tail (dispatching a call that consumes a delivery in flight blocks this thread until it lands, so on one thread
    the kernel and that wait would add up). The feeder keeps issuing the next layers' deliveries meanwhile.
    (docs/design.md: why on the host's threads and not in a device callback.)

    With device waits (cache.device_wait, jaxkv.host_wait) the devices publish q to the worker themselves, and this
    thread does not wait for the worker: the merge it holds waits on the devices for the worker's signal. The
    workers' futures are collected as they end, and all of them at the end of the pass or, with run-ahead, where
    the caller says (decode_pass)."""
    if held is not None and held.fns is not fns:  # Held on another stage: merged there first.
      x, held = self._merge_held(cache, held, x), None
    moved = self.to_layer(x, l)
    cache.dispatches += (moved is not x) + 2  # The query's call (with the held merge) and the tail's.
    x, p = moved, self.params["layers"][l]
    hand_back = cache.hand_back(fns.pinned_heads)
    times, t0 = cache.host_times, time.perf_counter()
    # The held merge reads the hand-back array before this query, hence before the worker writes it again (with
    # device waits it waits on the devices for the worker's signal). q f32[B, K, G, Dh] also lands in pinned host
    # memory as q_host, or with device waits the devices publish it to hand_back.query.
    q_host, q_slot = None, None if hand_back.query_slot is None else hand_back.query_slot.id
    if held is None:
      args = (p, x, cache.opens[l], meta)
      if q_slot is None:
        q, q_host, cache.opens[l] = fns.query(*args)
      else:
        q, cache.opens[l] = fns.query_published(*args, q_slot=q_slot)
    else:
      host_part, slot = _hand_back_args(held.hand_back)
      args = (held.p, x, held.o, held.lse, host_part, p, cache.opens[l], meta)
      if q_slot is None:
        x, q, q_host, cache.opens[l] = fns.merge_query(*args)
      else:
        x, q, cache.opens[l] = fns.merge_query_published(*args, slot=slot, q_slot=q_slot)
    views, rows = cache.head_views(l), cache.head_rows(l)  # Read here: the worker does not touch the cache's state.
    cache.host_pending.append(
        host_attention.WORKER.submit(self._host_part, cache, views, rows, q_host, start, hand_back)
    )
    t1 = time.perf_counter()
    o, lse = fns.tail_partial(q, tail, cache.opens[l], meta)
    times.update(query=t1 - t0, tail=time.perf_counter() - t1)
    if not hand_back.device_wait:  # The merge takes the partial from this thread: wait for it.
      self._collect(cache)
    while cache.host_pending and cache.host_pending[0].done():  # A kernel's error surfaces here, not at the end.
      times.update(cache.host_pending.popleft().result())
    return x, _HeldMerge(fns, p, o, lse, hand_back)

  @staticmethod
  def _merge_held(cache, held: _HeldMerge | None, x: jax.Array) -> jax.Array:
    """x after the held merge (x itself without one)."""
    if held is None:
      return x
    t0 = time.perf_counter()
    host_part, slot = _hand_back_args(held.hand_back)
    x = held.fns.merge(held.p, x, held.o, held.lse, host_part, slot=slot)
    cache.host_times["merge"] += time.perf_counter() - t0
    cache.dispatches += 1
    return x

  @classmethod
  @contextlib.contextmanager
  def _kernels_collected(cls, cache, wait: bool = True):
    """Collects the host kernels submitted in the block: on an error always (they read the heads in place: none
    may run on past it), else if `wait`."""
    try:
      yield
    except BaseException:
      cls._collect(cache, raise_error=False)
      raise
    if wait:
      cls._collect(cache)

  @staticmethod
  def _collect(cache, raise_error: bool = True) -> None:
    """Waits for the kernels submitted and not collected yet (cache.host_pending), adds their times, and raises the
    first one's error."""
    t0, error = time.perf_counter(), None
    if cache.host_pending:  # One worker: the last ends last.
      _poll(cache.host_pending[-1].done, cache.host_threads)
    while cache.host_pending:
      try:
        cache.host_times.update(cache.host_pending.popleft().result())
      except Exception as e:  # pylint: disable=broad-exception-caught
        error = error or e
    cache.host_times["wait_host"] += time.perf_counter() - t0
    if error is not None and raise_error:
      raise error

  @staticmethod
  def _host_part(cache, views, rows, q_host, start, hand_back) -> dict:
    """On the kernel's worker: waits for q f32[B, K, G, Dh] in pinned host memory, attends rows [0, rows) of the
    layer's head (its kernel views) and writes o and lse into `hand_back`, then signals the devices where they wait
    for it (even on an error: else they would wait forever); returns this thread's seconds per part."""
    try:
      t0 = time.perf_counter()
      if q_host is None:  # Published by the devices (jaxkv.host_wait).
        q = hand_back.read_query()
      else:
        _poll(q_host.is_ready, cache.host_threads)
        if q_host.is_fully_addressable:  # One call: on the H200 host ~0.05 ms a layer less than a view per shard.
          q = np.asarray(q_host)
        else:  # This process's heads; the kernel reads only those.
          q = host_attention.gather(host_attention.shard_views(q_host), q_host.shape)
      t1 = time.perf_counter()
      o, lse = host_attention.attend_views(views, q, start, 0, rows, cache.format, threads=cache.host_threads)
      hand_back.write(o, lse)
    finally:
      if hand_back.device_wait:
        hand_back.signal()
    return dict(wait_query=t1 - t0, kernel=time.perf_counter() - t1)

  def prefill_prompts(self, cache, transport, prompts, seed, *, next_pass, shapes, counters, zero_rows=0):
    """Prefills a batch of prompts right-aligned into a fresh cache (window, open page and cache.rows), rows
    [0, zero_rows) as zeros (Engine.generate); returns (x [B, D] of each prompt's last row, start i32[B], longest)."""
    chunk, block = self.config.engine.prefill_chunk, self.config.kv.block
    lens = np.array([len(p) for p in prompts], np.int32)
    longest = int(lens.max())
    start = longest - lens
    tokens = np.zeros((len(prompts), -(-longest // chunk) * chunk), np.int32)
    for b, p in enumerate(prompts):
      tokens[b, start[b] : longest] = p

    def finish(l, head, open_page):
      cache.opens[l] = open_page
      return cache.store(l, head)

    if zero_rows:
      cache.store_zeros(zero_rows)
    x_last = self.prefill(
        cache,
        transport,
        tokens,
        start,
        longest,
        seed,
        finish,
        next_pass=next_pass,
        shapes=shapes,
        counters=counters,
        first=zero_rows // chunk,
    )
    cache.rows = longest // block * block
    return x_last, start, longest

  def _generate(self, prompts, max_new_tokens, seed, on_step, cache, transport, rec, zero_rows) -> GenerateResult:
    """Prefill, then decode; the caller closes the transport."""
    cfg = self.config
    shapes: set[tuple] = set()
    fns = self.fns
    x_last, start, longest = self.prefill_prompts(
        cache,
        transport,
        prompts,
        seed,
        next_pass=max_new_tokens > 1,
        shapes=shapes,
        counters=lambda tr, d2h, rows: rec.counters("prefill", tr, d2h, rows),
        zero_rows=zero_rows,
    )
    lg, tok, x, _ = fns.head(self.top_last, x_last, self.meta(start, longest, 0, seed))
    t_start = rec.t_start
    finished = rec.take(lg, tok)  # Waits for the prefill: decode timing starts here.
    t_prefilled = time.perf_counter()

    # Decode: step t writes the token of step t - 1 at row `end` and samples the token of step t. Each step's
    # logits and tokens start copying to the host when dispatched and are read `READ_LAG` steps later, when they
    # have arrived, so this thread never waits for the device. Steps dispatched after every sequence ended
    # are discarded.
    meta = self.meta(start, longest, 1, seed)
    pending: collections.deque = collections.deque()
    with self._kernels_collected(cache):  # The passes run ahead of their host kernels; all end here.
      for t in range(1, 1 if finished else max_new_tokens):
        x, d2h = self.decode_pass(
            cache, transport, x, meta, start, longest + t - 1, t < max_new_tokens - 1, shapes, run_ahead=True
        )
        lg, tok, x, meta = fns.head(self.top_last, x, meta)
        lg.copy_to_host_async()
        tok.copy_to_host_async()
        cache.dispatches += 3
        rec.counters("decode", transport, d2h, cache.rows)
        pending.append((t, lg, tok))
        if len(pending) > READ_LAG and self._take(rec, pending.popleft(), on_step, cache):
          finished = True
          break
      while pending and not finished:  # Steps still in flight; none after every sequence ended.
        finished = self._take(rec, pending.popleft(), on_step, cache)
    t_end = time.perf_counter()
    telemetry = dict(transport.summary(), compiled_shapes=len(shapes), prefill=cache.prefill_summary, **rec.totals())
    if cache.host_split is not None:
      telemetry["host_attention"] = dict(telemetry["host_attention"], **host_thread_ms(cache.host_times))
    if cfg.kv.transport_debug >= 1:
      telemetry["steps"] = rec.steps
    if cfg.kv.transport_debug >= 2:
      telemetry["layer_times_ms"] = transport.layer_times_ms()
    timing = dict(
        prefill_s=t_prefilled - t_start, decode_s=t_end - t_prefilled, decode_steps=rec.total["steps_read"] - 1
    )
    return rec.result(telemetry, timing)

  @staticmethod
  def _take(rec, pending, on_step, cache) -> bool:
    step, lg, tok = pending
    done = rec.take(lg, tok)
    if on_step is not None:
      on_step(step, cache)
    return done


def prefill_plan(cache: cache_lib.KVCache, chunks: int, chunk: int, headroom_mib: int) -> dict:
  """Whether a prefill of `chunks` chunks keeps each streamed layer's window on the devices from one chunk to the
  next (Engine.prefill): when the fullest device has room, beside what it holds now and kv.headroom_mib, for every
  streamed layer's rows [0, chunks * chunk) (what the last chunk's windows hold, with its grown one); always where
  the backend reports no device memory (CPU). Otherwise each chunk gets its window through the transport and stores
  it grown, as decode does.

  Returns keep (bool), bytes_per_device (the rows kept on the fullest device), free_bytes_per_device (None without
  memory stats) and reason."""
  need = cache.streamed_bytes_per_device(chunks * chunk)
  devices = {d for s in cache.device_shardings for d in s.mesh.devices.flat if d.process_index == jax.process_index()}
  free = residency.free_device_bytes(sorted(devices, key=lambda d: d.id)) if need else None
  plan = dict(keep=False, bytes_per_device=need, free_bytes_per_device=free)
  if not need or chunks < 2:
    return dict(plan, reason="nothing streamed" if not need else "one chunk: nothing to keep")
  room = None if free is None else free - headroom_mib * 2**20
  if room is not None and need > room:
    reason = (
        f"the streamed layers' {need / 2**20:.0f} MiB of prompt rows per device exceed the free device memory "
        f"{free / 2**20:.0f} MiB - --kv_headroom_mib={headroom_mib}: every chunk gets its window through the transport"
    )
    logging.warning("prefill: %s", reason)
    return dict(plan, reason=reason)
  where = "no device memory limit" if room is None else f"within {room / 2**20:.0f} MiB free - headroom"
  return dict(plan, keep=True, reason=f"earlier rows stay on the devices ({need / 2**20:.0f} MiB per device, {where})")


def host_thread_ms(times: collections.Counter) -> dict:
  """Host attention, ms per decode step in each part of the split layers. The dispatching thread: dispatching the
  query (with the previous split layer's merge, when it carries one) and handing it to the worker, dispatching the
  tail's partial (it waits for the tail's delivery), waiting for the host's partial (with device waits: for the
  kernels still running at the end of the pass, or of the generate whose passes run ahead), dispatching the merges
  that no query carries (the pass's last split layer's, one before a plain layer or at a stage boundary). The
  kernel's worker, meanwhile: waiting for the query, the kernel with the write of its partial."""
  steps = max(times["steps"], 1)
  return {f"{k}_ms_per_step": 1e3 * times[k] / steps for k in HOST_THREAD_PARTS}


def add_by_device(total: dict, c: dict) -> None:
  """Accumulates a take_counters() result's per-device bytes (sum) and ring high-water (max) into `total`."""
  total["h2d_bytes_by_device"].update(c["h2d_bytes_by_device"])
  hw = total["ring_high_water_bytes_by_device"]
  for d, b in c["ring_high_water_bytes_by_device"].items():
    hw[d] = max(hw.get(d, 0), b)


class _Recorder:
  """Collects tokens, hashes logits as they arrive, and keeps per-step transport counters."""

  def __init__(self, batch, eos_id, max_new, keep_logits, debug, on_chunk=None):
    self.tokens = [[] for _ in range(batch)]
    self.done = np.zeros(batch, bool)
    self.eos_id, self.max_new, self.debug, self.on_chunk = eos_id, max_new, debug, on_chunk
    self.digests = digest.Digests()
    self.hash = self.digests.new()
    self.logits = [] if keep_logits else None
    self.steps: list[dict] = []
    self.total = dict(
        h2d_bytes=0,
        d2h_bytes=0,
        ring_high_water_bytes_per_device=0,
        steps_read=0,
        decode_dispatches=0,
        decode_passes=0,
        h2d_bytes_by_device=collections.Counter(),
        ring_high_water_bytes_by_device={},
    )
    self.t_last = self.t_start = self.t_progress = time.perf_counter()

  def counters(self, kind, transport, d2h, rows):
    if kind == "prefill" and self.on_chunk is not None:
      self.on_chunk(rows)
    c = transport.take_counters()
    self.total["h2d_bytes"] += c["h2d_bytes"]
    self.total["d2h_bytes"] += d2h
    self.total["ring_high_water_bytes_per_device"] = max(
        self.total["ring_high_water_bytes_per_device"], c["ring_high_water_bytes_per_device"]
    )
    add_by_device(self.total, c)
    if kind == "decode":
      self.total["decode_dispatches"] += c["dispatches"]
      self.total["decode_passes"] += 1
    if self.debug >= 1:
      now = time.perf_counter()
      self.steps.append(dict(kind=kind, window_rows=rows, d2h_bytes=d2h, host_ms=1e3 * (now - self.t_last), **c))
      self.t_last = now
      if self.debug >= 3:
        logging.info("kv transport: %s", self.steps[-1])

  def take(self, lg, tok) -> bool:
    """Records one step's logits and tokens (blocks on them). Returns True when every sequence is done."""
    lg, tok = jax.device_get((lg, tok))
    lg = np.asarray(lg, np.float32)
    self.digests.update(self.hash, lg)
    if self.logits is not None:
      self.logits.append(lg)
    self.total["steps_read"] += 1
    if time.perf_counter() - self.t_progress > 10.0:
      self.t_progress = time.perf_counter()
      logging.info("decode step %d of at most %d", self.total["steps_read"], self.max_new)
    for b, t in enumerate(np.asarray(tok).tolist()):
      if not self.done[b]:
        self.tokens[b].append(t)
        self.done[b] = t == self.eos_id or len(self.tokens[b]) >= self.max_new
    return bool(self.done.all())

  def totals(self):
    """The totals, with dispatches_per_step: the host's jitted calls and transfers per decode step (mean; the
    pass, its deliveries, the head and the copies of its tokens and logits to the host)."""
    per_step = self.total["decode_dispatches"] / max(self.total["decode_passes"], 1)
    return dict(self.total, h2d_bytes_by_device=dict(self.total["h2d_bytes_by_device"]), dispatches_per_step=per_step)

  def result(self, telemetry, timing) -> GenerateResult:
    return GenerateResult(
        tokens=self.tokens,
        tokens_sha256=hashlib.sha256(json.dumps(self.tokens).encode()).hexdigest(),
        logits_sha256=self.digests.hexdigest(self.hash),
        logits=None if self.logits is None else np.stack(self.logits),
        transport=telemetry,
        timing=timing,
    )
