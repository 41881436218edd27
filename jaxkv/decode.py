"""The decode loop, one for generate and the server: dispatch a pass -> the head -> an async read-back -> the recorder.

A pass runs every layer once, writing row `end` of every sequence: the transport's deliveries (jaxkv.transport), each
group run by one of two runners of one interface, `Runner`: `GroupRunner` (consecutive layers as one jitted call,
jaxkv.jitted; a layer whose window comes in chunks as the calls of jaxkv.chunked, one per chunk) or, for a layer
whose window has host-attended rows, jaxkv.host.decode.HostDecode (its query, the
host's partial, the tail's partial and the merge). The head (jaxkv.jitted) samples each row's next token and carries
the decode state (jaxkv.meta.DecodeState) to the next step on the device. Each step's logits and tokens start copying
to the host when dispatched and are read READ_LAG steps later, when they have arrived, so the dispatching thread never
waits for the device; the reads go to a jaxkv.telemetry.Recorder.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from collections.abc import Sequence
from typing import Protocol

import jax
import numpy as np
from absl import logging

from jaxkv import chunked
from jaxkv import decode_attention
from jaxkv.cache import Issued
from jaxkv.meta import DecodeState, HeadOut
from jaxkv.telemetry import Recorder

READ_LAG = 2  # Decode steps between dispatching a step and reading its tokens back.
HEAD_CALLS = 3  # A step's calls besides its pass: the head and the copies of its logits and tokens.


@dataclasses.dataclass
class Pass:
  """One decode pass, as its runners see it: meta on each stage (jaxkv.meta.Meta), each sequence's first row on
  the host (start i32[B], the host kernel's mask), whether the open pages fill (full), and what the runners issued."""

  metas: tuple[jax.Array, ...]
  stage_of: tuple[int, ...]
  start: np.ndarray | None
  full: bool
  issued: Issued = Issued()

  def meta(self, layer: int) -> jax.Array:
    """meta on the layer's stage."""
    return self.metas[self.stage_of[layer]]


class Runner(Protocol):
  """Runs the delivered groups of a pass: begin() once per pass; run(pass, layers, windows, x) -> the next group's
  input x; settle(pass, x) -> x once nothing it holds is pending (before another runner's group, at the end)."""

  def begin(self) -> None:
    ...

  def run(self, ctx: Pass, layers: tuple[int, ...], windows: list, x: jax.Array) -> jax.Array:
    ...

  def settle(self, ctx: Pass, x: jax.Array) -> jax.Array:
    ...


class GroupRunner:
  """Consecutive layers of one stage as one jitted call (jitted.Fns.decode_group); where the open pages fill, the
  same call also returns the grown windows (at their allocation, jaxkv.cache.window_rows), which one transfer
  stores. A layer delivered in chunks runs as jaxkv.chunked's calls (`run_chunk`)."""

  def __init__(self, engine, cache):
    self.engine, self.cache = engine, cache
    self._chunked = None  # The chunked layer under way: its input x, its query q and its older chunks' partials.

  def begin(self) -> None:
    pass

  def run(self, ctx: Pass, layers: tuple[int, ...], windows: list, x: jax.Array) -> jax.Array:
    eng, cache = self.engine, self.cache
    moved = eng.to_layer(x, layers[0])
    ctx.issued += Issued(calls=1 + (moved is not x))
    ps = [eng.params["layers"][l] for l in layers]
    args = (ps, moved, windows, [cache.opens[l] for l in layers], ctx.meta(layers[0]))
    fns = eng.layer_fns(layers[0])
    if ctx.full:
      x, grown, opens = fns.decode_group_full(*args, grow_to=cache.window_rows(cache.rows + cache.block, layers[0]))
    else:
      x, opens = fns.decode_group(*args)
    for l, open_page in zip(layers, opens):
      cache.opens[l] = open_page
    if ctx.full:
      ctx.issued += cache.store_group(layers, grown)
    return x

  def run_chunk(self, ctx: Pass, d, x: jax.Array) -> jax.Array:
    """Chunk d.chunk of layer d.layers[0]'s window (a jaxkv.transport.Delivery; oldest first), x the layer's input:
    the first also runs the query, each but the last its partials, the last the end of the layer, whose output it
    returns (the others return x). Where the open page fills, each chunk is also written into the grown window on
    the devices (allocated by the first, W + P rows, once the earlier groups' grown windows are done and landed),
    the last with the open page, and the grown window is stored and waited for: one window on the devices beside the
    ring (jaxkv.chunked, jaxkv.residency.workspace_bytes). x [B, T, D]: a verify pass, each chunk's partials per
    token (jaxkv.chunked.calls' tokens)."""
    eng, cache, chunk = self.engine, self.cache, d.chunk
    (l,) = d.layers
    tokens = 1 if x.ndim == 2 else x.shape[1]  # T > 1: a verify pass (jaxkv.spec_decode).
    calls = chunked.calls(cache.model, cache.layout.mesh(l), cache.kv.dtype, eng.config.engine.decode_attention, tokens)
    p, meta = eng.params["layers"][l], ctx.meta(l)
    if chunk.index == 0:
      moved = eng.to_layer(x, l)
      q, cache.opens[l] = calls.query(p, moved, cache.opens[l], meta)
      grown = None
      if ctx.full:  # One window grows at a time: the earlier groups' have replaced theirs and landed.
        jax.block_until_ready(x)
        cache.land_copies()
        grown = cache.device_zeros(l, cache.rows + cache.block)
      self._chunked = (moved, q, [], grown)
      ctx.issued += Issued(calls=1 + (moved is not x) + ctx.full)
    x_in, q, older, grown = self._chunked
    ctx.issued += Issued(calls=1)
    if ctx.full:
      grown = calls.write(grown, d.windows[0], chunk.first_row)
      self._chunked = (x_in, q, older, grown)
      ctx.issued += Issued(calls=1)
    if chunk.index < chunk.count - 1:
      leaves = cache.chunk_rows // decode_attention.LEAF_ROWS
      older.append(calls.partials(q, d.windows[0], chunk.first_row, meta, num_leaves=leaves, page=cache.block))
      return x
    self._chunked = None
    x = calls.out(p, x_in, q, d.windows[0], cache.opens[l], tuple(older), meta, c_rows=cache.chunk_rows)
    if ctx.full:
      grown, cache.opens[l] = calls.flush(grown, cache.opens[l], cache.rows)
      ctx.issued += Issued(calls=1) + cache.store(l, grown)  # Landed when it returns (KVCache._copying).
    return x

  def settle(self, ctx: Pass, x: jax.Array) -> jax.Array:
    del ctx
    return x


def decode_pass(engine, gen, x: jax.Array, meta: jax.Array, next_pass: bool, run_ahead: bool) -> tuple:
  """One pass of generation `gen` (jaxkv.engine.Generation) over every layer, writing row meta's end (the cache's
  rows + the open page's filled rows); returns x [B, D] before the head and what it issued. When the open page
  fills, each layer's window grows by it and cache.rows by a block. x [B, T, D] is a speculative verify pass
  (jaxkv.spec_decode): rows end .. end + T - 1, the page not filled; its caller then sets gen.end.

  next_pass: another pass follows. run_ahead: the pass returns without waiting for its host kernels (with device
  waits; the thread's wait has waited for each already), so this thread dispatches the next pass while they run; the
  caller collects them (`gen.kernels_collected`) before it changes the heads in place or ends."""
  cache, block = gen.cache, gen.cache.block
  full = gen.end - cache.rows == block - 1
  metas = engine.to_stages(meta)
  ctx = Pass(metas, engine.layout.stage_of, gen.start, full, Issued(calls=len(metas) - 1))
  runners = [r for r in (gen.groups, gen.host) if r is not None]
  for r in runners:
    r.begin()
  last = None
  with gen.kernels_collected(wait=not run_ahead):
    with contextlib.closing(gen.transport.deliveries(next_pass)) as deliveries:
      for d in deliveries:
        gen.shapes.add(
            ("decode" if d.chunk is None else "decode_chunk", 0 if d.windows[0] is None else d.windows[0].shape[3])
        )
        runner = gen.host if gen.host is not None and cache.head_rows(d.layers[0]) else gen.groups
        if last is not None and runner is not last:
          x = last.settle(ctx, x)
        if d.chunk is not None:
          x, last = runner.run_chunk(ctx, d, x), runner
        else:
          x, last = runner.run(ctx, d.layers, d.windows, x), runner
    if last is not None:
      x = last.settle(ctx, x)
  if full:
    cache.rows += block
  gen.end += 1
  return x, ctx.issued


@dataclasses.dataclass(frozen=True)
class Step:
  """A dispatched step, its logits and tokens copying to the host: row b is owners[b]'s."""

  index: int
  owners: list[int | None]
  out: HeadOut


class DecodeLoop:
  """The decode steps of one generation (jaxkv.engine.Generation): `first` after a prefill (each row's first token),
  `step` (a pass and the head), `read` (the oldest step in flight, into the recorder). Close it when done."""

  def __init__(self, engine, gen, recorder: Recorder, lag: int = READ_LAG):
    self.engine, self.gen, self.recorder, self.lag = engine, gen, recorder, lag
    self.pending: collections.deque[Step] = collections.deque()
    self.steps = 0  # Passes dispatched.
    self.t_progress = time.perf_counter()

  def first(self, state: DecodeState, owners: Sequence[int | None]) -> DecodeState:
    """After a prefill: samples each row's first token from state.x (its prompt's last row) and queues its read;
    returns the next state."""
    return self._sample(state, owners)

  def step(self, state: DecodeState, owners: Sequence[int | None], next_pass: bool, run_ahead: bool) -> DecodeState:
    """One decode step: the pass writes the tokens sampled last (state.x) at row gen.end, then the head samples the
    next ones. next_pass, run_ahead: as decode_pass's."""
    x, issued = decode_pass(self.engine, self.gen, state.x, state.meta, next_pass, run_ahead)
    self.steps += 1
    state = self._sample(dataclasses.replace(state, x=x), owners)
    self.gen.add_counters("decode", issued + Issued(calls=HEAD_CALLS))
    return state

  def _sample(self, state: DecodeState, owners: Sequence[int | None]) -> DecodeState:
    out, state = self.engine.fns.head(self.engine.top_last, state)
    out.copy_to_host_async()
    self.pending.append(Step(self.steps, list(owners), out))
    return state

  def lagging(self) -> bool:
    """More steps in flight than the read lag: the oldest has arrived."""
    return len(self.pending) > self.lag

  def read(self) -> tuple[Step, list[tuple[int, int, str | None]]]:
    """Reads the oldest step in flight (blocks until its copies land) into the recorder; returns it and what it gave
    (jaxkv.telemetry.Recorder.record)."""
    step = self.pending.popleft()
    logits, tokens = jax.device_get((step.out.logits, step.out.tokens))
    taken = self.recorder.record(step.owners, np.asarray(logits, np.float32), np.asarray(tokens))
    if time.perf_counter() - self.t_progress > 10.0:
      self.t_progress = time.perf_counter()
      done = sum(r.done for r in self.recorder.records.values())
      logging.info("decode step %d read: %d of %d sequences done", step.index, done, len(self.recorder.records))
    return step, taken
