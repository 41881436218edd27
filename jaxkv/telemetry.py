"""What a run reports besides its tokens: the transport's counters summed over its passes (`Counters`), and the
record of what each sequence or request got (`Recorder`: its tokens, its logits' hash, its time to the first token),
shared by generate and the server (jaxkv.decode.DecodeLoop feeds both)."""

from __future__ import annotations

import collections
import dataclasses
import time

import numpy as np
from absl import logging

from jaxkv import digest
from jaxkv import sampling
from jaxkv.cache import Issued


class Counters:
  """The transport's counters (jaxkv.transport.Transport.take_counters) summed over a run's passes: bytes delivered
  (in all and per device), bytes stored back (D2H), the ring's high-water mark (the maximum, in all and per device)
  and the host's dispatches over the decode passes; with debug >= 1 a record of every pass (`steps`).
  on_chunk(rows), if given, runs after each prefill chunk, rows the prompt rows prefilled so far (for monitoring)."""

  def __init__(self, debug: int = 0, on_chunk=None):
    self.debug, self.on_chunk = debug, on_chunk
    self.h2d_bytes = self.d2h_bytes = self.ring_high_water_bytes_per_device = 0
    self.h2d_bytes_by_device: collections.Counter = collections.Counter()
    self.ring_high_water_bytes_by_device: dict[str, int] = {}
    self.decode_dispatches = self.decode_passes = 0
    self.steps: list[dict] = []
    self.t_last = time.perf_counter()

  def add(self, kind: str, transport, issued: Issued, rows: int) -> None:
    """Takes the transport's counters after a pass (kind "prefill": a chunk, or "decode") that issued `issued`
    (its stores' bytes and its jitted calls and transfers besides the deliveries) and left `rows` rows in the
    windows."""
    if kind == "prefill" and self.on_chunk is not None:
      self.on_chunk(rows)
    c = transport.take_counters()
    self.h2d_bytes += c["h2d_bytes"]
    self.d2h_bytes += issued.d2h_bytes
    self.ring_high_water_bytes_per_device = max(
        self.ring_high_water_bytes_per_device, c["ring_high_water_bytes_per_device"]
    )
    self.h2d_bytes_by_device.update(c["h2d_bytes_by_device"])
    hw = self.ring_high_water_bytes_by_device
    for d, b in c["ring_high_water_bytes_by_device"].items():
      hw[d] = max(hw.get(d, 0), b)
    if kind == "decode":
      self.decode_dispatches += c["dispatches"] + issued.calls
      self.decode_passes += 1
    if self.debug >= 1:
      now = time.perf_counter()
      c = dict(c, dispatches=c["dispatches"] + issued.calls)
      self.steps.append(
          dict(kind=kind, window_rows=rows, d2h_bytes=issued.d2h_bytes, host_ms=1e3 * (now - self.t_last), **c)
      )
      self.t_last = now
      if self.debug >= 3:
        logging.info("kv transport: %s", self.steps[-1])

  def totals(self) -> dict:
    """The totals, and dispatches_per_step: the host's jitted calls and transfers per decode step (mean; the pass,
    its deliveries, the head and the copies of its tokens and logits to the host)."""
    return dict(
        h2d_bytes=self.h2d_bytes,
        d2h_bytes=self.d2h_bytes,
        ring_high_water_bytes_per_device=self.ring_high_water_bytes_per_device,
        decode_dispatches=self.decode_dispatches,
        decode_passes=self.decode_passes,
        **self.by_device(),
        dispatches_per_step=self.decode_dispatches / max(self.decode_passes, 1),
    )

  def by_device(self) -> dict:
    return dict(
        h2d_bytes_by_device=dict(self.h2d_bytes_by_device),
        ring_high_water_bytes_by_device=self.ring_high_water_bytes_by_device,
    )


@dataclasses.dataclass
class Record:
  """One owner's (a sequence's, a request's) tokens up to and including its end, the hash of its logits rows
  (None: not hashed), the seconds from the recorder's start to its first token, and how many most likely tokens its
  tokens' log-probabilities list (None: none taken)."""

  max_new_tokens: int
  hash: object | None
  tokens: list[int] = dataclasses.field(default_factory=list)
  done: bool = False
  ttft_s: float | None = None
  logprobs: int | None = None


class Recorder:
  """What the read-back steps gave each owner: `record(owners, logits, tokens)` takes a step whose row b belongs to
  owners[b] (None: nobody's) and appends each live owner's token, until one of the end ids (stop_ids) or its
  max_new_tokens.

  step_hash: also hash every step's logits whole, f32[B, V] in the order [step][row][vocab] (`hash`: generate's
  logits_sha256); keep_logits: keep them (`logits`). Close it when done (its digest thread)."""

  def __init__(self, stop_ids: frozenset[int], step_hash: bool = False, keep_logits: bool = False):
    self.stop_ids = frozenset(stop_ids)
    self.digests = digest.Digests()
    self.hash = self.digests.new() if step_hash else None
    self.logits: list[np.ndarray] | None = [] if keep_logits else None
    self.records: dict[int, Record] = {}
    self.steps_read = 0
    self.t_start = time.perf_counter()

  def add(self, owner: int, max_new_tokens: int, hashed: bool = True, logprobs: int | None = None) -> None:
    self.records[owner] = Record(max_new_tokens, self.digests.new() if hashed else None, logprobs=logprobs)

  def end(self, owner: int) -> None:
    """Records nothing more for the owner (cancelled)."""
    self.records[owner].done = True

  def forget(self, owner: int) -> Record:
    return self.records.pop(owner)

  def record(self, owners: list[int | None], logits: np.ndarray, tokens: np.ndarray) -> list[tuple]:
    """Takes one step (logits f32[B, V], tokens i32[B] on the host); returns (owner, token, end, logprob) for every
    token taken: end "eos" or "length" where it ended its owner, else None; logprob its jaxkv.sampling.logprobs where
    the owner asked for them, else None."""
    self.steps_read += 1
    if self.hash is not None:
      self.digests.update(self.hash, logits)
    if self.logits is not None:
      self.logits.append(logits)
    taken = []
    for b, r in enumerate(owners):
      rec = self.records.get(r)
      if rec is None or rec.done:
        continue
      t = int(tokens[b])
      rec.tokens.append(t)
      if len(rec.tokens) == 1:
        rec.ttft_s = time.perf_counter() - self.t_start
      if rec.hash is not None:
        self.digests.update(rec.hash, logits[b])
      end = "eos" if t in self.stop_ids else "length" if len(rec.tokens) >= rec.max_new_tokens else None
      rec.done = end is not None
      logprob = None if rec.logprobs is None else sampling.logprobs(logits[b], t, rec.logprobs)
      taken.append((r, t, end, logprob))
    return taken

  def all_done(self) -> bool:
    return all(r.done for r in self.records.values())

  def hexdigest(self, h) -> str:
    return self.digests.hexdigest(h)

  def close(self) -> None:
    self.digests.close()
