"""Continuous batching: an engine thread serves requests as they arrive, through a bounded queue.

`ServingLoop` owns a jaxkv.serving.Server and the one thread that runs JAX. `submit` (from any thread) validates a
request and queues it, or raises `QueueFull` when `max_queue` requests already wait for a slot. Before each decode
step the thread takes what arrived, so a request that comes while others decode takes a free slot at the next step
(jaxkv.serving's schedule: first in, first out; it enters at the current end E when its prompt fits, L <= E; a fresh
epoch when nothing fits) and the others' tokens do not change. Each token is reported as it is read back
(`on_token`, called on the engine thread), and `Handle.cancel()` ends a request before the next step, freeing its
slot. `stop()` lets the requests in flight finish, then ends the thread.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
from collections.abc import Callable

from absl import logging

from jaxkv import serving

# Why a request ended: "eos", "length" (max_new_tokens), "cancelled" (Handle.cancel), "error" (the engine failed).
ENDS = ("eos", "length", "cancelled", "error")


class QueueFull(Exception):
  """max_queue requests already wait for a slot."""


class Closed(Exception):
  """The loop is stopping (or has stopped) and takes no new requests."""


class Handle:
  """One submitted request. on_token(token) and on_end(reason, error) run on the engine thread; on_end runs once,
  last, with a reason from ENDS (error: the exception's text for "error", else None)."""

  def __init__(self, request: serving.Request, on_token: Callable[[int], None], on_end: Callable[[str, str], None]):
    self.request, self.on_token, self.on_end = request, on_token, on_end
    self.cancelled = False

  def cancel(self) -> None:
    """Ends the request before the next decode step (safe from any thread, also after it ended)."""
    self.cancelled = True


@dataclasses.dataclass
class Stats:
  """Counters since start (read by the metrics endpoint from another thread)."""

  requests: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # By end reason.
  prompt_tokens: int = 0
  tokens: int = 0
  waiting: int = 0  # Submitted, not yet in a slot.
  busy: int = 0  # Requests in a slot.
  recent: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=64))  # [s, tokens].


class ServingLoop:
  """Serves submitted requests on the server's slots, on a thread of its own (start() it)."""

  def __init__(self, server: serving.Server, max_queue: int):
    if max_queue < 1:
      raise ValueError(f"max_queue must be >= 1, got {max_queue}")
    self.server, self.max_queue = server, max_queue
    self.stats = Stats()
    self._lock = threading.Lock()
    self._inbox: queue.SimpleQueue = queue.SimpleQueue()
    self._closing = False
    self._run = _LiveRun(self)
    self._thread = threading.Thread(target=self._main, name="jaxkv-engine", daemon=True)

  @property
  def parallel(self) -> int:
    return self.server.parallel

  @property
  def alive(self) -> bool:
    return self._thread.is_alive() and not self._closing

  def start(self) -> ServingLoop:
    self._thread.start()
    return self

  def submit(self, request: serving.Request, on_token, on_end) -> Handle:
    """Queues a request; ValueError when it cannot run (empty, past the capacity...), QueueFull, Closed."""
    self.server.engine.validate([request.prompt], request.max_new_tokens)
    handle = Handle(request, on_token, on_end)
    with self._lock:
      if self._closing:
        raise Closed("the server is shutting down")
      if self._thread.ident is not None and not self._thread.is_alive():
        raise Closed("the serving loop has stopped (its log says why)")
      if self.stats.waiting >= self.max_queue:
        raise QueueFull(f"{self.stats.waiting} requests already wait for a slot (the queue holds {self.max_queue})")
      self.stats.waiting += 1
      self.stats.prompt_tokens += len(request.prompt)
    self._inbox.put(handle)
    return handle

  def stop(self, timeout: float | None = None) -> None:
    """Takes no new requests, lets those in flight finish, and ends the thread (waits up to `timeout` s)."""
    with self._lock:
      self._closing = True
    self._inbox.put(None)
    if self._thread.is_alive():
      self._thread.join(timeout)

  def transport(self) -> collections.Counter:
    """The transport counters so far (h2d_bytes, ring_high_water_bytes_per_device, insertions)."""
    return collections.Counter(self._run.totals)

  def tokens_per_second(self, window_s: int = 10) -> float:
    """Tokens read back per second over the last `window_s` whole seconds."""
    now = int(time.monotonic())
    return sum(n for s, n in list(self.stats.recent) if now - window_s <= s < now) / window_s

  def _main(self) -> None:
    try:
      self._serve()
    finally:
      self._run.digests.close()

  def _serve(self) -> None:
    run, epoch = self._run, 0
    while True:
      run.arrivals(block=not run.queue)
      if not run.queue:
        if self._closing and not run.handles:
          return
        continue
      try:
        run.epoch(epoch)
      except Exception as e:  # pylint: disable=broad-except  (the server keeps serving; the requests hear why)
        logging.exception("serving loop: epoch %d failed", epoch)
        run.fail(f"{type(e).__name__}: {e}")
      epoch += 1


