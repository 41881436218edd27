"""Batched prefill and decode, driven layer by layer from Python.

Prompts are right-aligned in the cache (left padding), so every sequence writes its next row at the same
row `end` and one `dynamic_update_slice` serves the whole batch. Prefill runs in chunks of
`engine.prefill_chunk` rows; decode produces one token per sequence per step, each layer or group of layers one
jitted call (jaxkv.jitted); a split layer's head is attended on the host (jaxkv.host_decode).

The decode state is one array, meta i32[B + 3] = start[B], end, step, seed (jaxkv.meta): one explicit host->device
transfer per prefill chunk; during decode the head computes the next step's meta on the device.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import json
import time
from collections.abc import Sequence

import jax
import numpy as np
from absl import logging

from jaxkv import cache as cache_lib
from jaxkv import distributed
from jaxkv import host_decode
from jaxkv import host_split
from jaxkv import jitted
from jaxkv import layout as layout_lib
from jaxkv import mesh as mesh_lib
from jaxkv import residency
from jaxkv import telemetry as telemetry_lib
from jaxkv.config import Config
from jaxkv.meta import Meta
from jaxkv.transport import Transport

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


@dataclasses.dataclass
class Generation:
  """One generation's state beside the decode state (Engine.start): the cache, its transport and its host-attention
  path (None without one), where the transport's counters go (telemetry.Counters or telemetry.Recorder: add(kind,
  transport, d2h, rows) after each pass), the shapes compiled so far, the sampling seed, and start i32[B] on the
  host, each sequence's first row (meta's starts: the host kernel's mask; read from meta, it would wait for the last
  pass; set by Engine.prefill_prompts). Close it when done."""

  cache: cache_lib.KVCache
  transport: Transport
  host: host_decode.HostDecode | None
  counters: telemetry_lib.Counters | telemetry_lib.Recorder
  shapes: set[tuple]
  seed: int = 0
  start: np.ndarray | None = None
  split: host_split.Split | None = None  # With kv.host_attention: the split, also where it turned the path off.

  def add_counters(self, kind: str, d2h: int, rows: int) -> None:
    """After a pass ("prefill" chunk or "decode") that stored `d2h` bytes, the window rows now `rows`."""
    self.counters.add(kind, self.transport, d2h, rows)

  def kernels_collected(self, wait: bool = True):
    """A context in which the host kernels submitted are collected at its end (HostDecode.kernels_collected)."""
    return contextlib.nullcontext() if self.host is None else self.host.kernels_collected(wait)

  def summary(self) -> dict:
    """The transport's summary and the host-attention path's report."""
    return dict(self.transport.summary(), **host_decode.report(self.host, self.split, self.cache.layer_bytes))

  def close(self) -> None:
    self.transport.close()


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
        jitted.functions(config.model, m, config.sampling, config.kv.dtype, config.engine.prefill_attention)
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

  def layer_fns(self, layer: int) -> jitted.Fns:
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
    """The decode state the step functions read (jaxkv.meta), on the last stage's devices."""
    return self.put(Meta.pack(start, end, step, seed), np.int32)

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
    gen = self.start(len(prompts), seed=seed)
    # The record's clock starts here: prefill_s does not count the cache's start (the host's share measured).
    rec = telemetry_lib.Recorder(
        len(prompts), cfg.sampling.stop_ids, max_new_tokens, keep_logits, cfg.kv.transport_debug, on_chunk
    )
    gen.counters = rec
    try:
      return self._generate(gen, rec, prompts, max_new_tokens, on_step, zero_rows)
    finally:
      gen.close()
      rec.digests.close()

  def start(self, batch: int, counters=None, shapes=None, *, seed: int = 0, kv=None, fill=None) -> Generation:
    """A generation of `batch` sequences: a fresh cache placed as `kv` says (default config.kv; residency.place
    plans it), its host-attention path (host_decode.plan measures its split, or turns it off) and its transport.
    counters: where the transport's counters go (default fresh telemetry.Counters); shapes: the set of compiled shapes
    to add to (default a new one); seed: the sampling seed. fill(cache), if given, stores rows into the cache before
    the transport starts (it sizes its ring from the free device memory)."""
    m, capacity, kv = self.config.model, self.config.engine.capacity, kv or self.config.kv
    chunk = self.config.engine.prefill_chunk
    place = lambda kv: residency.place(m, kv, self.mesh, batch, capacity, self.layout, prefill_chunk=chunk)
    placement, split = place(kv), None
    if kv.host_attention and any(placement.streamed):
      kv, split = host_decode.plan(m, kv, self.layout.mesh(0), batch, capacity)
      if not kv.host_attention:  # Turned off: the placement of streaming (its decode groups).
        placement = place(kv)
    cache = cache_lib.KVCache(m, kv, self.mesh, batch, capacity, self.layout, placement=placement)
    host = host_decode.HostDecode.of(cache, split)
    if fill is not None:
      fill(cache)
    transport = Transport(cache, kv.pipeline_depth, kv.transport_debug)
    counters = telemetry_lib.Counters() if counters is None else counters
    return Generation(cache, transport, host, counters, set() if shapes is None else shapes, seed, split=split)

  def prefill(self, gen: Generation, tokens, start, longest, finish, *, next_pass, first=0, below=None):
    """Prefills right-aligned prompts in chunks of engine.prefill_chunk rows, the last one only as many kv.block
    rows as the prompts reach (a prompt's chunks and their bits depend on its length only); returns the last prompt
    row's hidden state x [B, D].

    tokens i32[B, n * chunk] (prompt b at rows [start[b], longest)); chunks before `first` are skipped: their
    rows must already be in the cache (zeros are fine when they are left padding), or come from below(l): layer l's
    rows [0, first * chunk) on the devices, called just before the layer's first computed chunk (rows held
    elsewhere, e.g. the prefix cache's: their transfers run behind the earlier layers). The last chunk calls
    finish(l, window_rows_device, open_page) -> D2H bytes instead of storing its grown window: rows
    [0, longest // block * block) and the open page. next_pass: a decode pass follows the last chunk.

    Where the prompt's rows fit in device memory (`prefill_plan`), each layer's grown window stays on the devices
    from one chunk to the next: the first chunk gets its window (the rows below `first`, if any) through the
    transport, the later chunks get it from the devices, and the rows reach the cache's memory once, in the last
    chunk (finish). Otherwise every chunk gets its window through the transport and stores it grown. Either way
    each layer's prefill function sees the same values: the same bits.
    """
    block, chunk = self.config.kv.block, self.config.engine.prefill_chunk
    layers, stage_of = self.params["layers"], self.layout.stage_of
    cache, shapes = gen.cache, gen.shapes
    n_chunks = -(-longest // chunk)
    w_final = longest // block * block
    plan = prefill_plan(cache, n_chunks - first, chunk, self.config.kv.headroom_mib)
    cache.prefill_summary = dict(plan, attention=self.stage_fns[0].prefill_attention)
    kept: list = [None] * len(layers)  # With plan["keep"]: each layer's window so far, on the devices.
    x = None
    for c in range(first, n_chunks):
      last = c == n_chunks - 1
      width = -(-(longest - c * chunk) // block) * block if last else chunk  # The last: the blocks the prompts reach.
      x = self._first.embed(self.top, distributed.put_host(tokens[:, c * chunk : c * chunk + width], self._rep_first))
      metas = self.to_stages(self.meta(start, c * chunk, 0, gen.seed))
      d2h = 0

      def compute(l, window):  # window: layer l's rows [0, c * chunk) on the devices, or None.
        nonlocal x, d2h
        if below is not None and c == first:
          window = below(l)
        shapes.add(("prefill", 0 if window is None else window.shape[3], width))
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
        gen.transport.run_pass(
            lambda l, tail: compute(l, cache.full_window(l, tail)),
            next_pass=next_pass if last else not plan["keep"],
        )
      gen.add_counters("prefill", d2h, c * chunk + width)
    return self.fns.last_row(x, distributed.put_host(np.int32(longest - 1 - (n_chunks - 1) * chunk), self._rep))

  def decode_pass(
      self, gen: Generation, x: jax.Array, meta: jax.Array, end: int, next_pass: bool, run_ahead: bool = False
  ) -> tuple[jax.Array, int]:
    """One decode pass over every layer writing row `end` (== meta's end); returns x [B, D] before the head and
    the D2H bytes. When the open page fills, each layer's window grows by it and cache.rows by a block.

    next_pass: another pass follows. run_ahead: the pass returns without waiting for its host kernels (with device
    waits; the thread's wait has waited for each already), so this thread dispatches the next pass while they run;
    the caller collects them (`gen.kernels_collected`) before it changes the heads in place or ends."""
    block, layers, stage_of = self.config.kv.block, self.params["layers"], self.layout.stage_of
    cache, host, start, shapes = gen.cache, gen.host, gen.start, gen.shapes
    full = end - cache.rows == block - 1
    metas = self.to_stages(meta)
    cache.dispatches += len(metas) - 1
    if host is not None:
      host.times["steps"] += 1
    merge_held = (lambda held, x: x) if host is None else host.merge_held
    d2h = 0
    held = None  # The last split layer's merge, not dispatched yet.

    def compute(group, windows):
      nonlocal x, d2h, held
      shapes.add(("decode", 0 if windows[0] is None else windows[0].shape[3]))
      fns, first, meta_s = self.layer_fns(group[0]), group[0], metas[stage_of[group[0]]]
      if host is not None and cache.head_rows(first):  # A streamed layer (alone with host attention) with head rows.
        if held is not None and held.fns is not fns:  # Held on another stage: merged there first.
          x, held = merge_held(held, x), None
        moved = self.to_layer(x, first)
        cache.dispatches += moved is not x
        x, held = host.decode_layer(first, fns, layers[first], moved, held, windows[0], meta_s, start)
        if full:
          grown, cache.opens[first] = fns.flush(windows[0], cache.opens[first])
          cache.dispatches += 1
          d2h += cache.store_tail(first, grown)
        return
      x, held = merge_held(held, x), None
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

    with gen.kernels_collected(wait=not run_ahead):
      gen.transport.run_groups(compute, next_pass=next_pass)
      x = merge_held(held, x)
    if full:
      cache.rows += block
    return x, d2h

  def prefill_prompts(self, gen: Generation, prompts, *, next_pass: bool, zero_rows: int = 0):
    """Prefills a batch of prompts right-aligned into the generation's fresh cache (window, open page and
    cache.rows), rows [0, zero_rows) as zeros (Engine.generate), and sets gen.start; returns (x [B, D] of each
    prompt's last row, start i32[B], longest). next_pass: a decode pass follows."""
    cache = gen.cache
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
    x_last = self.prefill(gen, tokens, start, longest, finish, next_pass=next_pass, first=zero_rows // chunk)
    cache.rows = longest // block * block
    gen.start = start
    return x_last, start, longest

  def _generate(self, gen: Generation, rec, prompts, max_new_tokens, on_step, zero_rows) -> GenerateResult:
    """Prefill, then decode; the caller closes the generation."""
    cfg, fns, cache, seed = self.config, self.fns, gen.cache, gen.seed
    x_last, start, longest = self.prefill_prompts(gen, prompts, next_pass=max_new_tokens > 1, zero_rows=zero_rows)
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
    with gen.kernels_collected():  # The passes run ahead of their host kernels; all end here.
      for t in range(1, 1 if finished else max_new_tokens):
        x, d2h = self.decode_pass(gen, x, meta, longest + t - 1, t < max_new_tokens - 1, run_ahead=True)
        lg, tok, x, meta = fns.head(self.top_last, x, meta)
        lg.copy_to_host_async()
        tok.copy_to_host_async()
        cache.dispatches += 3
        gen.add_counters("decode", d2h, cache.rows)
        pending.append((t, lg, tok))
        if len(pending) > READ_LAG and self._take(rec, pending.popleft(), on_step, cache):
          finished = True
          break
      while pending and not finished:  # Steps still in flight; none after every sequence ended.
        finished = self._take(rec, pending.popleft(), on_step, cache)
    t_end = time.perf_counter()
    telemetry = dict(gen.summary(), compiled_shapes=len(gen.shapes), prefill=cache.prefill_summary, **rec.totals())
    if cfg.kv.transport_debug >= 1:
      telemetry["steps"] = rec.steps
    if cfg.kv.transport_debug >= 2:
      telemetry["layer_times_ms"] = gen.transport.layer_times_ms()
    timing = dict(prefill_s=t_prefilled - t_start, decode_s=t_end - t_prefilled, decode_steps=rec.steps_read - 1)
    return GenerateResult(
        tokens=rec.tokens,
        tokens_sha256=hashlib.sha256(json.dumps(rec.tokens).encode()).hexdigest(),
        logits_sha256=rec.digests.hexdigest(rec.hash),
        logits=None if rec.logits is None else np.stack(rec.logits),
        transport=telemetry,
        timing=timing,
    )

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
