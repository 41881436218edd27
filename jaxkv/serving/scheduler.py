"""The slot schedule, in plain Python: which request takes which slot when, from token counts alone.

Prompts are right-aligned and every slot writes its next row at the same row `end` (jaxkv.cache), so a request of L
prompt tokens enters a free slot at the current end E with its prompt at rows [E - L, E), which needs L <= E and
E + max_new_tokens - 1 <= capacity (a request without max_new_tokens, None, runs to the capacity from wherever it
enters: it needs only L <= E). Requests enter in order (first in, first out): one that does not fit yet (L > E)
waits while the end moves on, and those behind it wait too; one that cannot fit before the capacity runs out waits
until every slot is free, and the next epoch starts a fresh cache with the first requests of the queue that fit
together. The schedule depends on the requests' sizes and ends only, so every delivery mode makes the same choices.
"""

from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass(frozen=True)
class Slot:
  """A slot's request and the last row its decode writes (the row of its first token + max_new_tokens - 2; the
  capacity's last row without max_new_tokens)."""

  request: int
  last_row: int


class Scheduler:
  """The queue and the slots of a run: `submit` and `end` requests; per epoch `open_epoch`, then per step `free`,
  `admit`, `need`."""

  def __init__(self, capacity: int):
    self.capacity = capacity
    self.queue: collections.deque[int] = collections.deque()
    self.sizes: dict[int, tuple[int, int | None]] = {}  # Request -> (prompt length, max_new_tokens), until it ends.
    self.slots: list[Slot | None] = []
    self.ended: set[int] = set()  # Ended requests whose slot is not freed yet.

  def submit(self, r: int, prompt_length: int, max_new_tokens: int | None) -> None:
    self.sizes[r] = (prompt_length, max_new_tokens)
    self.queue.append(r)

  def end(self, r: int) -> None:
    """Request r ended (its last token, or cancelled): out of the queue, its slot freed at the next `free`."""
    if r in self.queue:
      self.queue.remove(r)
    self.sizes.pop(r, None)
    self.ended.add(r)

  def _fit(self, rs: list[int], end: int | None = None) -> bool:
    """Whether requests rs fit together in a fresh cache (end None: the end is their longest prompt), or enter at
    `end`."""
    lengths = [self.sizes[r][0] for r in rs]
    end = max(lengths) if end is None else end
    return max(lengths) <= end and all(self.last_row(r, end) < self.capacity for r in rs)

  def last_row(self, r: int, end: int) -> int:
    """The last row that request r's decode writes when it enters at `end`."""
    n = self.sizes[r][1]
    return self.capacity - 1 if n is None else end + n - 2

  def open_epoch(self, slots: int) -> tuple[list[int | None], int]:
    """A fresh cache of `slots` slots: its first requests (the queue's first one, then those behind it while they
    fit with it), one per slot, None for an empty slot; returns them and the end, their longest prompt."""
    first = [self.queue.popleft()]  # Fits alone (validated).
    while self.queue and len(first) < slots and self._fit(first + [self.queue[0]]):
      first.append(self.queue.popleft())
    end = max(self.sizes[r][0] for r in first)
    owners = first + [None] * (slots - len(first))
    self.slots = [None if r is None else Slot(r, self.last_row(r, end)) for r in owners]
    self.ended.clear()
    return owners, end

  def free(self) -> None:
    """Frees the slots of the requests that ended."""
    self.slots = [None if s is None or s.request in self.ended else s for s in self.slots]
    self.ended.clear()

  def admit(self, end: int) -> list[tuple[int, int]]:
    """The requests that enter free slots at `end`, in order, as (slot, request)."""
    entered = []
    while self.queue and None in self.slots and self._fit([self.queue[0]], end):
      r = self.queue.popleft()
      b = self.slots.index(None)
      self.slots[b] = Slot(r, self.last_row(r, end))
      entered.append((b, r))
    return entered

  def need(self) -> int:
    """The last row a slot's decode writes (-1 with every slot free): decode runs while end <= need."""
    return max((s.last_row for s in self.slots if s is not None), default=-1)

  def owners(self) -> list[int | None]:
    """Each slot's request (None: free)."""
    return [None if s is None else s.request for s in self.slots]
