"""Continuous batching: an engine thread serves requests as they arrive, through a bounded queue.

`ServingLoop` owns a jaxkv.serving.server.Server and the one thread that runs JAX, which serves one Run, iterating
over its epochs: between two steps the loop's feed (`_Feed`) hands out what the run did and gives it what arrived. `submit` (from any thread) validates a request and queues it, or raises `QueueFull` when
`max_queue` requests already wait for a slot. Before each decode step the thread takes what arrived, so a request that
comes while others decode takes a free slot at the next step (jaxkv.serving.scheduler: first in, first out; it enters
at the current end E when its prompt fits, L <= E; a fresh epoch when nothing fits) and the others' tokens do not
change. Each token is reported as it is read back
(`on_token`, called on the engine thread), and `Handle.cancel()` ends a request before the next step, freeing its
slot. `stop()` lets the requests in flight finish, then ends the thread.

Each slot remembers the tokens of the request it served last, prompt and those handed out (`conversation`): `save`,
`restore` and `erase` queue a jaxkv.serving.slot_files job for them, which the thread runs one unit between two
decode steps (or while no request runs), and return its future.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import queue
import threading
import time
from collections.abc import Callable

from absl import logging

from jaxkv.serving import server as server_lib
from jaxkv.serving import slot_files
from jaxkv.serving.requests import Request

# Why a request ended: "eos", "length" (max_new_tokens), "cancelled" (Handle.cancel), "error" (the engine failed).
ENDS = ("eos", "length", "cancelled", "error")


class QueueFull(Exception):
  """max_queue requests already wait for a slot."""


class Closed(Exception):
  """The loop is stopping (or has stopped) and takes no new requests."""


class Handle:
  """One submitted request. on_token(token, logprob) and on_end(reason, error) run on the engine thread (logprob:
  jaxkv.sampling.logprobs's where the request asked for them, else None); on_end runs once, last, with a reason from
  ENDS (error: the exception's text for "error", else None). A token in `eos_ids` is the request's last (reason
  "eos"), as the engine's own end ids are; `placed_s` is when it entered a slot (time.perf_counter(); None before)."""

  def __init__(
      self,
      request: Request,
      on_token: Callable[[int, tuple], None],
      on_end: Callable[[str, str], None],
      eos_ids: frozenset[int] = frozenset(),
  ):
    self.request, self.on_token, self.on_end, self.eos_ids = request, on_token, on_end, eos_ids
    self.cancelled = False
    self.placed_s: float | None = None
    self.cached_tokens = 0  # Its prompt tokens taken from the prefix cache (set when it takes a slot).
    self.tokens: list[int] = []  # The tokens handed out so far.
    self.prompt_logprobs: list | None = None  # Where it asked: set when it takes a slot, before its first token.

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
  epoch_running: bool = False  # An epoch (a cache and its slots) is under way: a request that comes joins it.
  recent: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=64))  # [s, tokens].


