"""What a run reports besides its tokens: the transport's counters summed over its passes (`Counters`, shared by
jaxkv.engine and jaxkv.serving), and for a generate the tokens, the logits' hash and the per-step record
(`Recorder`)."""

from __future__ import annotations

import collections
import time

import jax
import numpy as np
from absl import logging

from jaxkv import digest


def read_back(lg: jax.Array, tok: jax.Array) -> tuple[np.ndarray, np.ndarray]:
  """One step's logits f32[B, V] and tokens i32[B] on the host (blocks on them)."""
  lg, tok = jax.device_get((lg, tok))
  return np.asarray(lg, np.float32), tok


class Counters:
  """The transport's counters (jaxkv.transport.Transport.take_counters) summed over a run's passes: bytes delivered
  (in all and per device), bytes stored back (D2H), the ring's high-water mark (the maximum, in all and per device)
  and the host's dispatches over the decode passes."""

  def __init__(self):
    self.h2d_bytes = self.d2h_bytes = self.ring_high_water_bytes_per_device = 0
    self.h2d_bytes_by_device: collections.Counter = collections.Counter()
    self.ring_high_water_bytes_by_device: dict[str, int] = {}
    self.decode_dispatches = self.decode_passes = 0

  def add(self, kind: str, transport, d2h: int, rows: int) -> dict:
    """Takes the transport's counters after a pass (kind "prefill": a chunk, or "decode") that stored `d2h` bytes
    and left `rows` rows in the windows (unused here: Recorder.add's); returns them."""
    del rows
    c = transport.take_counters()
    self.h2d_bytes += c["h2d_bytes"]
    self.d2h_bytes += d2h
    self.ring_high_water_bytes_per_device = max(
        self.ring_high_water_bytes_per_device, c["ring_high_water_bytes_per_device"]
    )
    self.h2d_bytes_by_device.update(c["h2d_bytes_by_device"])
    hw = self.ring_high_water_bytes_by_device
    for d, b in c["ring_high_water_bytes_by_device"].items():
      hw[d] = max(hw.get(d, 0), b)
    if kind == "decode":
      self.decode_dispatches += c["dispatches"]
      self.decode_passes += 1
    return c

  def by_device(self) -> dict:
    return dict(
        h2d_bytes_by_device=dict(self.h2d_bytes_by_device),
        ring_high_water_bytes_by_device=self.ring_high_water_bytes_by_device,
    )


class Recorder:
  """A generate's record: collects tokens, hashes logits as they arrive, and keeps per-step transport counters."""

  def __init__(self, batch, eos_ids, max_new, keep_logits, debug, on_chunk=None):
    self.tokens = [[] for _ in range(batch)]
    self.done = np.zeros(batch, bool)
    self.eos_ids, self.max_new, self.debug, self.on_chunk = frozenset(eos_ids), max_new, debug, on_chunk
    self.digests = digest.Digests()
    self.hash = self.digests.new()
    self.logits = [] if keep_logits else None
    self.steps: list[dict] = []
    self.counts = Counters()
    self.steps_read = 0
    self.t_last = self.t_start = self.t_progress = time.perf_counter()

  def add(self, kind, transport, d2h, rows) -> dict:
    """Counters.add, and with transport_debug >= 1 a record of the pass; on_chunk(rows) after a prefill chunk."""
    if kind == "prefill" and self.on_chunk is not None:
      self.on_chunk(rows)
    c = self.counts.add(kind, transport, d2h, rows)
    if self.debug >= 1:
      now = time.perf_counter()
      self.steps.append(dict(kind=kind, window_rows=rows, d2h_bytes=d2h, host_ms=1e3 * (now - self.t_last), **c))
      self.t_last = now
      if self.debug >= 3:
        logging.info("kv transport: %s", self.steps[-1])
    return c

  def take(self, lg, tok) -> bool:
    """Records one step's logits and tokens (blocks on them). Returns True when every sequence is done."""
    lg, tok = read_back(lg, tok)
    self.digests.update(self.hash, lg)
    if self.logits is not None:
      self.logits.append(lg)
    self.steps_read += 1
    if time.perf_counter() - self.t_progress > 10.0:
      self.t_progress = time.perf_counter()
      logging.info("decode step %d of at most %d", self.steps_read, self.max_new)
    for b, t in enumerate(np.asarray(tok).tolist()):
      if not self.done[b]:
        self.tokens[b].append(t)
        self.done[b] = t in self.eos_ids or len(self.tokens[b]) >= self.max_new
    return bool(self.done.all())

  def totals(self) -> dict:
    """The counters' totals, the steps read, and dispatches_per_step: the host's jitted calls and transfers per
    decode step (mean; the pass, its deliveries, the head and the copies of its tokens and logits to the host)."""
    c = self.counts
    return dict(
        h2d_bytes=c.h2d_bytes,
        d2h_bytes=c.d2h_bytes,
        ring_high_water_bytes_per_device=c.ring_high_water_bytes_per_device,
        steps_read=self.steps_read,
        decode_dispatches=c.decode_dispatches,
        decode_passes=c.decode_passes,
        **c.by_device(),
        dispatches_per_step=c.decode_dispatches / max(c.decode_passes, 1),
    )
