"""Delivery of the layers' KV windows to the devices: ordered (depth 0) or pipelined (depth D >= 1), in groups.

A pass is one run over all layers (a prefill chunk or a decode step), in groups of consecutive layers
(jaxkv.residency.decode_groups, KVCache.groups): decode runs each group as ONE jitted call (jaxkv.decode), and the
transport delivers each group of streamed layers as one transfer (a `jax.device_put` of the group's list of
windows). With placement "host", a feeder thread issues the deliveries, in layer order, each device receiving only
its own heads. The main thread iterates over them in the same order (`deliveries`) and dispatches each group's
compute in the loop's body; the group's ring slot is released when the body is done (or raised). The feeder keeps at
most D + 1 deliveries whose compute has not been dispatched yet: the delivery of group g + D is issued as soon as
group g - 1 has been dispatched, normally before group g is. Issued before the compute it must overlap, the copy runs
beside it (docs/design.md says why the order of issue matters and why a thread: a dispatch that consumes a delivery
still in flight blocks the host, so issuing from the dispatching thread would cost it that wait).

Deliveries past the last group belong to the next pass; they are queued only when the caller says one
follows. Their rows are final by then: group j of the next pass is issued only after group j of this pass
has been computed and stored (the depth is capped at the number of streamed groups - 1).

The ring, counted in groups: the D + 1 deliveries held by the feeder's slots plus the previous one, whose compute
may still run: at most D + 2 groups' windows alive per device (jaxkv.residency.ring_bytes). A consumed delivery is
dropped right after its compute is dispatched; the runtime frees it when that compute ends. Depth 0 is ordered:
group g's copy is issued only after group g - 1 was dispatched, so the copy stream waits for that compute.

Resident layers (placement "device", or those the residency planner keeps on the devices with "auto") are
handed their windows as they are: nothing moves for them, and the feeder delivers only the streamed groups.

Decode passes deliver a streamed layer's window larger than a chunk (KVCache.chunk_rows, jaxkv.chunked) as its
chunks, oldest first, one ring slot each: the depth and the ring then count chunks. Prefill passes take whole
windows (`deliveries`' whole); a whole window larger than a chunk takes every slot, so that it is on the devices
alone (the ring of chunks has no room for more; jaxkv.residency.workspace_bytes counts the one). Either way the next pass's layer j is issued only after this pass's layer j was
consumed (the depth is at most the streamed groups - 1, and a layer has as many chunks in both passes or more in
the next).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Iterator

import jax
from absl import logging

from jaxkv import cache as cache_lib
from jaxkv import chunked
from jaxkv import distributed
from jaxkv import mesh as mesh_lib
from jaxkv import residency
from jaxkv.cache import KVCache


@dataclasses.dataclass
class DepthChoice:
  requested: int
  depth: int
  ring_slots: int
  slot_bytes_per_device: int
  fallback_reason: str | None


_CAPS_LOGGED: set[str] = set()  # The depth caps logged so far.


def choose_depth(
    requested: int, streamed_groups: int, slot_bytes: int, budget_mib: int, headroom_mib: int, free_bytes: int | None
) -> DepthChoice:
  """Largest depth <= requested whose ring (depth + 2 slots of `slot_bytes` per device: a group's windows, or a
  chunk's buffer where windows are chunked) fits both
  the budget (budget_mib, 0 = none) and the free memory of the fullest device minus the headroom."""
  reasons = []
  depth = requested
  if depth > streamed_groups - 1:
    depth = max(streamed_groups - 1, 0)
    reasons.append(f"depth {requested} capped at streamed groups - 1 = {depth}")
  limits = []
  if budget_mib and slot_bytes:
    limits.append((budget_mib * 2**20, f"--kv_pipeline_budget_mib={budget_mib}"))
  if free_bytes is not None:
    limits.append(
        (
            free_bytes - headroom_mib * 2**20,
            f"free device memory {free_bytes / 2**20:.0f} MiB - --kv_headroom_mib={headroom_mib}",
        )
    )
  for cap, what in limits:
    fit = cap // slot_bytes - residency.RING_SPARE if slot_bytes else depth
    if fit < depth:
      new = max(fit, 0)
      note = "" if fit >= 0 else " (even ordered does not fit: expect an out-of-memory error)"
      reasons.append(
          f"ring of depth {depth} needs {residency.ring_bytes(depth, slot_bytes) / 2**20:.1f} MiB per device, "
          f"over {what}: using depth {new}{note}; raise the limit to keep depth {depth}"
      )
      depth = new
  reason = "; ".join(reasons) or None
  if reason and depth < requested:
    # A cap by the groups is the model's shape: an INFO line, once per process; a ring that does not fit, a warning.
    if len(reasons) > (requested > streamed_groups - 1):
      logging.warning("kv pipeline: %s", reason)
    elif reason not in _CAPS_LOGGED:
      _CAPS_LOGGED.add(reason)
      logging.info("kv pipeline: %s", reason)
  return DepthChoice(requested, depth, depth + residency.RING_SPARE, slot_bytes, reason)


@dataclasses.dataclass(frozen=True)
class Delivery:
  """A group's windows on the devices: windows[i] is layers[i]'s (None while empty); chunk: for a chunked layer's
  window (a group of one), which of its chunks windows[0] is (jaxkv.chunked.Chunk; None: the whole window)."""

  layers: tuple[int, ...]
  windows: list[jax.Array | None]
  chunk: chunked.Chunk | None = None


def _arrays(chunk: chunked.Chunk | None, windows: list) -> list[jax.Array | None]:
  """A delivery's windows on the devices: a chunk's from the function that jaxkv.cache.put_rows returned."""
  return windows if chunk is None or windows[0] is None else [windows[0]()]


_BARRIER = -1  # Feeder job: acknowledge that every earlier job has been issued.
_STOP = -2


class Transport:
  """Delivers the layer windows of a `KVCache` to the devices in groups (`groups`), `depth` groups ahead. Call close()
  when done."""

  def __init__(self, cache: KVCache, depth: int, debug: int = 0):
    self.cache, self.debug = cache, debug
    self.num_layers = cache.model.num_layers
    lay = cache.layout
    self._stage_of = lay.stage_of
    self.groups = cache.groups  # Each streamed or resident whole (jaxkv.residency.plan).
    self.order = [g for g, layers in enumerate(self.groups) if cache.streamed[layers[0]]]  # Delivered, in order.
    self.streamed = bool(self.order)
    slot = max((len(self.groups[g]) for g in self.order), default=0) * cache.layer_bytes  # Resident: no ring.
    row = cache.row_bytes(mesh_lib.tensor_size(cache.mesh))
    slot = chunked.slot_bytes(slot, cache.chunk_rows, row, cache.format.row_bytes)
    local = [d for d in lay.devices() if d.process_index == jax.process_index()]
    free = residency.free_device_bytes(local) if self.streamed else None
    streamed_groups = len(self.order) if self.streamed else self.num_layers  # Nothing streamed: nothing to cap.
    self.choice = choose_depth(depth, streamed_groups, slot, cache.kv.budget_mib, cache.kv.headroom_mib, free)
    self.depth = self.choice.depth
    self._stage_devices = [list(m.devices.flat) for m in lay.meshes]
    stages = len(self._stage_devices)
    self._queued_next: bool | None = None  # The next pass's jobs are queued: whether they are whole windows.
    self._lock = threading.Lock()
    # Per stage (the whole mesh, or one device per stage in split mode layer), bytes over all its devices. Delivered
    # bytes count in the pass that takes them (or drops them), not in the one running when the feeder issued them.
    self._h2d = [0] * stages
    self._calls = 0  # Transfer calls issued (one per streamed group delivered).
    self._held = [0] * stages  # Deliveries holding a slot.
    self._previous = [0] * stages  # The delivery consumed last (its compute may still run).
    self._high_water = [0] * stages
    self.layer_times: list[tuple[int, float, float]] = []  # (group's first layer, issue, ready) at debug >= 2.
    self._error: BaseException | None = None
    if self.streamed:
      self._slots = threading.Semaphore(self.depth + 1)
      self._jobs: queue.SimpleQueue = queue.SimpleQueue()
      self._ready: queue.SimpleQueue = queue.SimpleQueue()
      self._feeder = threading.Thread(target=self._feed, name="jaxkv-feeder", daemon=True)
      self._feeder.start()

  def _chunks(self, group: int, whole: bool) -> list[chunked.Chunk | None]:
    """The deliveries of a group: its chunks (a streamed layer of a decode pass larger than a chunk), else [None]."""
    layers = self.groups[group]
    window = self.cache.windows[layers[0]]
    if whole or len(layers) > 1 or window is None:
      return [None]
    pieces = chunked.chunks(window.shape[3], self.cache.chunk_rows)
    return [None] if len(pieces) == 1 else pieces

  def _slots_taken(self, layers: tuple[int, ...], chunk: chunked.Chunk | None) -> int:
    """Ring slots a delivery holds: every one (depth + 1) for a whole window larger than a chunk (a prefill's, where
    decode delivers chunks), else one."""
    window = self.cache.windows[layers[0]]
    if chunk is not None or window is None or not self.cache.chunk_rows:
      return 1
    return self.depth + 1 if window.shape[3] > self.cache.chunk_rows else 1

  def _feed(self) -> None:
    """Feeder thread: issues the queued groups' deliveries, one slot each (a chunked layer's: one per chunk; a
    whole window larger than a chunk: all, _slots_taken):
    (group, chunk, its windows on the devices, bytes, transfer calls, ring slots held, issue time)."""
    while True:
      group, whole = self._jobs.get()
      if group == _STOP:
        return
      if group == _BARRIER:
        self._ready.put((_BARRIER, None, None, 0, 0, 0, 0.0))
        continue
      layers = self.groups[group]
      for chunk in self._chunks(group, whole):
        slots = self._slots_taken(layers, chunk)
        for _ in range(slots):
          self._slots.acquire()
        windows, nbytes, calls = [None] * len(layers), 0, 0
        try:
          if chunk is not None:
            l = layers[0]
            # The chunk's runs stacked by the consumer (_arrays), not here: jaxkv.cache.put_rows.
            windows[0] = cache_lib.put_rows(
                self.cache.windows[l], chunk.first_row, chunk.rows, self.cache.device_shardings[l]
            )
            nbytes, calls = chunk.rows * self.cache.row_bytes(), 1
          elif held := [i for i, l in enumerate(layers) if self.cache.windows[l] is not None]:
            moved = distributed.move_many(
                [self.cache.windows[layers[i]] for i in held], [self.cache.device_shardings[layers[i]] for i in held]
            )
            for i, w in zip(held, moved):
              windows[i] = w
            nbytes, calls = sum(w.nbytes for w in moved), 1
        except BaseException as e:  # Handed to the main thread, which raises it.
          self._error = e
        with self._lock:
          s = self._stage_of[layers[0]]
          self._held[s] += nbytes
          self._high_water[s] = max(self._high_water[s], self._held[s] + self._previous[s])
        self._ready.put((group, chunk, windows, nbytes, calls, slots, time.perf_counter()))
        # The consumer holds the delivery now; a reference kept here while this thread waits for the next slot would
        # keep the windows on the devices past their slot's release (a prefill's whole 4 GiB window at 1M).
        windows = moved = w = None

  def deliveries(self, next_pass: bool, whole: bool = False, next_whole: bool | None = None) -> Iterator[Delivery]:
    """Every group of a pass, in order, its windows on the devices: a streamed group's as the feeder delivered them
    (a chunked layer's as its chunks, oldest first, one Delivery each), a resident group's as they are. The consumer
    computes each delivery in the loop's body and stores any change to its layers' windows in the cache before it
    asks for the next (the deliveries of the next pass read them); the delivery's ring slot is released when it
    does, or when the iteration ends early (close it: `contextlib.closing`).
    next_pass: a pass follows, so deliveries may run into its first groups. whole: the pass takes whole windows (a
    prefill), not chunks; next_whole: the next pass's (default: whole)."""
    next_whole = whole if next_whole is None else next_whole
    if self._queued_next is not None and self._queued_next != whole:  # Queued as the other kind of pass.
      self.drop()
    if self._queued_next is None:
      self._queue_pass(whole)
    if next_pass:  # Issued as slots free: the next pass's delivery i after this pass's delivery i - D - 1.
      self._queue_pass(next_whole)
    self._queued_next = next_whole if next_pass else None
    for g, layers in enumerate(self.groups):
      if not self.cache.streamed[layers[0]]:  # Resident: its windows are already on the devices.
        yield Delivery(layers, [self.cache.windows[l] for l in layers])
        continue
      last = False
      while not last:
        group, chunk, windows, nbytes, calls, slots, t_issue = self._ready.get()
        last = chunk is None or chunk.index == chunk.count - 1
        try:
          if self._error is not None:
            raise RuntimeError("KV delivery failed") from self._error
          assert group == g, (group, g)
          self._calls += calls
          with self._lock:
            self._h2d[self._stage_of[layers[0]]] += nbytes
          windows = _arrays(chunk, windows)
          if self.debug >= 2 and nbytes:
            jax.block_until_ready(windows)
            self.layer_times.append((layers[0], t_issue, time.perf_counter()))
          yield Delivery(layers, windows, chunk)
        finally:  # Also on an error: close() waits for the feeder, which may wait for this slot.
          del windows
          with self._lock:
            self._held[self._stage_of[layers[0]]] -= nbytes
            self._previous[self._stage_of[layers[0]]] = nbytes
          self._slots.release(slots)

  def _queue_pass(self, whole: bool) -> None:
    if self.streamed:
      for g in self.order:
        self._jobs.put((g, whole))

  def in_flight(self) -> int:
    """Deliveries (chunks of a chunked layer) issued and not yet handed to their compute."""
    return self._ready.qsize() if self.streamed else 0

  def drop(self) -> None:
    """Forgets deliveries queued or issued for a pass that will not run. Waits for the copies already issued, so
    that their source windows may be donated (overwritten in place) afterwards."""
    if not self.streamed:
      return
    while True:  # Unqueue jobs not yet started.
      try:
        self._jobs.get_nowait()
      except queue.Empty:
        break
    self._jobs.put((_BARRIER, True))
    while True:
      group, chunk, windows, nbytes, _, slots, _ = self._ready.get()
      if group == _BARRIER:
        break
      jax.block_until_ready(_arrays(chunk, windows))
      del windows
      with self._lock:
        self._h2d[self._stage_of[self.groups[group][0]]] += nbytes  # Moved all the same.
        self._held[self._stage_of[self.groups[group][0]]] -= nbytes
      self._slots.release(slots)
    self._queued_next = None
    self._previous = [0] * len(self._previous)

  def close(self) -> None:
    """Drops pending deliveries and stops the feeder thread."""
    if self.streamed and self._feeder.is_alive():
      self.drop()
      self._jobs.put((_STOP, True))
      self._feeder.join()

  def take_counters(self) -> dict:
    """Bytes delivered, the ring's high-water mark (per device) and the transfer calls issued (`dispatches`) since
    the last call, then resets."""
    with self._lock:
      by_device = lambda per_stage: {
          str(d): b // len(devs) for b, devs in zip(per_stage, self._stage_devices) for d in devs
      }
      hw = by_device(self._high_water)
      out = dict(
          h2d_bytes=sum(self._h2d),
          ring_high_water_bytes_per_device=max(hw.values()),
          h2d_bytes_by_device=by_device(self._h2d),
          ring_high_water_bytes_by_device=hw,
          dispatches=self._calls,
      )
      self._calls = 0
      self._h2d = [0] * len(self._h2d)
      self._high_water = [h + p for h, p in zip(self._held, self._previous)]
    return out

  def layer_times_ms(self) -> list[tuple[int, float, float]]:
    """(group's first layer, issued, ready) in ms since the first issue (transport_debug >= 2)."""
    t0 = self.layer_times[0][1] if self.layer_times else 0.0
    return [(l, 1e3 * (a - t0), 1e3 * (b - t0)) for l, a, b in self.layer_times]

  def summary(self) -> dict:
    c = self.choice
    ring = residency.ring_bytes(c.depth, c.slot_bytes_per_device) if self.streamed else 0
    return dict(
        placement=self.cache.kv.placement,
        decode_groups=[list(g) for g in self.groups],
        depth_requested=c.requested,
        depth=c.depth,
        ring_slots=c.ring_slots if self.streamed else 0,
        ring_slot_layers=max((len(g) for g in self.groups if self.cache.streamed[g[0]]), default=0),
        delivery_chunk_rows=self.cache.chunk_rows,
        ring_bytes_per_device_configured=ring,
        fallback_reason=c.fallback_reason,
        **({"residency": self.cache.plan.summary()} if self.cache.plan else {}),
    )
