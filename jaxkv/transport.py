"""Delivery of each layer's KV window to the devices: ordered (depth 0) or pipelined (depth D >= 1).

A pass is one run over all layers (a prefill chunk or a decode step). With placement "host", a feeder thread
issues the deliveries, in layer order: an eager `jax.device_put` of a layer's window from pinned host memory
to the devices, each device receiving only its own heads. The main thread takes them in the same order and
dispatches each layer's compute. The feeder keeps at most D + 1 deliveries whose compute has not been
dispatched yet: the delivery of layer l + D is issued as soon as layer l - 1 has been dispatched, normally
before layer l is. Issued before the compute it must overlap, the copy runs beside it (docs/design.md says why the
order of issue matters and why a thread: a dispatch that consumes a delivery still in flight blocks the
host, so issuing from the dispatching thread would cost it that wait).

Deliveries past the last layer belong to the next pass; they are queued only when the caller says one
follows. Their rows are final by then: layer j of the next pass is issued only after layer j of this pass
has been computed and stored (the depth is capped at the number of streamed layers - 1).

The ring: the D + 1 deliveries held by the feeder's slots plus the previous one, whose compute may still
run: at most D + 2 windows alive per device. A consumed delivery is dropped right after its compute is
dispatched; the runtime frees it when that compute ends. Depth 0 is ordered: layer l's copy is issued only
after layer l - 1 was dispatched, so the copy stream waits for that compute.

Resident layers (placement "device", or those the residency planner keeps on the devices with "auto") are
handed their windows as they are: nothing moves for them, and the feeder delivers only the streamed layers.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable

import jax
from absl import logging

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


def choose_depth(
    requested: int, streamed_layers: int, slot_bytes: int, budget_mib: int, headroom_mib: int, free_bytes: int | None
) -> DepthChoice:
  """Largest depth <= requested whose ring (depth + 2 slots of `slot_bytes` per device) fits both the budget
  (budget_mib, 0 = none) and the free memory of the fullest device minus the headroom."""
  reasons = []
  depth = requested
  if depth > streamed_layers - 1:
    depth = max(streamed_layers - 1, 0)
    reasons.append(f"depth {requested} capped at streamed layers - 1 = {depth}")
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
    fit = cap // slot_bytes - 2 if slot_bytes else depth
    if fit < depth:
      new = max(fit, 0)
      note = "" if fit >= 0 else " (even ordered does not fit: expect an out-of-memory error)"
      reasons.append(
          f"ring of depth {depth} needs {(depth + 2) * slot_bytes / 2**20:.1f} MiB per device, "
          f"over {what}: using depth {new}{note}; raise the limit to keep depth {depth}"
      )
      depth = new
  reason = "; ".join(reasons) or None
  if reason and depth < requested:
    logging.warning("kv pipeline: %s", reason)
  return DepthChoice(requested, depth, depth + 2, slot_bytes, reason)


_BARRIER = -1  # Feeder job: acknowledge that every earlier job has been issued.
_STOP = -2


class Transport:
  """Delivers layer windows of a `KVCache` to the devices, `depth` layers ahead. Call close() when done."""

  def __init__(self, cache: KVCache, depth: int, debug: int = 0):
    self.cache, self.debug = cache, debug
    self.num_layers = cache.model.num_layers
    self.order = [l for l in range(self.num_layers) if cache.streamed[l]]  # The layers delivered, in order.
    self.streamed = bool(self.order)
    t = mesh_lib.tensor_size(cache.mesh)
    slot = cache.row_bytes(t) * cache.rows_bound() if self.streamed else 0  # Resident: no ring.
    devices = cache.layout.devices() if cache.layout else list(cache.mesh.devices.flat)
    local = [d for d in devices if d.process_index == jax.process_index()]
    free = residency.free_device_bytes(local) if self.streamed else None
    streamed_layers = len(self.order) if self.streamed else self.num_layers  # Nothing streamed: nothing to cap.
    self.choice = choose_depth(depth, streamed_layers, slot, cache.kv.budget_mib, cache.kv.headroom_mib, free)
    self.depth = self.choice.depth
    lay = cache.layout
    self._stage_of = lay.stage_of if lay else (0,) * self.num_layers
    self._stage_devices = [list(m.devices.flat) for m in lay.meshes] if lay else [list(cache.mesh.devices.flat)]
    stages = len(self._stage_devices)
    self._queued_next = False  # The next pass's jobs are already queued.
    self._lock = threading.Lock()
    # Per stage (the whole mesh, or one device per stage in split mode layer), bytes over all its devices.
    self._h2d = [0] * stages
    self._held = [0] * stages  # Deliveries holding a slot.
    self._previous = [0] * stages  # The delivery consumed last (its compute may still run).
    self._high_water = [0] * stages
    self.layer_times: list[tuple[int, float, float]] = []  # (layer, issue, ready) at debug >= 2.
    self._error: BaseException | None = None
    if self.streamed:
      self._slots = threading.Semaphore(self.depth + 1)
      self._jobs: queue.SimpleQueue = queue.SimpleQueue()
      self._ready: queue.SimpleQueue = queue.SimpleQueue()
      self._feeder = threading.Thread(target=self._feed, name="jaxkv-feeder", daemon=True)
      self._feeder.start()

  def _feed(self) -> None:
    """Feeder thread: issues the queued layers' deliveries, one slot each."""
    while True:
      layer = self._jobs.get()
      if layer == _STOP:
        return
      if layer == _BARRIER:
        self._ready.put((_BARRIER, None, 0, 0.0))
        continue
      self._slots.acquire()
      try:
        window = self.cache.windows[layer]
        nbytes = 0
        if window is not None:
          window = distributed.move(window, self.cache.device_shardings[layer])
          nbytes = window.nbytes
      except BaseException as e:  # Handed to the main thread, which raises it.
        self._error, window = e, None
      with self._lock:
        s = self._stage_of[layer]
        self._h2d[s] += nbytes
        self._held[s] += nbytes
        self._high_water[s] = max(self._high_water[s], self._held[s] + self._previous[s])
      self._ready.put((layer, window, nbytes, time.perf_counter()))

  def run_pass(self, compute: Callable[[int, jax.Array | None], None], next_pass: bool) -> None:
    """Calls compute(l, window_l) for every layer in order, window_l on the devices (None while empty).

    compute(l, ...) must store any change to layer l's window in the cache before it returns.
    next_pass: a pass follows, so deliveries may run into its first layers.
    """
    if not self._queued_next:
      self._queue_pass()
    if next_pass:  # Issued as slots free: the next pass's layer j after this pass's layer j - D - 1.
      self._queue_pass()
    self._queued_next = next_pass
    for l in range(self.num_layers):
      if not self.cache.streamed[l]:  # Resident: its window is already on the devices.
        compute(l, self.cache.windows[l])
        continue
      layer, window, nbytes, t_issue = self._ready.get()
      if self._error is not None:
        raise RuntimeError("KV delivery failed") from self._error
      assert layer == l, (layer, l)
      if self.debug >= 2 and window is not None:
        window.block_until_ready()
        self.layer_times.append((l, t_issue, time.perf_counter()))
      compute(l, window)
      del window
      with self._lock:
        self._held[self._stage_of[l]] -= nbytes
        self._previous[self._stage_of[l]] = nbytes
      self._slots.release()

  def _queue_pass(self) -> None:
    if self.streamed:
      for l in self.order:
        self._jobs.put(l)

  def in_flight(self) -> int:
    """Deliveries issued and not yet handed to their compute."""
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
    self._jobs.put(_BARRIER)
    while True:
      layer, window, nbytes, _ = self._ready.get()
      if layer == _BARRIER:
        break
      if window is not None:
        window.block_until_ready()
      del window
      with self._lock:
        self._held[self._stage_of[layer]] -= nbytes
      self._slots.release()
    self._queued_next = False
    self._previous = [0] * len(self._previous)

  def close(self) -> None:
    """Drops pending deliveries and stops the feeder thread."""
    if self.streamed and self._feeder.is_alive():
      self.drop()
      self._jobs.put(_STOP)
      self._feeder.join()

  def take_counters(self) -> dict:
    """Bytes delivered and the ring's high-water mark since the last call (per device), then resets."""
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
      )
      self._h2d = [0] * len(self._h2d)
      self._high_water = [h + p for h, p in zip(self._held, self._previous)]
    return out

  def layer_times_ms(self) -> list[tuple[int, float, float]]:
    """(layer, issued, ready) in ms since the first issue (transport_debug >= 2)."""
    t0 = self.layer_times[0][1] if self.layer_times else 0.0
    return [(l, 1e3 * (a - t0), 1e3 * (b - t0)) for l, a, b in self.layer_times]

  def summary(self) -> dict:
    c = self.choice
    ring = c.ring_slots * c.slot_bytes_per_device if self.streamed else 0
    return dict(
        placement=self.cache.kv.placement,
        depth_requested=c.requested,
        depth=c.depth,
        ring_slots=c.ring_slots if self.streamed else 0,
        ring_bytes_per_device_configured=ring,
        fallback_reason=c.fallback_reason,
        **({"residency": self.cache.plan.summary()} if self.cache.plan else {}),
        **(
            {
                "host_attention": dict(
                    self.cache.host_split.summary(),
                    threads=self.cache.host_threads,
                    wait="device" if self.cache.device_wait else "thread",
                )
            }
            if self.cache.host_split
            else {}
        ),
    )
