"""The host-attention path of decode (kv.host_attention): a split layer's head attended on the host CPU.

A streamed layer's window is stored split at r1 (jaxkv.cache: its head, rows [0, r1), and its tail). Decode runs such a
layer as its query on the devices, the head's partial on the host by the kernel's worker thread (attention.WORKER), the
tail's partial on the devices, and the merge of the two (jaxkv.host.calls). `HostDecode` is that path for one cache,
and the runner of its split layers in a decode pass (jaxkv.decode.Runner, beside the device groups' runner): the
host's share (jaxkv.host.split), the kernel's threads, what waits for the host's partials (kv.host_attention_wait),
the arrays that carry them back (attention.HandBack), the kernel's views of each head, the kernels' futures and the
time spent per part; `plan`, before a cache is made, measures the split or turns the path off. docs/design.md says
why on the host's threads and not in a device callback.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import numba
import numpy as np
from absl import logging

from jaxkv import cache as cache_lib
from jaxkv import chunked
from jaxkv import decode_attention
from jaxkv import distributed
from jaxkv import mesh as mesh_lib
from jaxkv.config import KVConfig, ModelConfig
from jaxkv.host import attention
from jaxkv.host import calls as calls_lib
from jaxkv.host import split as split_lib
from jaxkv.host import wait as wait_lib
from jaxkv.kv_quant import KVFormat

HOST_THREAD_PARTS = ("query", "tail", "wait_host", "merge", "wait_query", "kernel")  # HostDecode.thread_ms.


def devices_wait(wait: str, devices: set[jax.Device]) -> bool:
  """Whether the devices wait for the host's partials (kv.host_attention_wait, over the cache's devices): "device"
  (ValueError if jaxkv.host.wait's ops did not build), "thread", or "auto": "device" where it was measured faster (on
  the H200 host: one GPU in one process) and the ops build, "thread" elsewhere."""
  if wait == "auto":
    one_gpu = len(devices) == 1 and next(iter(devices)).platform == "gpu" and jax.process_count() == 1
    return one_gpu and wait_lib.available()
  if wait == "device" and not wait_lib.available():
    raise ValueError("kv.host_attention_wait device needs jaxkv.host.wait's ops, which did not build (see the log)")
  return wait == "device"


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


def plan(
    model: ModelConfig, kv: KVConfig, mesh: jax.sharding.Mesh, batch: int, capacity: int
) -> tuple[KVConfig, split_lib.Split | None]:
  """Before a cache of `batch` sequences and `capacity` rows is made: with kv.host_attention and a placement that
  streams, the split (jaxkv.host.split: measured, or the override) and kv; kv with host attention off where the
  measured model predicts a gain under split_lib.MIN_GAIN for the largest window the cache reaches (its windows
  then stream alone, in the decode groups of streaming; logged, and in the telemetry)."""
  if not kv.host_attention or kv.placement == "device":
    return kv, None
  fmt = KVFormat.of(model, kv.dtype)
  host, device = (mesh_lib.sharding(mesh, mesh_lib.CACHE_AXES, k) for k in ("pinned_host", "device"))
  window = cache_lib.row_bytes(model, kv.dtype, batch, mesh_lib.tensor_size(mesh)) * cache_lib.rows_bound(
      capacity, kv.block
  )
  split = split_lib.split(
      kv.host_attention_fraction,
      kv.host_attention_threads,
      host,
      device,
      fmt,
      model.num_heads // model.num_kv_heads,
      window,
  )
  if split.share(window):
    return kv, split
  _warn_off(round(split.gain(window), 3), window // 2**20)
  return dataclasses.replace(kv, host_attention=False), split


@functools.lru_cache(maxsize=None)
def _warn_off(gain: float, window_mib: int) -> None:
  """Logs host attention off, once per process for each figure (a server starts a cache per request)."""
  logging.warning(
      "host attention off: predicted gain %.3f over streaming alone at %d MiB a window per device, under %.2f",
      gain,
      window_mib,
      split_lib.MIN_GAIN,
  )


class HeldMerge(NamedTuple):
  """A split layer's merge, not dispatched yet: merge(p, x, o, lse, host_part, slot=slot) on the stage of `calls`,
  with host_part, slot = _hand_back_args(hand_back)."""

  calls: calls_lib.Calls
  p: dict
  o: jax.Array  # f32[B, K, G, Dh], the device's partial.
  lse: jax.Array  # f32[B, K, G].
  hand_back: attention.HandBack


def _hand_back_args(hand_back: attention.HandBack) -> tuple[jax.Array | None, int | None]:
  """The merge's host_part and slot: the pinned array itself, or the slot the devices wait on (jaxkv.host.wait)."""
  if not hand_back.device_wait:
    return hand_back.array, None
  return None, hand_back.array_slot.id


