"""Delivery of each layer's KV window to the devices: ordered (depth 0) or pipelined (depth D >= 1).

A pass is one run over all layers (a prefill chunk or a decode step). Before dispatching layer l's compute,
the transport issues the delivery of layer l + D: an eager `jax.device_put` of that layer's window from
pinned host memory to the devices, each device receiving only its own heads. Issued before the compute it
must overlap, the copy runs beside it (see docs/design.md). Deliveries past the last layer belong to the
next pass and are issued only if the caller says one follows; by then the rows they carry are final,
because layer j of a pass is computed before layer j of the next is issued (the depth is capped at
num_layers - 1).

The ring: the deliveries issued ahead (at most D) plus the one being computed plus the one whose compute may
still be running: at most D + 2 windows alive per device. A consumed delivery is dropped right after its
compute is dispatched; the runtime frees it when that compute ends.

With placement "device" the windows are already resident: a delivery is the resident array, nothing moves.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable

import jax
from absl import logging

from jaxkv import mesh as mesh_lib
from jaxkv.cache import KVCache


@dataclasses.dataclass
class DepthChoice:
  requested: int
  depth: int
  ring_slots: int
  slot_bytes_per_device: int
  fallback_reason: str | None


def free_device_bytes(devices) -> int | None:
  """Free memory of the fullest device (bytes_limit - bytes_in_use), or None where stats are missing."""
  free = []
  for d in devices:
    stats = d.memory_stats() if hasattr(d, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
      return None
    free.append(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
  return min(free) if free else None


def choose_depth(requested: int, num_layers: int, slot_bytes: int, budget_mib: int, headroom_mib: int,
                 free_bytes: int | None) -> DepthChoice:
  """Largest depth <= requested whose ring (depth + 2 slots of `slot_bytes` per device) fits both the budget
  (budget_mib, 0 = none) and the free memory of the fullest device minus the headroom."""
  reasons = []
  depth = requested
  if depth > num_layers - 1:
    depth = max(num_layers - 1, 0)
    reasons.append(f"depth {requested} capped at num_layers - 1 = {depth}")
  limits = []
  if budget_mib:
    limits.append((budget_mib * 2**20, f"--kv_pipeline_budget_mib={budget_mib}"))
  if free_bytes is not None:
    limits.append((free_bytes - headroom_mib * 2**20,
                   f"free device memory {free_bytes / 2**20:.0f} MiB - --kv_headroom_mib={headroom_mib}"))
  for cap, what in limits:
    fit = cap // slot_bytes - 2 if slot_bytes else depth
    if fit < depth:
      new = max(fit, 0)
      note = "" if fit >= 0 else " (even ordered does not fit: expect an out-of-memory error)"
      reasons.append(f"ring of depth {depth} needs {(depth + 2) * slot_bytes / 2**20:.1f} MiB per device, "
                     f"over {what}: using depth {new}{note}; raise the limit to keep depth {depth}")
      depth = new
  reason = "; ".join(reasons) or None
  if reason and depth < requested:
    logging.warning("kv pipeline: %s", reason)
  return DepthChoice(requested, depth, depth + 2, slot_bytes, reason)


class Transport:
  """Delivers layer windows of a `KVCache` to the devices, `depth` layers ahead."""

  def __init__(self, cache: KVCache, depth: int, debug: int = 0):
    self.cache, self.debug = cache, debug
    self.num_layers = cache.model.num_layers
    t = mesh_lib.tensor_size(cache.mesh)
    slot = cache.row_bytes(t) * cache.rows_bound()
    free = free_device_bytes(cache.mesh.devices.flat) if cache.kv.placement == "host" else None
    self.choice = choose_depth(depth, self.num_layers, slot, cache.kv.budget_mib, cache.kv.headroom_mib, free)
    self.depth = self.choice.depth
    self._tensor = t
    self._ring: collections.deque = collections.deque()  # (layer, window or None, bytes, issue time)
    self._next = 0  # Index (relative to the current pass) of the next delivery to issue.
    self._h2d = 0
    self._live_high_water = 0
    self._last_bytes = 0  # Bytes of the delivery consumed last (its compute may still run).
    self.layer_times: list[tuple[int, float, float]] = []  # (layer, issue, ready) at debug >= 2.

  def _issue(self, layer: int) -> None:
    window = self.cache.windows[layer]
    nbytes = 0
    if window is not None and self.cache.kv.placement == "host":
      window = jax.device_put(window, self.cache.device_sharding)
      nbytes = window.nbytes
    self._ring.append((layer, window, nbytes, time.perf_counter()))
    self._h2d += nbytes
    # Alive now: the ring plus the previous delivery, whose compute may still run.
    live = sum(b for _, _, b, _ in self._ring) + self._last_bytes
    self._live_high_water = max(self._live_high_water, live)

  def run_pass(self, compute: Callable[[int, jax.Array | None], None], next_pass: bool) -> None:
    """Calls compute(l, window_l) for every layer in order, window_l on the devices (None while empty).

    compute(l, ...) must store any change to layer l's window in the cache before it returns.
    next_pass: a pass follows, so deliveries may run into its first layers.
    """
    n = self.num_layers
    for l in range(n):
      while self._next <= l + self.depth and (self._next < n or (next_pass and self._next < 2 * n)):
        self._issue(self._next % n)
        self._next += 1
      layer, window, nbytes, t_issue = self._ring.popleft()
      assert layer == l, (layer, l)
      if self.debug >= 2 and window is not None:
        window.block_until_ready()
        self.layer_times.append((l, t_issue, time.perf_counter()))
      compute(l, window)
      self._last_bytes = nbytes
      del window
    self._next -= n

  def in_flight(self) -> int:
    """Deliveries issued and not yet handed to their compute."""
    return len(self._ring)

  def drop(self) -> None:
    """Forgets deliveries issued for a pass that will not run."""
    self._ring.clear()
    self._next = 0
    self._last_bytes = 0

  def take_counters(self) -> dict:
    """Bytes delivered and the ring's high-water mark since the last call (per device), then resets."""
    out = dict(h2d_bytes=self._h2d, ring_high_water_bytes_per_device=self._live_high_water // self._tensor)
    self._h2d = 0
    self._live_high_water = 0
    return out

  def summary(self) -> dict:
    c = self.choice
    return dict(placement=self.cache.kv.placement, depth_requested=c.requested, depth=c.depth,
                ring_slots=c.ring_slots, ring_bytes_per_device_configured=c.ring_slots * c.slot_bytes_per_device,
                fallback_reason=c.fallback_reason)