class _LiveRun(serving._Run):  # pylint: disable=protected-access
  """A serving run that takes requests as they arrive; request r's records are dropped when it ends."""

  def __init__(self, loop: ServingLoop):
    super().__init__(loop.server, [], None, batch=loop.server.parallel)
    self.loop = loop
    self.handles: dict[int, Handle] = {}

  def arrivals(self, block: bool = False) -> None:
    """Takes the submitted requests (waits for one when `block`) and ends the cancelled ones."""
    while True:
      try:
        handle = self.loop._inbox.get(block=block)  # pylint: disable=protected-access
      except queue.Empty:
        break
      block = False
      if handle is None:  # stop() woke us.
        continue
      r = len(self.requests)
      self.requests.append(handle.request)
      self.tokens.append([])
      self.hashes.append(None)  # Nobody reads a live request's logits hash: none is computed.
      self.done.append(False)
      self.where.append(None)
      self.errors.append(None)
      self.ttft_s.append(None)
      self.queue.append(r)
      self.handles[r] = handle
    for r in [r for r, h in self.handles.items() if h.cancelled]:
      if self.where[r] is None:
        self.queue.remove(r)
      self._end(r, "cancelled")

  def placed(self, r, slot, epoch, first_row) -> None:
    super().placed(r, slot, epoch, first_row)
    with self.loop._lock:  # pylint: disable=protected-access
      self.loop.stats.waiting -= 1
      self.loop.stats.busy += 1

  def emitted(self, r, token, end) -> None:
    stats, second = self.loop.stats, int(time.monotonic())
    stats.tokens += 1
    if stats.recent and stats.recent[-1][0] == second:
      stats.recent[-1][1] += 1
    else:
      stats.recent.append([second, 1])
    try:
      self.handles[r].on_token(token)
    except Exception:  # pylint: disable=broad-except  (a client's callback must not stop the engine)
      logging.exception("serving loop: on_token of request %d failed", r)
      self.handles[r].cancel()
    if end is not None:
      self._end(r, end)

  def fail(self, error: str) -> None:
    """Ends every request in flight or waiting with "error" (the epoch that served them failed)."""
    self.queue.clear()
    for r in list(self.handles):
      self._end(r, "error", error)

  def _end(self, r: int, reason: str, error: str | None = None) -> None:
    self.done[r] = True
    handle = self.handles.pop(r)
    self.requests[r] = self.tokens[r] = self.hashes[r] = None  # A long-running server keeps no prompts or tokens.
    with self.loop._lock:  # pylint: disable=protected-access
      stats = self.loop.stats
      stats.requests[reason] += 1
      if self.where[r] is None:
        stats.waiting -= 1
      else:
        stats.busy -= 1
    try:
      handle.on_end(reason, error)
    except Exception:  # pylint: disable=broad-except  (a client's callback must not stop the engine)
      logging.exception("serving loop: on_end of request %d failed", r)