class Growth(NamedTuple):
  """A split layer's tail growing at a step whose open pages fill (HostDecode._growth): tail [2, B, K, W + P - r1',
  E] on the devices, and joined = r1' - r1, the old tail's first rows that join the head."""

  layer: int
  tail: jax.Array
  joined: int


class HostDecode:
  """The host-attention path of one cache's decode, and the runner of its split layers (jaxkv.decode.Runner).

  engine: the jaxkv.engine.Engine whose layers run (their weights, stages and where x crosses one)."""

  def __init__(self, engine, cache: cache_lib.KVCache, split: split_lib.Split):
    kv = cache.kv
    self.engine, self.cache, self.split, self.threads = engine, cache, split, split.threads
    self.device_wait = devices_wait(kv.host_attention_wait, {d for s in cache.device_shardings for d in s.device_set})
    choice = engine.config.engine.decode_attention
    self.calls = [
        calls_lib.calls(cache.model, cache.layout.mesh(l), kv.dtype, choice) for l in range(cache.model.num_layers)
    ]
    # Seconds the dispatching thread and the kernel's worker spent per part of the split layers (thread_ms).
    self.times: collections.Counter = collections.Counter()
    self.pending: collections.deque = collections.deque()  # The kernel's futures not yet collected.
    self.held: HeldMerge | None = None  # The pass's last split layer's merge, not dispatched yet.
    self._hand_backs: dict[tuple[jax.sharding.Sharding, int], attention.HandBack] = {}
    self._views: dict[int, tuple[jax.Array, list]] = {}  # Layer -> (its head, the kernel's views of it).
    self._chunked = None  # A chunked tail under way (run_chunk): the layer's weights, q, hand-back, partials.

  def hand_back(self, sharding: jax.sharding.Sharding, tokens: int = 1) -> attention.HandBack:
    """The array that carries the host's partials f32[B, K, T * G, Dh + 1] of passes of T = `tokens` tokens
    (jaxkv.host.calls) to a stage's devices, in `sharding` (its heads, pinned host memory); one per stage and T,
    made at first use."""
    if (sharding, tokens) not in self._hand_backs:
      m = self.cache.model
      shape = (self.cache.batch, m.num_kv_heads, tokens * m.num_heads // m.num_kv_heads, m.head_dim + 1)
      self._hand_backs[sharding, tokens] = attention.HandBack(shape, sharding, self.device_wait)
    return self._hand_backs[sharding, tokens]

  def views(self, layer: int) -> list:
    """The kernel's zero-copy views of the layer's head (attention.kernel_views), made once per head: every decode
    step reads them, and making them (JAX calls per shard) with the kernel's checks cost the worker 0.08-0.09 ms a
    layer on the H200 host."""
    head = self.cache.heads[layer]
    if layer not in self._views or self._views[layer][0] is not head:
      self._views[layer] = (head, attention.kernel_views(head, self.cache.format))
    return self._views[layer][1]

  def forget_views(self, layer: int | None = None) -> None:
    """Drops the views of a layer's head (every layer's: None), so that the head can be replaced or donated (a slot
    insert) without the views keeping its memory; a kernel that runs on holds its own."""
    if layer is None:
      self._views.clear()
    else:
      self._views.pop(layer, None)

  # The runner (jaxkv.decode.Runner).
  def begin(self) -> None:
    self.times["steps"] += 1
    self.held = None

  def run(self, ctx, layers: tuple[int, ...], windows: list, x: jax.Array) -> jax.Array:
    """Split layer l (a group of one) in the pass `ctx` (jaxkv.decode.Pass): its tail windows[0] delivered, x its
    input on the previous layer's stage. Returns the input of the next layer, with the layer's merge held."""
    (l,) = layers
    calls = self.calls[l]
    if self.held is not None and self.held.calls is not calls:  # Held on another stage: merged there first.
      x = self.settle(ctx, x)
    moved = self.engine.to_layer(x, l)
    ctx.issued += cache_lib.Issued(calls=2 + (moved is not x))  # The query's call (with the held merge), the tail's.
    p = self.engine.params["layers"][l]
    x, self.held = self.decode_layer(l, calls, p, moved, self.held, windows[0], ctx.meta(l), ctx.start)
    growth = self._growth(l) if ctx.full else None
    if growth is not None:
      ctx.issued += self._store_growth(self._write(growth, windows[0], 0, windows[0].shape[3]))
    elif ctx.full:  # A window of a few pages (_growth): re-split with the head.
      grown, self.cache.opens[l] = calls.flush(windows[0], self.cache.opens[l])
      self.forget_views(l)  # The head may be re-split below.
      ctx.issued += cache_lib.Issued(calls=1) + self.cache.store_tail(l, grown)
    return x

  def settle(self, ctx, x: jax.Array) -> jax.Array:
    """x after the held merge (x itself without one)."""
    if self.held is not None:
      x, self.held = self.merge_held(self.held, x), None
      ctx.issued += cache_lib.Issued(calls=1)
    return x

  def decode_layer(self, l, calls, p, x, held, tail, meta, start) -> tuple[jax.Array, HeldMerge]:
    """Layer l (weights p) with rows [0, r1) (cache.heads[l], r1 > 0) attended on the host CPU by the kernel's
    worker thread and the tail [r1, W) (delivered) and the open page on the devices.

    x [B, D] is the input of layer l on its stage, or with `held` (the previous split layer's merge, on the same
    stage) the input of that merge. Returns layer l's input and its own merge, held: the next split layer's query
    carries it (one dispatch per layer on the path from one kernel to the next), else `merge_held` dispatches it.
    start: i32[B] on the host, meta's starts (the kernel's mask).

    The query's call also writes q to pinned host memory; the worker waits for it there, attends the head and writes
    its partial in place into the stage's hand-back array, while this thread dispatches the device's partial over the
    tail (dispatching a call that consumes a delivery in flight blocks this thread until it lands, so on one thread
    the kernel and that wait would add up). The feeder keeps issuing the next layers' deliveries meanwhile.

    With device waits (jaxkv.host.wait) the devices publish q to the worker themselves, and this thread does not wait
    for the worker: the merge it holds waits on the devices for the worker's signal. The workers' futures are
    collected as they end, and all of them where the caller says (`kernels_collected`)."""
    x, q, hand_back = self._query(l, calls, p, x, held, meta, start)
    t1 = time.perf_counter()
    o, lse = calls.tail_partial(q, tail, self.cache.opens[l], meta)
    return x, self._hold(calls, p, o, lse, hand_back, t1)

  def _query(self, l, calls, p, x, held, meta, start) -> tuple[jax.Array, jax.Array, attention.HandBack]:
    """decode_layer's first part: the query (with the held merge), the host kernel submitted; returns layer l's
    input, q and the hand-back array."""
    cache = self.cache
    hand_back = self.hand_back(calls.pinned_heads, 1 if x.ndim == 2 else x.shape[1])
    t0 = time.perf_counter()
    # The held merge reads the hand-back array before this query, hence before the worker writes it again (with
    # device waits it waits on the devices for the worker's signal). q f32[B, K, G, Dh] also lands in pinned host
    # memory as q_host, or with device waits the devices publish it to hand_back.query.
    q_host, q_slot = None, None if hand_back.query_slot is None else hand_back.query_slot.id
    if held is None:
      args = (p, x, cache.opens[l], meta)
      if q_slot is None:
        q, q_host, cache.opens[l] = calls.query(*args)
      else:
        q, cache.opens[l] = calls.query_published(*args, q_slot=q_slot)
    else:
      host_part, slot = _hand_back_args(held.hand_back)
      args = (held.p, x, held.o, held.lse, host_part, p, cache.opens[l], meta)
      if q_slot is None:
        x, q, q_host, cache.opens[l] = calls.merge_query(*args)
      else:
        x, q, cache.opens[l] = calls.merge_query_published(*args, slot=slot, q_slot=q_slot)
    views, rows = self.views(l), cache.head_rows(l)  # Read here: the worker does not touch the cache's state.
    self.pending.append(attention.WORKER.submit(self._host_part, views, rows, q_host, start, hand_back))
    self.times.update(query=time.perf_counter() - t0)
    return x, q, hand_back

  def _hold(self, calls, p, o, lse, hand_back, t1: float) -> HeldMerge:
    """decode_layer's last part, the device's partial (o, lse) dispatched since t1: the merge to hold (with thread
    waits, once the host's partial is there)."""
    times = self.times
    times.update(tail=time.perf_counter() - t1)
    if not hand_back.device_wait:  # The merge takes the partial from this thread: wait for it.
      self.collect()
    while self.pending and self.pending[0].done():  # A kernel's error surfaces here, not at the end.
      times.update(self.pending.popleft().result())
    return HeldMerge(calls, p, o, lse, hand_back)

  def run_chunk(self, ctx, d, x: jax.Array) -> jax.Array:
    """Chunk d.chunk of split layer l's tail (a jaxkv.transport.Delivery, oldest first; jaxkv.chunked), x as `run`
    takes it: the first chunk runs the query, each but the last its partials, the last the device's partial over
    the tail and the open page from them, whose merge is held as `run` holds it. Returns layer l's input."""
    (l,) = d.layers
    cache, chunk, calls = self.cache, d.chunk, self.calls[l]
    tokens = 1 if x.ndim == 2 else x.shape[1]  # T > 1: a verify pass (jaxkv.spec_decode).
    chunk_calls = chunked.calls(
        cache.model, cache.layout.mesh(l), cache.kv.dtype, self.engine.config.engine.decode_attention, tokens
    )
    r1 = cache.head_rows(l)
    if chunk.index == 0:
      if self.held is not None and self.held.calls is not calls:  # Held on another stage: merged there first.
        x = self.settle(ctx, x)
      moved = self.engine.to_layer(x, l)
      ctx.issued += cache_lib.Issued(calls=1 + (moved is not x))
      p = self.engine.params["layers"][l]
      x, q, hand_back = self._query(l, calls, p, moved, self.held, ctx.meta(l), ctx.start)
      self.held, self._chunked = None, (p, q, hand_back, [], self._growth(l) if ctx.full else None)
    p, q, hand_back, older, growth = self._chunked
    ctx.issued += cache_lib.Issued(calls=1)
    if growth is not None:
      growth = self._write(growth, d.windows[0], chunk.first_row, chunk.rows)
      self._chunked = (p, q, hand_back, older, growth)
      ctx.issued += cache_lib.Issued(calls=1)
    if chunk.index < chunk.count - 1:
      leaves = cache.chunk_rows // decode_attention.LEAF_ROWS
      older.append(
          chunk_calls.partials(q, d.windows[0], r1 + chunk.first_row, ctx.meta(l), num_leaves=leaves, page=cache.block)
      )
      return x
    self._chunked = None
    t1 = time.perf_counter()
    kw = dict(c_rows=cache.chunk_rows)
    o, lse = chunk_calls.tail(q, d.windows[0], cache.opens[l], tuple(older), r1, ctx.meta(l), **kw)
    self.held = self._hold(calls, p, o, lse, hand_back, t1)
    if growth is not None:
      ctx.issued += self._store_growth(growth)
    elif ctx.full:  # A window of a few pages (_growth): the tail moved whole, re-split with the head.
      tail = distributed.move(cache.windows[l], cache.device_shardings[l])
      grown, cache.opens[l] = calls.flush(tail, cache.opens[l])
      self.forget_views(l)  # The head may be re-split below.
      ctx.issued += cache_lib.Issued(calls=2) + cache.store_tail(l, grown)
    return x

  def _growth(self, l: int) -> Growth | None:
    """At a step whose open pages fill, split layer l's Growth: a zero buffer on the devices for its grown tail,
    rows [r1', W + P) with r1' the split row of W + P rows, that the delivered tail is written into as it arrives
    (`_write`), then the open page (`_store_growth`). The devices hold this buffer beside the ring, not the tail,
    the head and the whole window (jaxkv.residency.decode_workspace_bytes). None where r1' would take rows of the
    open page, or move down (a window of a few pages): the tail then grows whole and is re-split with the head."""
    cache = self.cache
    r1, r1_next = cache.head_rows(l), cache.split_row(cache.rows + cache.block)
    if not r1 <= r1_next <= cache.rows:
      return None
    cache.land_copies()  # One tail grows at a time: the earlier layers' have landed in pinned host memory.
    return Growth(l, cache.device_zeros(l, cache.rows + cache.block - r1_next), r1_next - r1)

  def _write(self, growth: Growth, rows: jax.Array, first: int, count: int) -> Growth:
    """growth with the rows of a delivery (rows [2, B, K, count, E] on the devices: the old tail's rows [first,
    first + count)) written that stay in the tail: those from growth.joined on."""
    skip = max(growth.joined - first, 0)
    if skip >= count:  # Every row joins the head.
      return growth
    sharding = self.cache.device_shardings[growth.layer]
    return growth._replace(tail=cache_lib.write_rows(growth.tail, rows, first + skip - growth.joined, sharding, skip))

  def _store_growth(self, growth: Growth) -> cache_lib.Issued:
    """The open page written at the end of growth's tail (the page then zeroed), and the tail stored with the old
    tail's first growth.joined rows joined to the head (jaxkv.cache.KVCache.store_split_tail)."""
    cache, l = self.cache, growth.layer
    at = growth.tail.shape[3] - cache.block
    grown = cache_lib.write_rows(growth.tail, cache.opens[l], at, cache.device_shardings[l])
    cache.opens[l] = cache.device_zeros(l, cache.block)
    self.forget_views(l)  # The head is replaced where rows join it.
    return cache_lib.Issued(calls=2) + cache.store_split_tail(l, grown, growth.joined)

  def merge_held(self, held: HeldMerge | None, x: jax.Array) -> jax.Array:
    """x after the held merge (x itself without one)."""
    if held is None:
      return x
    t0 = time.perf_counter()
    host_part, slot = _hand_back_args(held.hand_back)
    x = held.calls.merge(held.p, x, held.o, held.lse, host_part, slot=slot)
    self.times["merge"] += time.perf_counter() - t0
    return x

  @contextlib.contextmanager
  def kernels_collected(self, wait: bool = True):
    """Collects the host kernels submitted in the block: on an error always (they read the heads in place: none
    may run on past it), else if `wait`."""
    try:
      yield
    except BaseException:
      self.held = None
      self.collect(raise_error=False)
      raise
    if wait:
      self.collect()

  def collect(self, raise_error: bool = True) -> None:
    """Waits for the kernels submitted and not collected yet, adds their times, and raises the first one's error."""
    t0, error = time.perf_counter(), None
    if self.pending:  # One worker: the last ends last.
      _poll(self.pending[-1].done, self.threads)
    while self.pending:
      try:
        self.times.update(self.pending.popleft().result())
      except Exception as e:  # pylint: disable=broad-exception-caught
        error = error or e
    self.times["wait_host"] += time.perf_counter() - t0
    if error is not None and raise_error:
      raise error

  def _host_part(self, views, rows, q_host, start, hand_back) -> dict:
    """On the kernel's worker: waits for q f32[B, K, G, Dh] in pinned host memory, attends rows [0, rows) of the
    layer's head (its kernel views) and writes o and lse into `hand_back`, then signals the devices where they wait
    for it (even on an error: else they would wait forever); returns this thread's seconds per part."""
    try:
      t0 = time.perf_counter()
      if q_host is None:  # Published by the devices (jaxkv.host.wait).
        q = hand_back.read_query()
      else:
        _poll(q_host.is_ready, self.threads)
        if q_host.is_fully_addressable:  # One call: on the H200 host ~0.05 ms a layer less than a view per shard.
          q = np.asarray(q_host)
        else:  # This process's heads; the kernel reads only those.
          q = attention.gather(attention.shard_views(q_host), q_host.shape)
      t1 = time.perf_counter()
      o, lse = attention.attend_views(views, q, start, 0, rows, self.cache.format, threads=self.threads)
      hand_back.write(o, lse)
    finally:
      if hand_back.device_wait:
        hand_back.signal()
    return dict(wait_query=t1 - t0, kernel=time.perf_counter() - t1)

  def thread_ms(self) -> dict:
    """Ms per decode step in each part of the split layers. The dispatching thread: dispatching the query (with the
    previous split layer's merge, when it carries one) and handing it to the worker, dispatching the tail's partial
    (it waits for the tail's delivery), waiting for the host's partial (with device waits: for the kernels still
    running at the end of the pass, or of the generate whose passes run ahead), dispatching the merges that no query
    carries (the pass's last split layer's, one before a plain layer or at a stage boundary). The kernel's worker,
    meanwhile: waiting for the query, the kernel with the write of its partial."""
    steps = max(self.times["steps"], 1)
    return {f"{k}_ms_per_step": 1e3 * self.times[k] / steps for k in HOST_THREAD_PARTS}

  def summary(self) -> dict:
    """The split (split_lib.Split.summary at the cache's largest window) and what waits ("thread" or "device")."""
    return dict(self.split.summary(self.cache.layer_bytes), wait="device" if self.device_wait else "thread")


def report(host: HostDecode | None, split: split_lib.Split | None = None, window_bytes: int = 0) -> dict:
  """A run's telemetry of the path: {"host_attention": its summary and thread_ms}; with host attention turned off by
  `plan`, {"host_attention": the split's summary at `window_bytes`, off: True}; else {}."""
  if host is not None:
    return {"host_attention": dict(host.summary(), **host.thread_ms())}
  if split is not None:
    return {"host_attention": dict(split.summary(window_bytes), off=True)}
  return {}