class ServingLoop:
  """Serves submitted requests on the server's slots, on a thread of its own (start() it)."""

  def __init__(self, server: server_lib.Server, max_queue: int):
    if max_queue < 1:
      raise ValueError(f"max_queue must be >= 1, got {max_queue}")
    self.server, self.max_queue = server, max_queue
    self.stats = Stats()
    self._lock = threading.Lock()  # Guards stats and the closing flag.
    self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # Submitted handles; None wakes the thread.
    self._closing = False
    # Nobody reads a live request's logits hash: none is computed.
    self._run = server_lib.Run(server, batch=server.parallel, hashed=False)
    self._feed = _Feed(self._run, self._inbox, self.stats, self._lock)
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

  def submit(self, request: Request, on_token, on_end, eos_ids: frozenset[int] = frozenset()) -> Handle:
    """Queues a request (ending at a token of `eos_ids` too); ValueError when it cannot run (empty, past the
    capacity...), QueueFull, Closed."""
    self.server.engine.validate([request.prompt], request.max_new_tokens or 1)
    self.server.check(request)
    handle = Handle(request, on_token, on_end, eos_ids)
    with self._lock:
      if self._closing:
        raise Closed("the server is shutting down")
      if self._thread.ident is not None and not self._thread.is_alive():
        raise Closed("the serving loop has stopped (its log says why)")
      if self.stats.waiting >= self.max_queue:
        raise QueueFull(f"{self.stats.waiting} requests already wait for a slot (the queue holds {self.max_queue})")
      self.stats.waiting += 1
      self.stats.prompt_tokens += len(request.prompt)
      self._inbox.put(handle)  # Under the lock: before stop()'s wake-up, which the loop takes last.
    return handle

  def conversation(self, slot: int) -> tuple[int, ...] | None:
    """The tokens of slot `slot`'s last request, prompt and generated, or those restored into it (None: neither)."""
    self._check_slot(slot)
    return self._feed.conversations[slot]

  def save(self, slot: int) -> concurrent.futures.Future:
    """Reads back the KV blocks of the slot's conversation (future: jaxkv.serving.slot_files.Saved); ValueError
    when it has none."""
    tokens = self.conversation(slot)
    if tokens is None:
      raise ValueError(f"slot {slot} holds no conversation: it served no request since the start or its erase")
    return self._queue(slot_files.Save(tokens))

  def restore(self, slot: int, saved: slot_files.Saved, filename: str) -> concurrent.futures.Future:
    """Puts a saved conversation's blocks into the prefix cache and makes it the slot's (future: its tokens)."""
    self._check_slot(slot)
    future = self._queue(slot_files.Restore(saved, filename))

    def restored(f: concurrent.futures.Future) -> None:
      if f.exception() is None:
        self._remember(slot, f.result())

    future.add_done_callback(restored)
    return future

  def erase(self, slot: int) -> concurrent.futures.Future:
    """Forgets the slot's conversation and drops its blocks from the prefix cache (future: its token count)."""
    tokens = self.conversation(slot) or ()
    future = self._queue(slot_files.Erase(tokens))
    future.add_done_callback(lambda _: self._remember(slot, None))
    return future

  def _remember(self, slot: int, tokens: tuple[int, ...] | None) -> None:
    self._feed.conversations[slot] = tokens

  def _check_slot(self, slot: int) -> None:
    if not 0 <= slot < self.parallel:
      raise ValueError(f"slot {slot} does not exist: the server has slots 0..{self.parallel - 1}")

  def _queue(self, job: slot_files.Job) -> concurrent.futures.Future:
    with self._lock:
      if self._closing or (self._thread.ident is not None and not self._thread.is_alive()):
        raise Closed("the serving loop is not running")
      self._inbox.put(job)  # Under the lock: before stop()'s wake-up, which the loop takes last.
    return job.future

  def stop(self, timeout: float | None = None) -> bool:
    """Takes no new requests, lets those in flight finish, and ends the thread (waits up to `timeout` s); returns
    whether it ended."""
    with self._lock:
      self._closing = True
      self._inbox.put(None)
    if self._thread.is_alive():
      self._thread.join(timeout)
    return not self._thread.is_alive()

  def slots(self) -> list[dict]:
    """Each slot's state (llama-server's GET /slots): id, the request it serves (id_task, -1 when idle),
    is_processing, n_ctx, its prompt's token count and the tokens it generated so far. Read from another thread: a
    snapshot as of a recent step."""
    run, capacity = self._run, self.server.engine.config.engine.capacity
    held = list(run.scheduler.slots)
    out = []
    for b in range(self.parallel):
      r = held[b].request if b < len(held) and held[b] is not None else None
      request, record = run.requests.get(r), run.recorder.records.get(r)
      tokens = [] if record is None else list(record.tokens)
      out.append(
          {
              "id": b,
              "id_task": -1 if request is None else r,
              "is_processing": request is not None,
              "n_ctx": capacity,
              "n_prompt_tokens": 0 if request is None else len(request.prompt),
              "n_decoded": len(tokens),
              "tokens": tokens,
          }
      )
    return out

  def transport(self) -> collections.Counter:
    """The transport counters so far (h2d_bytes, ring_high_water_bytes_per_device, insertions)."""
    return collections.Counter(self._run.totals)

  def speculated(self) -> collections.Counter:
    """Speculative decoding's draft tokens so far: drafted (proposed to verify passes) and accepted (recorded as
    tokens; jaxkv.serving.server.Run.speculated)."""
    return collections.Counter(self._run.speculated)

  def tokens_per_second(self, window_s: int = 10) -> float:
    """Tokens read back per second over the last `window_s` whole seconds."""
    now = int(time.monotonic())
    return sum(n for s, n in list(self.stats.recent) if now - window_s <= s < now) / window_s

  def _main(self) -> None:
    try:
      self._serve()
    finally:
      self._run.close()

  def _serve(self) -> None:
    run, feed = self._run, self._feed
    while True:
      # Closing, it waits for nothing: stop()'s wake-up may have been taken inside the last epoch.
      feed.take(block=not run.scheduler.queue and not run.jobs and not self._closing)
      if not run.scheduler.queue:
        if run.jobs:
          run.work()
        elif self._closing and not feed.handles:
          return
        continue
      self.stats.epoch_running = True
      try:
        for progress in run.epoch():  # Before each scheduling decision: what the run did, then what arrived.
          feed.report(progress)
          feed.take()
      except Exception as e:  # pylint: disable=broad-except  (the server keeps serving; the requests hear why)
        logging.exception("serving loop: epoch %d failed", run.epochs - 1)
        feed.fail(f"{type(e).__name__}: {e}")
      finally:
        self.stats.epoch_running = False


