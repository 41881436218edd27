"""Prefill and batched decode, driven layer by layer from Python.

Prompts are right-aligned in the cache (left padding), so every sequence writes its next row at the same
row `end` and one `dynamic_update_slice` serves the whole batch. Prefill runs in chunks of
`engine.prefill_chunk` rows (`Engine.prefill`, a generator of the last chunk's layers for their consumer to store),
each prompt alone from its row 0 and then moved to its rows (`Engine.prefill_slot`), so that a sequence's bits do
not depend on the other prompts; decode produces one token per sequence per step in the one decode loop
(jaxkv.decode), each group of layers one jitted call (jaxkv.jitted), a split layer's head attended on the host
(jaxkv.host.decode).

The layers read meta i32[B + 1] = start[B], end (jaxkv.meta.Meta): one explicit host->device transfer per prefill
chunk; during decode the head carries the decode state (jaxkv.meta.DecodeState) to the next step on the device.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import json
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from jaxkv import cache as cache_lib
from jaxkv import decode
from jaxkv import distributed
from jaxkv import jitted
from jaxkv import layout as layout_lib
from jaxkv import mesh as mesh_lib
from jaxkv import model as model_lib
from jaxkv import residency
from jaxkv import sampling as sampling_lib
from jaxkv import self_draft
from jaxkv import spec_decode
from jaxkv import speculate
from jaxkv import telemetry
from jaxkv.cache import Issued
from jaxkv.config import Config, check_speculate
from jaxkv.host import decode as host_decode
from jaxkv.host import split as split_lib
from jaxkv.meta import DecodeState, Meta
from jaxkv.sampling import SamplingParams
from jaxkv.transport import Transport


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


@functools.lru_cache(maxsize=None)
def _stack_fn(sharding: jax.sharding.Sharding):
  """[1, D] arrays -> [N, D], in `sharding`."""
  return jax.jit(lambda xs: jnp.concatenate(xs), out_shardings=sharding)


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
  shortest = min(len(p) for p in prompts)
  if zero_rows % chunk or not 0 <= zero_rows < shortest:
    raise ValueError(
        f"zero_rows must be a multiple of engine.prefill_chunk ({chunk}) below the shortest prompt ({shortest} "
        f"tokens), got {zero_rows}"
    )


@dataclasses.dataclass
class Generation:
  """One generation's state beside the decode state (Engine.start): the cache, its transport, the runners of its
  decode passes (jaxkv.decode: the device groups', and the host-attention path's, None without one), where the
  transport's counters go, the shapes compiled so far, the split (with kv.host_attention, also where it turned the
  path off), and on the host: start i32[B], each sequence's first row (meta's starts: the host kernel's mask; read
  from meta, it would wait for the last pass), end, the row the next pass writes (set by a prefill), the last
  prefill's attention and plan (prefill_plan), and the placement its decode takes after its prefill
  (Engine.place_for_decode; None: the cache's). Close it when done."""

  cache: cache_lib.KVCache
  transport: Transport
  groups: decode.GroupRunner
  host: host_decode.HostDecode | None
  counters: telemetry.Counters
  shapes: set[tuple]
  split: split_lib.Split | None = None
  start: np.ndarray | None = None
  end: int = 0
  prefill_summary: dict = dataclasses.field(default_factory=dict)
  decode_plan: residency.Plan | None = None

  def add_counters(self, kind: str, issued: Issued, rows: int | None = None) -> None:
    """After a pass ("prefill" chunk or "decode") that issued `issued` (its stores, its calls), the window rows now
    `rows` (default the cache's)."""
    self.counters.add(kind, self.transport, issued, self.cache.rows if rows is None else rows)

  def kernels_collected(self, wait: bool = True):
    """A context in which the host kernels submitted are collected at its end (HostDecode.kernels_collected)."""
    return contextlib.nullcontext() if self.host is None else self.host.kernels_collected(wait)

  def drop_pending(self, *arrays) -> None:
    """Before slots are replaced in place (KVCache.insert_slot): forgets the deliveries issued for a pass that will
    not run, drops the host kernel's views of the heads, and waits until no copy of the last step reads the cache's
    windows and no store writes them (and for `arrays`, what depends on every delivery the last step consumed)."""
    self.transport.drop()
    if self.host is not None:
      self.host.forget_views()
    jax.block_until_ready((arrays, self.cache.windows, self.cache.heads))

  def summary(self) -> dict:
    """The transport's summary and the host-attention path's report."""
    return dict(self.transport.summary(), **host_decode.report(self.host, self.split, self.cache.layer_bytes))

  def close(self) -> None:
    self.transport.close()


def last_chunk_rows(rows: int, block: int, chunk: int) -> int:
  """The rows a prefill's last chunk computes for the `rows` (1 <= rows <= chunk) prompt rows left after its whole
  chunks: the fewest blocks, a power of two, that hold them, at most the chunk; so a prompt of a new length meets a
  last chunk of one of log2(chunk / block) + 1 sizes, each compiled once per chunk index. The rows past the prompt
  are padding (token 0)."""
  blocks = 1
  while blocks * block < rows:
    blocks *= 2
  return min(blocks * block, chunk)


PREFILL_BUCKETS = 8  # A prefill window's sizes per doubling of its chunks (prefill_window_rows).


def prefill_window_rows(rows: int, chunk: int, capacity: int, block: int) -> int:
  """A, the rows a prefill chunk's window of `rows` rows (whole chunks) is computed at, padded at its start: the
  fewest chunks m * 2^s, m in [PREFILL_BUCKETS, 2 PREFILL_BUCKETS), that hold it, at most the cache's largest
  window (jaxkv.cache.rows_bound less the open page) and at least `rows`. Windows of up to 2 PREFILL_BUCKETS chunks
  are exact; a longer prompt's chunks share O(PREFILL_BUCKETS log(chunks)) window shapes, each at most
  1 / PREFILL_BUCKETS of padding (a 1M prompt of 2,048-row chunks: 57 window shapes where exact windows were 512)."""
  n, shift = rows // chunk, 0
  while -(-n >> shift) >= 2 * PREFILL_BUCKETS:
    shift += 1
  limit = cache_lib.rows_bound(capacity, block) - block
  return max(min((-(-n >> shift) << shift) * chunk, limit), rows)


def prefill_rows(length: int, block: int, chunk: int) -> int:
  """R, the rows a prefill of a prompt of `length` tokens computes: its whole chunks, then its last chunk's
  (last_chunk_rows)."""
  whole = (length - 1) // chunk * chunk
  return whole + last_chunk_rows(length - whole, block, chunk)


@dataclasses.dataclass(frozen=True)
class PrefilledLayer:
  """A layer after the last prefill chunk, to be placed (jitted.Fns.place): its rows [0, R) as the prefill computed
  them (R = Prefill.rows), on the devices in two parts, never copied into one array (the place reads both): window
  [2, B, K, pad + W0, E] rows [0, W0) after `pad` rows of padding (prefill_window_rows; None while W0 = 0) and the
  last chunk's rows [2, B, K, C, E] rows [W0, R). The rows from the longest prompt's end on are the last chunk's
  padding, which decode masks until it writes them."""

  layer: int
  window: jax.Array | None
  chunk: jax.Array
  pad: int = 0


class Prefill:
  """A prefill under way (Engine.prefill): iterating over it runs it and yields each layer of its last chunk
  (PrefilledLayer), which the consumer stores before it asks for the next; then `x` holds the hidden state of each
  prompt's last row [B, D]. rows: R, the rows it computed (prefill_rows; for its counters,
  Generation.add_counters)."""

  def __init__(self, steps: Iterator[PrefilledLayer], rows: int):
    self._steps, self.rows, self.x = steps, rows, None

  def __iter__(self) -> Iterator[PrefilledLayer]:
    self.x = yield from self._steps


class Engine:
  """Generates from a batch of prompts with a KV cache placed and delivered as `config.kv` says."""

  def __init__(self, config: Config, mesh: jax.sharding.Mesh, params: dict, layout: layout_lib.Layout | None = None):
    """layout: where each layer runs (jaxkv.layout; default: every layer on `mesh`, split mode tensor). The
    weights must be placed as it says (jaxkv.model.init_params with the same layout)."""
    self.layout = layout or layout_lib.make_layout("tensor", mesh, config.model.num_layers)
    for m in self.layout.meshes:
      mesh_lib.check_divisible(config.model, m)
    self.config, self.mesh, self.params = config, mesh, params
    lay = self.layout
    self.stage_fns = tuple(
        jitted.functions(
            config.model, m, config.kv.dtype, config.engine.prefill_attention, config.engine.decode_attention
        )
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

  def meta(self, start: np.ndarray, end: int) -> jax.Array:
    """The layers' decode state (jaxkv.meta.Meta), on the last stage's devices."""
    return self.put(Meta.pack(start, end), np.int32)

  def embed(self, tokens: np.ndarray) -> jax.Array:
    """Token ids i32[...] on the host -> their embeddings [..., D] on the first stage (layer 0's input)."""
    return self._first.embed(self.top, distributed.put_host(np.asarray(tokens, np.int32), self._rep_first))

  def put(self, value, dtype) -> jax.Array:
    """A host value as an array of `dtype`, replicated on the last stage's devices (where the head runs)."""
    return distributed.put_host(np.asarray(value, dtype), self._rep)

  def state(self, x: jax.Array, start: np.ndarray, end: int, sampling: SamplingParams, prompts=None) -> DecodeState:
    """A decode state of B rows (jaxkv.meta.DecodeState) whose next token is their first: x [B, D] (after a prefill,
    each prompt's last row, at row `end`), meta of start i32[B] and end, sampling (host arrays, SamplingParams.rows),
    prompts: each row's prompt ids or None (what its repetition penalty reads; default none)."""
    put = lambda a: self.put(a, a.dtype)
    b, vocab = len(start), self.config.model.vocab_size
    seen = sampling_lib.prompt_tokens(prompts or [None] * b, sampling, vocab)
    counts, allowed = put(np.zeros((b, vocab), np.int32)), put(np.ones((b, vocab), bool))
    return DecodeState(
        x, self.meta(start, end), put(np.zeros(b, np.int32)), jax.tree.map(put, sampling), counts, put(seen), allowed
    )

  def sampling(self, batch: int, seed: int) -> SamplingParams:
    """The config's sampling for `batch` rows of one seed, row b its stream b (jaxkv.sampling)."""
    return SamplingParams.rows([self.config.sampling] * batch, [seed] * batch, range(batch))

  def generate(
      self,
      prompts: Sequence[Sequence[int]],
      max_new_tokens: int,
      seed: int = 0,
      keep_logits: bool = False,
      on_step=None,
      zero_rows: int = 0,
      on_chunk=None,
      drafter=None,
  ) -> GenerateResult:
    """Generates up to max_new_tokens per prompt. on_step(step, cache), if given, runs after each decode
    step's tokens are back on the host, and on_chunk(rows) after each prefill chunk is dispatched, rows its prompt's
    rows prefilled so far (the prompts are prefilled one after another: prefill_prompts). zero_rows (a multiple of
    engine.prefill_chunk below the shortest prompt): each prompt's rows [0, zero_rows) are stored as zeros instead of
    prefilled through the model, a synthetic context for benchmarks (decode reads and attends them like any rows; the
    tokens differ from a full prefill's). drafter: speculative decoding with this drafter (jaxkv.speculate's
    interface, without a switch; a test's or benchmark's), or a jaxkv.spec_decode.Speculator, instead of
    config.speculate's."""
    self.validate(prompts, max_new_tokens, zero_rows)
    cfg, speculator = self.config, self._speculator(drafter)
    counters = telemetry.Counters(cfg.kv.transport_debug, on_chunk)
    rows = max(map(len, prompts)) + max_new_tokens - 1 if speculator is None and max_new_tokens > 1 else 0
    gen = self.start(len(prompts), counters=counters, decode_rows=rows)
    # The record's clock starts here: prefill_s does not count the cache's start (the host's share measured).
    rec = telemetry.Recorder(cfg.sampling.stop_ids, step_hash=True, keep_logits=keep_logits)
    try:
      return self._generate(gen, rec, prompts, max_new_tokens, seed, on_step, zero_rows, speculator)
    finally:
      gen.close()
      rec.close()

  def start(self, batch: int, *, kv=None, counters=None, shapes=None, decode_rows=0) -> Generation:
    """A generation of `batch` sequences: a fresh cache placed as `kv` says (default config.kv; residency.place
    plans it), its host-attention path (host_decode.plan measures its split, or turns it off) and its transport.
    counters: where the transport's counters go (default fresh telemetry.Counters); shapes: the set of compiled shapes
    to add to (default a new one). decode_rows: the rows the cache's decode reaches where nothing prefills into it
    after its first prefill (generate; 0: not so), so that decode may run on residency.decode_plan's placement
    (Engine.place_for_decode; one process only: its moves may fail on one device and not another)."""
    m, capacity, kv = self.config.model, self.config.engine.capacity, kv or self.config.kv
    chunk = self.config.engine.prefill_chunk
    place = lambda kv: residency.place(m, kv, self.layout, batch, capacity, prefill_chunk=chunk)
    placement, split = place(kv), None
    if kv.host_attention and any(placement.streamed):
      kv, split = host_decode.plan(m, kv, self.layout.mesh(0), batch, capacity)
      if not kv.host_attention:  # Turned off: the placement of streaming (its decode groups).
        placement = place(kv)
    share = split.share if kv.host_attention and split is not None and any(placement.streamed) else None
    # Window buckets change no bits of the leaves' decode attention; legacy's would change (jaxkv.cache). A streamed
    # window would carry its padding over the link every step (up to 2x its rows at kv.window_buckets 1, 1.39x on
    # average), where the link bounds the step: buckets only where every window stays on the device.
    legacy = any(f.decode_attention == "legacy" for f in self.stage_fns)
    exact = any(placement.streamed) or legacy
    buckets = 0 if exact else kv.window_buckets
    decode_plan = None
    if decode_rows and not legacy and jax.process_count() == 1:
      impl = self.stage_fns[0].decode_attention
      tensor = mesh_lib.tensor_size(self.layout.mesh(0))
      decode_plan = residency.decode_plan(m, kv, batch, capacity, tensor, placement, impl)
    cache = cache_lib.KVCache(
        m,
        kv,
        self.layout,
        batch,
        capacity,
        placement=placement,
        head_share=share,
        buckets=buckets,
        full_rows=0 if decode_plan is None else cache_lib.rows_bound(decode_rows, kv.block) - kv.block,
    )
    host = None if share is None else host_decode.HostDecode(self, cache, split)
    transport = Transport(cache, kv.pipeline_depth, kv.transport_debug)
    counters = telemetry.Counters() if counters is None else counters
    groups = decode.GroupRunner(self, cache)
    shapes = set() if shapes is None else shapes
    return Generation(cache, transport, groups, host, counters, shapes, split, decode_plan=decode_plan)

  def place_for_decode(self, gen: Generation) -> None:
    """After the generation's prefill: its cache placed by its decode plan (residency.decode_plan), each promoted
    group moved to the devices whole (KVCache.promote), and a transport for that placement (the prefill's, closed,
    holds no ring). The plan counts bytes, the allocator holds blocks: a group moves only where its devices have a
    free block of its windows and one more (for decode's growth), where the allocator reports blocks; a group that
    does not fit, or runs out of memory moving, stays streamed with those after it (a warning says so)."""
    plan, cache = gen.decode_plan, gen.cache
    if plan is None:
      return
    gen.transport.close()
    if gen.host is not None:
      gen.host.forget_views()  # The kernel's views of the promoted layers' heads, which the cache drops.
    cache.land_copies()
    done = []
    for group in (g for g in cache.groups if g[0] in plan.promoted):
      mesh = cache.device_shardings[group[0]].mesh
      block = residency.largest_free_block([d for d in mesh.devices.flat if d.process_index == jax.process_index()])
      need = (len(group) + 1) * cache.row_bytes(mesh_lib.tensor_size(mesh)) * cache.full_rows
      why = None
      if block is not None and block < need:
        why = f"the largest free block {block / 2**20:.0f} MiB holds less than {need / 2**20:.0f} MiB"
      else:
        try:
          cache.promote(group)
        except jax.errors.JaxRuntimeError as e:
          if "RESOURCE_EXHAUSTED" not in str(e):
            raise
          why = str(e).splitlines()[0][:200]
      if why is not None:
        logging.warning(
            "kv placement auto: decode's plan moved %d of %d layers to the devices; layers %s did not fit (%s): they "
            "and those after them stay streamed",
            len(done),
            len(plan.promoted),
            list(group),
            why,
        )
        break
      done += group
    cache.plan = dataclasses.replace(plan, streamed=cache.streamed, promoted=tuple(done))
    gen.transport = Transport(cache, cache.kv.pipeline_depth, cache.kv.transport_debug)
    gen.decode_plan = None

  def prefill(
      self, gen: Generation, tokens, start, longest, *, first=0, prefix=None, next_pass=False, hidden=None
  ) -> Prefill:
    """Prefills right-aligned prompts into the generation's cache in chunks of engine.prefill_chunk rows, the last
    one a power of two of kv.block rows that holds the rest (last_chunk_rows: a prompt's chunks and their bits depend
    on its length only, and lengths whose last chunks share a size share its programs), each chunk's window computed
    at prefill_window_rows (padded at its start: O(log) window shapes, not one per chunk); returns the prefill to
    iterate over: the last chunk's layers (PrefilledLayer: rows [0, R), R = prefill_rows(longest)), which the consumer
    places, then the last prompt row's hidden state (Prefill.x).

    tokens i32[B, n * chunk] (prompt b at rows [start[b], longest)); chunks before `first` are skipped: their
    rows must already be in the cache (zeros are fine when they are left padding), or come in `prefix`: per layer,
    blocks of its rows [0, first * chunk) on the devices, joined just before the layer's first computed chunk (rows
    held elsewhere, e.g. the prefix cache's: their transfers run behind the earlier layers). next_pass: a decode
    pass follows the last chunk. hidden: a list that gets each computed chunk's last-layer output [B, width, D] (its
    rows' hidden states, what the head reads: prompt logprobs; the last chunk's past `longest` are its padding's), in
    order; the programs run are the same.

    The chunks run in spans of model.prefill_span chunks (1 GiB of hidden states), layer by layer: each layer
    computes a span's chunks one after another, its window grown on the devices. Where the prompt's rows fit in
    device memory (`prefill_plan`), each layer's grown window stays on the devices from one span to the next: the
    first span gets its window (the rows below `first`, if any) through the transport, the later ones get it from
    the devices, and the rows reach the cache's memory once, stored by the consumer of the last chunk. Otherwise
    every span gets its windows through the transport and stores them grown: a streamed layer's rows cross the link
    once a span, not once a chunk (a 1M prompt: 8 spans of 64 chunks of 2,048 rows). Either way each layer's
    prefill function sees the same values as chunk by chunk: the same bits.
    """
    rows = prefill_rows(longest, self.config.kv.block, self.config.engine.prefill_chunk)
    return Prefill(self._prefill(gen, tokens, start, longest, first, prefix, next_pass, hidden), rows)

  def _prefill(self, gen, tokens, start, longest, first, prefix, next_pass, hidden) -> Iterator[PrefilledLayer]:
    block, chunk = self.config.kv.block, self.config.engine.prefill_chunk
    layers, stage_of = self.params["layers"], self.layout.stage_of
    cache = gen.cache
    n_chunks = -(-longest // chunk)
    # Chunk c's window of c * chunk rows is computed at a_rows[c] rows padded at its start: its rows' left padding
    # moves by the padding (the meta's start), so the values attended and their order are the exact window's.
    a_rows = [prefill_window_rows(c * chunk, chunk, self.config.engine.capacity, block) for c in range(n_chunks + 1)]
    kept_rows = max(n_chunks * chunk, a_rows[n_chunks - 1])  # The largest window a layer holds.
    plan = prefill_plan(cache, n_chunks - first, kept_rows, self.config.kv.headroom_mib)
    gen.prefill_summary = dict(plan, attention=self.stage_fns[0].prefill_attention)
    kept: list = [None] * len(layers)  # With plan["keep"]: each layer's window so far, on the devices.
    span = model_lib.prefill_span(self.config.model, tokens.shape[0], chunk)
    for c0 in range(first, n_chunks, span):
      cs = range(c0, min(c0 + span, n_chunks))
      last = cs[-1] == n_chunks - 1
      widths = [last_chunk_rows(longest - c * chunk, block, chunk) if c == n_chunks - 1 else chunk for c in cs]
      xs = [
          self._first.embed(self.top, distributed.put_host(tokens[:, c * chunk : c * chunk + w], self._rep_first))
          for c, w in zip(cs, widths)
      ]
      metas = [self.to_stages(self.meta(start + (a_rows[c] - c * chunk), c * chunk)) for c in cs]
      issued = Issued()
      # With plan["keep"] the later spans' windows are on the devices: nothing to deliver. Else with host attention
      # the tail is delivered: the head is moved back and prepended.
      windows = self._kept(kept) if plan["keep"] and c0 > first else self._delivered(gen, last, next_pass, plan)
      with contextlib.closing(windows):
        for l, window in windows:
          fns = self.layer_fns(l)
          if prefix is not None and c0 == first:
            window = fns.join(prefix[l])
          for i, c in enumerate(cs):
            gen.shapes.add(("prefill", a_rows[c], widths[i]))
            # A window that came exact (delivered, joined) is padded inside the call, by the copy its attention
            # makes anyway: no padded copy of it beside the window.
            xs[i], rows = fns.prefill(layers[l], self.to_layer(xs[i], l), window, metas[i][stage_of[l]], rows=a_rows[c])
            if c == n_chunks - 1:
              yield PrefilledLayer(l, window, rows, 0 if window is None else window.shape[3] - c * chunk)
            else:
              window = fns.grow(window, rows, to=a_rows[c + 1])
          if not last and plan["keep"]:
            kept[l] = window
          elif not last:
            w_rows = (cs[-1] + 1) * chunk
            issued += cache.store(l, window if window.shape[3] == w_rows else fns.tail(window, rows=w_rows))
          # Dropped before the next layer's window arrives: a stored window lives in the cache (or on the host) now,
          # and a window of the last chunk in its consumer's hands.
          window = rows = None
      if hidden is not None:
        hidden.extend(xs)
      for i, c in enumerate(cs[:-1] if last else cs):  # Each chunk counted (the last one by the consumer).
        gen.add_counters("prefill", issued if i == 0 else Issued(), c * chunk + widths[i])
    x = xs[-1]
    return self.fns.last_row(x, distributed.put_host(np.int32(longest - 1 - (n_chunks - 1) * chunk), self._rep))

  @staticmethod
  def _kept(kept: list) -> Iterator[tuple[int, jax.Array | None]]:
    yield from enumerate(kept)

  @staticmethod
  def _delivered(gen: Generation, last: bool, next_pass: bool, plan: dict) -> Iterator[tuple[int, jax.Array | None]]:
    """Each layer's window [0, W) on the devices, through the transport (its ring slot held until the layers of its
    group are computed)."""
    run = gen.transport.deliveries(next_pass if last else not plan["keep"], whole=True, next_whole=not last)
    with contextlib.closing(run) as deliveries:
      for d in deliveries:
        layers, tails = d.layers, list(d.windows)
        del d  # Held across the next delivery, its windows would outlive their ring slot (as would `window`).
        for l in layers:
          window = gen.cache.full_window(l, tails.pop(0))
          yield l, window
          del window

  def prefill_prompts(self, gen: Generation, prompts, *, next_pass: bool, zero_rows: int = 0):
    """Prefills a batch of prompts right-aligned at the longest one's end E into the generation's fresh cache (window,
    open page and cache.rows), each prompt alone from its row 0 (prefill_slot), and sets gen.start and gen.end:
    a sequence's rows and last hidden state depend on its prompt only, never on the others. Rows [0, zero_rows) of
    each prompt are zeros (Engine.generate). Returns (x [B, D] of each prompt's last row, start i32[B], E).

    One prompt is prefilled straight into the cache (its rows start at row 0, then cut into the window and the open
    page: jitted.Fns.place; next_pass: a decode pass follows, whose first deliveries may start behind the last
    chunk); more are prefilled one by one in a generation of one sequence placed like this one (the price: one
    prompt's rows beside the batch's), each prompt's rows moved to [E - L, E) of its slot."""
    chunk, block = self.config.engine.prefill_chunk, self.config.kv.block
    lens = np.array([len(p) for p in prompts], np.int32)
    longest = int(lens.max())
    gen.start, gen.end = longest - lens, longest
    if len(prompts) == 1:
      if zero_rows:
        gen.cache.store_zeros(zero_rows)
      issued = Issued()
      run = self.prefill(
          gen, self._tokens(prompts[0]), gen.start, longest, first=zero_rows // chunk, next_pass=next_pass
      )
      w_rows = longest // block * block
      for layer in run:
        a_rows = gen.cache.window_rows(w_rows, layer.layer)
        window, gen.cache.opens[layer.layer] = self._place(layer, a_rows - w_rows, a_rows)
        issued += gen.cache.store(layer.layer, window if w_rows else None)
        del layer, window  # Else held while the next layer computes: a streamed layer's two windows on the devices.
      gen.add_counters("prefill", issued, run.rows)
      gen.cache.rows = w_rows
      return run.x, gen.start, longest
    gen.cache.store_empty_slots(longest // block * block)
    own, xs, plans = self.start(1, counters=gen.counters, shapes=gen.shapes), [], []
    try:
      for b, prompt in enumerate(prompts):
        if zero_rows:
          own.cache.store_zeros(zero_rows)
        run = self.prefill_slot(own, gen.cache, b, prompt, longest, first=zero_rows // chunk)
        collections.deque(run, maxlen=0)  # Runs it, holding no layer while the next computes.
        xs.append(run.x)
        plans.append(own.prefill_summary)
    finally:
      own.close()
    # The largest prefill's plan: the one that needs the most device memory.
    gen.prefill_summary = max(plans, key=lambda plan: plan["bytes_per_device"])
    return _stack_fn(self._rep)(xs), gen.start, longest

  def prefill_slot(
      self, own: Generation, cache: cache_lib.KVCache, slot: int, prompt, end: int, *, first=0, prefix=None, hidden=None
  ) -> Prefill:
    """Prefills one prompt of L tokens alone from its row 0 in `own` (a generation of one sequence whose cache holds
    the rows of the chunks before `first`, if any, or gets them in `prefix`; hidden: Engine.prefill's), its chunks the ones its
    length determines, and puts its rows at [end - L, end) of slot `slot` of `cache` (window of end // block * block
    rows, and open page; jitted.Fns.place, KVCache.insert_slot) layer by layer as the prefill yields them, so that a
    layer's slot is replaced while the next layers compute. Nothing may read or write `cache` meanwhile
    (Generation.drop_pending).

    Returns the prefill to iterate over: each layer as prefilled from row 0 (PrefilledLayer: rows [0, R), e.g. for the
    prefix cache), after its slot was filled; then x [1, D], the prompt's last row."""
    length = len(prompt)
    run = self.prefill(
        own, self._tokens(prompt), np.zeros(1, np.int32), length, first=first, prefix=prefix, hidden=hidden
    )
    return Prefill(self._fill_slot(own, run, cache, slot, end - length, end), run.rows)

  def refill_slot(
      self, own: Generation, cache: cache_lib.KVCache, slot: int, run: Prefill, layers, length: int, end: int
  ) -> jax.Array:
    """Puts a prompt of `length` tokens prefilled before (its prefill_slot `run`, iterated, and the layers it
    yielded) at [end - length, end) of slot `slot` of `cache` as prefill_slot does, without computing it again
    (several samples of one prompt); returns its x [1, D]."""

    def replay():
      yield from layers
      return run.x

    for _ in self._fill_slot(own, Prefill(replay(), run.rows), cache, slot, end - length, end):
      pass
    return run.x

  def _tokens(self, prompt) -> np.ndarray:
    """i32[1, n * chunk]: the prompt at rows [0, L), zeros after."""
    chunk = self.config.engine.prefill_chunk
    tokens = np.zeros((1, -(-len(prompt) // chunk) * chunk), np.int32)
    tokens[0, : len(prompt)] = prompt
    return tokens

  def _fill_slot(self, own: Generation, run: Prefill, cache, slot: int, offset: int, end: int):
    w_rows, issued = end // self.config.kv.block * self.config.kv.block, Issued()
    for layer in run:
      a_rows = cache.window_rows(w_rows, layer.layer)  # The window's buffer holds rows [w_rows - a_rows, w_rows).
      window, open_page = self._place(layer, offset + a_rows - w_rows, a_rows)
      issued += cache.insert_slot(layer.layer, slot, window if w_rows else None, open_page)
      del window, open_page
      yield layer
      del layer
    own.add_counters("prefill", issued, run.rows)
    own.cache.clear()  # The slot holds its rows now.
    return run.x

  def _place(self, layer: PrefilledLayer, at: int, a_rows: int) -> tuple[jax.Array, jax.Array]:
    """A prefilled layer's rows at rows [at, at + R) of a window of a_rows rows and the open page after it
    (jitted.Fns.place; `at` traced: the program depends on its parts' rows and a_rows only)."""
    fns = self.layer_fns(layer.layer)
    return fns.place(layer.window, layer.chunk, np.int32(at - layer.pad), a_rows=a_rows, block=self.config.kv.block)

  def speculator(self) -> spec_decode.Speculator | None:
    """config.speculate's speculative decoder, a fresh one (None: off); the server's epochs take one each."""
    return self._speculator(None)

  def _speculator(self, drafter) -> spec_decode.Speculator | None:
    """The speculative decoder of a run: `drafter` (no switch), else config.speculate's (None: off)."""
    s = self.config.speculate
    if drafter is not None:
      check_speculate(dataclasses.replace(self.config, speculate=dataclasses.replace(s, mode="lookup")))
      return drafter if isinstance(drafter, spec_decode.Speculator) else spec_decode.Speculator(drafter, s.k)
    if s.mode == "off":
      return None
    drafter = self_draft.SelfDraft(self) if s.mode == "self" else speculate.PromptLookup()
    return spec_decode.Speculator(drafter, s.k, speculate.Switch())

  def _generate(
      self, gen: Generation, rec, prompts, max_new_tokens, seed, on_step, zero_rows, speculator
  ) -> GenerateResult:
    """Prefill, then decode (speculatively with a speculator: jaxkv.spec_decode); the caller closes the
    generation."""
    cfg, batch = self.config, len(prompts)
    next_pass = max_new_tokens > 1 and gen.decode_plan is None  # Else decode gets a new transport.
    x_last, start, longest = self.prefill_prompts(gen, prompts, next_pass=next_pass, zero_rows=zero_rows)
    self.place_for_decode(gen)
    owners = list(range(batch))
    for b in owners:
      rec.add(b, max_new_tokens, hashed=False)
    loop = decode.DecodeLoop(self, gen, rec)
    state = loop.first(self.state(x_last, start, longest - 1, self.sampling(batch, seed), prompts), owners)
    finished = self._read(loop, None)  # Waits for the prefill: decode timing starts here.
    t_prefilled = time.perf_counter()
    spec = None
    if speculator is not None and not finished:
      spec = spec_decode.run(self, gen, rec, owners, prompts, speculator, seed, on_step)
      finished = True
    # Decode: step t writes the token of step t - 1 at row `end` and samples the token of step t; the loop reads each
    # step READ_LAG steps late. Steps dispatched after every sequence ended are discarded.
    with gen.kernels_collected():  # The passes run ahead of their host kernels; all end here.
      for t in range(1, 1 if finished else max_new_tokens):
        state = loop.step(state, owners, next_pass=t < max_new_tokens - 1, run_ahead=True)
        if loop.lagging() and self._read(loop, on_step):
          finished = True
          break
      while loop.pending and not finished:  # Steps still in flight; none after every sequence ended.
        finished = self._read(loop, on_step)
    t_end = time.perf_counter()
    c = gen.counters
    telemetry_out = dict(gen.summary(), compiled_shapes=len(gen.shapes), prefill=gen.prefill_summary, **c.totals())
    telemetry_out["steps_read"] = rec.steps_read
    if spec is not None:
      telemetry_out["speculate"] = spec.summary()
    if cfg.kv.transport_debug >= 1:
      telemetry_out["steps"] = c.steps
    if cfg.kv.transport_debug >= 2:
      telemetry_out["layer_times_ms"] = gen.transport.layer_times_ms()
    tokens = [rec.records[b].tokens for b in owners]
    return GenerateResult(
        tokens=tokens,
        tokens_sha256=hashlib.sha256(json.dumps(tokens).encode()).hexdigest(),
        logits_sha256=rec.hexdigest(rec.hash),
        logits=None if rec.logits is None else np.stack(rec.logits),
        transport=telemetry_out,
        timing=dict(prefill_s=t_prefilled - rec.t_start, decode_s=t_end - t_prefilled, decode_steps=rec.steps_read - 1),
    )

  def _read(self, loop: decode.DecodeLoop, on_step) -> bool:
    """Reads the oldest step in flight; on_step(step, cache) after a decode step. True when every sequence ended."""
    step, _ = loop.read()
    if on_step is not None:
      on_step(step.index, loop.gen.cache)
    return loop.recorder.all_done()


def prefill_plan(cache: cache_lib.KVCache, chunks: int, rows: int, headroom_mib: int) -> dict:
  """Whether a prefill of `chunks` chunks keeps each streamed layer's window on the devices from one span of chunks
  to the next (Engine.prefill): when the fullest device has room for `rows` rows of every streamed layer (the
  largest window a layer holds: the prompt's rows with the last chunk's, or a padded window, prefill_window_rows)
  beside what it holds now, the resident layers' windows grown to `rows` rows, auto's ring and workspace
  (jaxkv.residency) and kv.headroom_mib; always where the backend reports no device memory (CPU). Otherwise each
  span gets its windows through the transport and stores them grown, as decode does.

  Returns keep (bool), bytes_per_device (the rows kept on the fullest device), free_bytes_per_device (None without
  memory stats) and reason."""
  need = cache.layers_bytes_per_device(rows)
  devices = {d for s in cache.device_shardings for d in s.mesh.devices.flat if d.process_index == jax.process_index()}
  free = residency.free_device_bytes(sorted(devices, key=lambda d: d.id)) if need else None
  plan = dict(keep=False, bytes_per_device=need, free_bytes_per_device=free)
  if not need or chunks < 2:
    return dict(plan, reason="nothing streamed" if not need else "one chunk: nothing to keep")
  held = min((w.shape[3] for w, s in zip(cache.windows, cache.streamed) if not s and w is not None), default=0)
  growth = cache.layers_bytes_per_device(rows, streamed=False) - cache.layers_bytes_per_device(held, streamed=False)
  reserved = 0 if cache.plan is None else cache.plan.ring_bytes + cache.plan.workspace_bytes
  room = None if free is None else free - growth - reserved - headroom_mib * 2**20
  if room is not None and need > room:
    reason = (
        f"the streamed layers' {need / 2**20:.0f} MiB of prompt rows per device exceed the free device memory "
        f"{free / 2**20:.0f} MiB less the resident layers' growth {growth / 2**20:.0f} MiB, the ring and workspace "
        f"{reserved / 2**20:.0f} MiB and --kv_headroom_mib={headroom_mib}: every span of chunks gets its windows "
        "through the transport"
    )
    logging.info("prefill: %s", reason)
    return dict(plan, reason=reason)
  where = "no device memory limit" if room is None else f"within the {room / 2**20:.0f} MiB of room"
  return dict(plan, keep=True, reason=f"earlier rows stay on the devices ({need / 2**20:.0f} MiB per device, {where})")
