"""The slot schedule in plain Python (no JAX): first in, first out, a request enters a free slot at the current end
when its prompt fits below it and its tokens before the capacity, an epoch's first requests fit together."""

from jaxkv.serving.scheduler import Scheduler, Slot


def _scheduler(capacity, *sizes):
  s = Scheduler(capacity)
  for r, (length, new) in enumerate(sizes):
    s.submit(r, length, new)
  return s


def test_an_epoch_takes_the_first_requests_that_fit_together():
  s = _scheduler(40, (10, 5), (30, 4), (20, 30), (5, 2))
  owners, end = s.open_epoch(4)
  # Request 2 (20 rows + 30 tokens) past the capacity beside request 1's 30-row prompt: it and those behind it wait.
  assert (owners, end) == ([0, 1, None, None], 30)
  assert s.slots == [Slot(0, 30 + 5 - 2), Slot(1, 30 + 4 - 2), None, None] and list(s.queue) == [2, 3]
  assert s.need() == 33 and s.owners() == [0, 1, None, None]


def test_a_waiting_request_enters_a_free_slot_once_its_prompt_fits_below_the_end():
  s = _scheduler(64, (8, 4), (12, 6), (3, 3))
  owners, end = s.open_epoch(1)
  assert (owners, end) == ([0], 8)
  assert s.admit(end) == []  # No free slot.
  s.end(0)
  s.free()
  assert s.admit(8) == []  # Request 1's 12 prompt rows do not fit below row 8, and request 2 waits behind it.
  assert s.admit(12) == [(0, 1)] and s.slots == [Slot(1, 12 + 6 - 2)] and list(s.queue) == [2]


def test_a_request_that_cannot_finish_before_the_capacity_waits_for_the_next_epoch():
  s = _scheduler(20, (4, 3), (4, 10))
  owners, end = s.open_epoch(2)
  assert owners == [0, 1] and end == 4
  s.submit(2, 2, 10)
  assert s.admit(15) == []  # A free slot? None yet.
  s.end(0)
  s.free()
  assert s.admit(15) == []  # 15 + 10 - 1 > 20: it waits for every slot to free, then a fresh epoch.
  s.end(1)
  s.free()
  assert s.need() == -1 and list(s.queue) == [2]
  assert s.open_epoch(2) == ([2, None], 2)


def test_ending_a_waiting_request_takes_it_out_of_the_queue():
  s = _scheduler(64, (4, 3), (5, 3), (6, 3))
  s.open_epoch(1)
  s.end(1)  # Cancelled while waiting.
  s.end(0)
  s.free()
  assert list(s.queue) == [2] and s.admit(6) == [(0, 2)]


def test_a_request_without_max_new_tokens_reserves_nothing_and_ends_at_the_capacity():
  # Capacity reserved up front (max_new_tokens = capacity - L + 1), each would fit only at end = its own prompt.
  s = _scheduler(40, (10, None), (30, None), (20, 31), (5, None))
  owners, end = s.open_epoch(4)
  assert (owners, end) == ([0, 1, None, None], 30)  # Request 2's 31 tokens do not fit from row 30: it waits.
  assert s.slots[:2] == [Slot(0, 39), Slot(1, 39)] and s.need() == 39
  s.end(0)
  s.free()
  assert s.admit(35) == []  # Request 2 first: it fits in the next epoch only.
  s.end(2)
  assert s.admit(40) == [(0, 3)] and s.slots[0] == Slot(3, 39)  # At the capacity: one token, from its prefill.
