"""Drafters for speculative decoding (jaxkv.spec_decode), on the host in numpy: what a sequence's next tokens
probably are, proposed for one verify pass to check, and the switch that stops proposing where drafts fail.

A drafter proposes, for one sequence, up to k tokens to follow its history (its prompt, then its generated tokens,
the last of which the next pass writes): `propose(b, history, k) -> list[int]`. Two here:
  `PromptLookup` (speculate.mode lookup): the longest suffix of the history of LOOKUP_NGRAMS[0] .. 1 tokens that
    occurred before, its most recent occurrence; it proposes the tokens that followed that occurrence (no model).
  `Oracle` (tests and benchmarks): a known continuation, its first m tokens right and the rest wrong, so that each
    verify pass accepts exactly min(m, k) of them where the continuation is the greedy one.

`Switch` turns proposing off for a sequence whose drafts fail: its accepted tokens per verify, a mean over the last
SWITCH_WINDOW verifies with drafts, below SWITCH_MIN_ACCEPTED, or SWITCH_EMPTY_LOOKUPS lookups in a row that found
nothing (each a pass read back for the drafter, which costs the plain loop its run-ahead). It waits SWITCH_OFF_PASSES
passes, then probes again: one verify, which turns it off again while it fails, for twice as long each time up to
SWITCH_MAX_OFF_PASSES (a full window that proposes by merit resets the wait). A failed verify pass costs more than a
one-token step, so a sequence whose drafts fail costs a few read-back passes per request, and one per
SWITCH_MAX_OFF_PASSES passes in the long run.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np

LOOKUP_NGRAMS = (3, 2, 1)  # Suffix lengths the lookup drafter matches, longest first.
SWITCH_WINDOW = 8  # Verify passes whose accepted tokens the switch averages.
SWITCH_MIN_ACCEPTED = 0.5  # Mean accepted tokens per verify below which a sequence stops proposing.
SWITCH_OFF_PASSES = 32  # Passes a sequence waits when it is switched off first (each probe that fails doubles it).
SWITCH_MAX_OFF_PASSES = 512  # The longest wait.
SWITCH_EMPTY_LOOKUPS = 16  # Lookups in a row that find nothing after which a sequence is switched off.


class PromptLookup:
  """Prompt-lookup drafting: n-gram matches in the sequence's own history (module docstring)."""

  def __init__(self, ngrams: Sequence[int] = LOOKUP_NGRAMS):
    self.ngrams = tuple(ngrams)

  def propose(self, b: int, history: Sequence[int], k: int) -> list[int]:
    """Up to k tokens to follow history (i32 ids, the last one the next to be written): those after the most recent
    earlier occurrence of its longest matching suffix; [] where none occurs."""
    del b
    h = np.asarray(history, np.int64)
    for n in self.ngrams:
      if k <= 0 or len(h) <= n:
        continue
      # Occurrences that start at i < len(h) - n (not the suffix itself), so a token follows each.
      windows = np.lib.stride_tricks.sliding_window_view(h[:-1], n)  # [len(h) - n, n]: starts 0 .. len(h) - n - 1.
      hits = np.flatnonzero(np.all(windows == h[-n:], axis=1))
      if hits.size:
        i = int(hits[-1]) + n
        return h[i : i + k].tolist()
    return []


class Oracle:
  """Proposes a known continuation of each sequence: row b's truth[b] (the tokens after its prompt of
  prompt_lengths[b] tokens, e.g. a plain run's output), its first `right` tokens as they are and the rest of the k
  replaced by a wrong token ((t + 1) % vocab)."""

  def __init__(self, truth: Sequence[Sequence[int]], prompt_lengths: Sequence[int], right: int, vocab: int):
    self.truth, self.lengths, self.right, self.vocab = [list(t) for t in truth], list(prompt_lengths), right, vocab

  def propose(self, b: int, history: Sequence[int], k: int) -> list[int]:
    done = len(history) - self.lengths[b]  # Generated tokens so far; truth[b][done] follows the history.
    nxt = self.truth[b][done : done + k]
    return [t if i < self.right else (t + 1) % self.vocab for i, t in enumerate(nxt)]


class Switch:
  """Per sequence, whether it proposes drafts (module docstring): `on(b)` before a pass, `passed(b, drafted,
  accepted)` after it, or `idle(b, passes)` after passes that did not ask it."""

  def __init__(
      self,
      window: int = SWITCH_WINDOW,
      min_accepted: float = SWITCH_MIN_ACCEPTED,
      off_passes: int = SWITCH_OFF_PASSES,
      max_off_passes: int = SWITCH_MAX_OFF_PASSES,
      empty_lookups: int = SWITCH_EMPTY_LOOKUPS,
  ):
    self.window, self.min_accepted, self.off_passes = window, min_accepted, off_passes
    self.max_off_passes, self.empty_lookups = max_off_passes, empty_lookups
    self._accepted: dict[int, collections.deque] = collections.defaultdict(lambda: collections.deque(maxlen=window))
    self._empty: dict[int, int] = {}  # Sequence -> its lookups in a row that found nothing.
    self._off: dict[int, int] = {}  # Sequence -> passes it still waits.
    self._wait: dict[int, int] = {}  # Sequence -> passes its next switch-off lasts (doubled by each failed probe).
    self.switched_off = 0  # Times a sequence was switched off.

  def on(self, b: int) -> bool:
    return self._off.get(b, 0) == 0

  def off_passes_left(self, b: int) -> int:
    """Passes sequence b still waits before it proposes again (0: it proposes)."""
    return self._off.get(b, 0)

  def forget(self, b: int) -> None:
    """Sequence b starts afresh (a server's slot taking a new request): on, with no verifies seen."""
    for seen in (self._accepted, self._empty, self._off, self._wait):
      seen.pop(b, None)

  def idle(self, b: int, passes: int) -> None:
    """`passes` passes without drafts of a switched-off sequence (at most off_passes_left(b))."""
    self._off[b] -= passes

  def passed(self, b: int, drafted: int | None, accepted: int) -> None:
    """After a pass: drafted, the tokens it proposed (0: it looked and found none; None: it did not look, no room
    for a draft), accepted, how many of them its verify accepted. Its history is kept when it turns off, so that a
    failing probe turns it off again at once."""
    if not self.on(b):
      self._off[b] -= 1
      return
    if drafted is None:
      return
    if not drafted:
      self._empty[b] = self._empty.get(b, 0) + 1
      if self._empty[b] >= self.empty_lookups:
        self._switch_off(b)
      return
    self._empty.pop(b, None)
    seen = self._accepted[b]
    seen.append(accepted)
    if len(seen) < self.window:
      return
    if sum(seen) >= self.min_accepted * self.window:
      self._wait.pop(b, None)  # Proposing by merit: a later switch-off waits off_passes again.
    else:
      self._switch_off(b)

  def _switch_off(self, b: int) -> None:
    wait = self._wait.get(b, self.off_passes)
    self._off[b], self._wait[b] = wait, min(2 * wait, self.max_off_passes)
    self.switched_off += 1