class _Feed:
  """Between the loop and its run: feeds the run the submitted requests as they arrive and ends the cancelled ones
  (`take`), hands each request's tokens and end to its handle and keeps the stats (`report`); a request's records are
  dropped when it ends."""

  def __init__(self, run: server_lib.Run, inbox: queue.SimpleQueue, stats: Stats, lock: threading.Lock):
    self.run, self.inbox, self.stats, self.lock = run, inbox, stats, lock
    self.handles: dict[int, Handle] = {}
    self.placed: set[int] = set()
    self.conversations: list[tuple[int, ...] | None] = [None] * run.server.parallel  # ServingLoop.conversation.

  def take(self, block: bool = False) -> None:
    """Takes the submitted requests and slot jobs (waits for one when `block`) and ends the cancelled requests."""
    while True:
      try:
        handle = self.inbox.get(block=block)
      except queue.Empty:
        break
      block = False
      if isinstance(handle, slot_files.Job):
        self.run.jobs.append(handle)
      elif handle is not None:  # None: stop() woke us.
        self.handles[self.run.submit(handle.request)] = handle
    for r in [r for r, h in self.handles.items() if h.cancelled]:
      self._end(r, "cancelled")

  def report(self, progress: server_lib.Progress) -> None:
    """Hands out what the run did: requests placed, tokens read (each to its handle, an end ending it)."""
    for r, *_, cached in progress.placed:
      self.placed.add(r)
      if r in self.handles:
        self.handles[r].cached_tokens = cached
        self.handles[r].placed_s = time.perf_counter()
      with self.lock:
        self.stats.waiting -= 1
        self.stats.busy += 1
    for r, entries in progress.prompt_logprobs:
      if r in self.handles:
        self.handles[r].prompt_logprobs = entries
    for r, token, end, logprob in progress.tokens:
      if r in self.handles:  # Not ended meanwhile.
        self._token(r, token, end, logprob)

  def _token(self, r: int, token: int, end: str | None, logprob: tuple | None) -> None:
    if self.handles[r].cancelled:  # Since the last take: the token is not handed out.
      self._end(r, "cancelled")
      return
    stats, second = self.stats, int(time.monotonic())
    stats.tokens += 1
    if stats.recent and stats.recent[-1][0] == second:
      stats.recent[-1][1] += 1
    else:
      stats.recent.append([second, 1])
    self.handles[r].tokens.append(token)
    try:
      self.handles[r].on_token(token, logprob)
    except Exception:  # pylint: disable=broad-except  (a client's callback must not stop the engine)
      logging.exception("serving loop: on_token of request %d failed", r)
      self.handles[r].cancel()
    if end is None and token in self.handles[r].eos_ids:
      end = "eos"
    if end is not None:
      self._end(r, end)

  def fail(self, error: str) -> None:
    """Ends every request in flight or waiting with "error" (the epoch that served them failed), after handing out
    what the epoch did before it failed."""
    self.report(self.run.take_progress())
    for r in list(self.handles):
      self._end(r, "error", error)

  def _end(self, r: int, reason: str, error: str | None = None) -> None:
    handle = self.handles.pop(r)
    if r in self.run.where:  # Placed: its slot's conversation.
      self.conversations[self.run.where[r][0]] = handle.request.prompt + tuple(handle.tokens)
    self.run.end(r)
    self.run.forget(r)
    with self.lock:
      self.stats.requests[reason] += 1
      if r in self.placed:
        self.placed.discard(r)
        self.stats.busy -= 1
      else:
        self.stats.waiting -= 1
    try:
      handle.on_end(reason, error)
    except Exception:  # pylint: disable=broad-except  (a client's callback must not stop the engine)
      logging.exception("serving loop: on_end of request %d failed", r)
