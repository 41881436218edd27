"""Logits digests: sha256 over the f32 little-endian bits of logits rows, hashed on a thread of their own.

The decode loops read each step's logits f32[B, V] back to record their hash; at batch 8 and a 128k vocabulary that
is 4 MB a step, whose sha256 takes milliseconds of the thread that dispatches the next steps. `Digests` hashes them
on one background thread, in the order given (hashlib releases the GIL while it hashes large buffers), so the
dispatching thread only hands the rows over.
"""

from __future__ import annotations

import concurrent.futures
import hashlib

import numpy as np


class Digests:
  """digest = Digests(); h = digest.new(); digest.update(h, rows); ...; digest.hexdigest(h).

  update(h, rows): appends rows' f32 little-endian bits to hash h (after everything given before, to any hash);
  hexdigest(h) waits for what was given and returns h's hex digest. close() ends the thread."""

  def __init__(self):
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxkv-digest")
    self._last: concurrent.futures.Future | None = None

  @staticmethod
  def new():
    return hashlib.sha256()

  def update(self, h, rows: np.ndarray) -> None:
    self._last = self._pool.submit(h.update, np.ascontiguousarray(rows, "<f4"))

  def hexdigest(self, h) -> str:
    if self._last is not None:
      self._last.result()  # The worker runs in order: everything given before is hashed; raises its error.
    return h.hexdigest()

  def close(self) -> None:
    self._pool.shutdown(wait=True)
