"""Speculative decoding over the cache: each pass verifies a drafted continuation of every sequence.

A verify pass is the decode pass (jaxkv.decode.decode_pass) with T = k + 1 tokens per sequence: the last generated
token and k drafted ones (jaxkv.speculate), written at rows end .. end + k of the open page, token i attending rows
[start_b, end + i] with the leaves anchored at end + i (jaxkv.model.decode_layer): one pass over the cache, which is
what a step costs where the cache streams. The head (jaxkv.jitted.verify_head, jaxkv.sampling.verify_row) takes each
position's token and row b's accepted count a_b (greedy: the drafts equal to those tokens; sampled: the standard
rejection rule); the tokens and counts are read back every pass (the drafter needs them). The batch shares `end`, so
every sequence advances by n = min_b a_b + 1 rows (the live ones'): its tokens at positions 0 .. n - 1 are recorded
as n one-token steps (logits [B, V] each, as the plain loop records them), and a greedy sequence's further verified
tokens head its next draft (a sampled one's are drawn again from their keys: docs/design.md).

Rollback is moving `end`: rows above it, written for rejected drafts, are never read (a row is attended only by
tokens at or after it, each of which first writes it) and are written again before it is accepted. Rows reach a
window only when the open page fills, which a one-token step does: a verify pass never accepts the page's last row
(its drafts stop two rows before the page's end), so the page grows as in the plain loop and no stored row is ever
a rejected one. A pass with no drafts (none found, switched off, the page's last rows) is a one-token step.

A drafter with a cache of its own (jaxkv.self_draft) fills it after the prefill (Speculator.begin), drafts every live
row in one call (Speculator.drafts: each row's history with its pending tokens, the tokens it wants, and `end`, below
which the rows are verified: its own rows from `end` on held drafts) and is closed after the run.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import numpy as np

from jaxkv import decode
from jaxkv.cache import Issued
from jaxkv.speculate import Switch

VERIFY_CALLS = 4  # A pass's calls besides its layers: the embedding, the meta, the verify head, its read-back.


@dataclasses.dataclass
class Stats:
  """What speculation did in a run: passes (all), verify passes (those with drafts), tokens recorded, and per
  verify pass and live sequence the tokens it drafted and accepted (histogram: accepted[a] = how often a of them)."""

  k: int
  passes: int = 0
  verify_passes: int = 0
  tokens: int = 0
  drafted: int = 0
  accepted: int = 0
  switched_off: int = 0
  histogram: list[int] = dataclasses.field(default_factory=list)
  decode_s: float = 0.0
  draft: dict | None = None  # The drafter's own telemetry (Speculator.summary), where it has one.

  def summary(self) -> dict:
    """For the telemetry: the counts, tokens per pass, accepted tokens per verify (mean), and tok/s of the loop."""
    verifies = max(sum(self.histogram), 1)
    return dict(
        k=self.k,
        passes=self.passes,
        verify_passes=self.verify_passes,
        tokens=self.tokens,
        tokens_per_pass=self.tokens / max(self.passes, 1),
        drafted=self.drafted,
        accepted=self.accepted,
        accepted_per_verify=self.accepted / verifies,
        accepted_histogram=list(self.histogram),
        switched_off=self.switched_off,
        tok_s=self.tokens / self.decode_s if self.decode_s else None,
        **({} if self.draft is None else dict(draft=self.draft)),
    )


class Speculator:
  """A drafter (jaxkv.speculate: propose(b, history, k); or one that drafts the batch at once over a cache of its
  own, jaxkv.self_draft.SelfDraft: begin, propose_batch, close, summary) with its switch, and each sequence's verified
  tokens not yet recorded (`pending`, the head of its next draft)."""

  def __init__(self, drafter, k: int, switch: Switch | None = None):
    self.drafter, self.k, self.switch = drafter, k, switch
    self.pending: dict[int, list[int]] = {}
    self._looked: set[int] = set()  # Rows whose drafter was asked for this pass's draft (Switch.passed's drafted).

  def draft(self, b: int, history: list[int], cap: int) -> list[int]:
    """Row b's draft of at most cap tokens: its pending tokens, then the drafter's (where its switch is on)."""
    head = self.pending.get(b, [])[:cap]
    if len(head) < cap and (self.switch is None or self.switch.on(b)):
      self._looked.add(b)
      head = head + list(self.drafter.propose(b, history + head, cap - len(head)))[: cap - len(head)]
    return head

  def drafts(self, histories: dict[int, list[int]], cap: int, end: int) -> dict[int, list[int]]:
    """Each live row's draft of at most cap tokens (histories[b]: its prompt and recorded tokens, the last at row
    `end`): its pending tokens, then the drafter's where its switch is on; a batch drafter proposes for every row in
    one call."""
    if not hasattr(self.drafter, "propose_batch"):
      return {b: self.draft(b, h, cap) for b, h in histories.items()}
    heads = {b: self.pending.get(b, [])[:cap] for b in histories}
    wants = {b: cap - len(heads[b]) if self.switch is None or self.switch.on(b) else 0 for b in histories}
    self._looked.update(b for b, n in wants.items() if n > 0)
    if not any(wants.values()):
      return heads
    more = self.drafter.propose_batch({b: h + heads[b] for b, h in histories.items()}, wants, end)
    return {b: heads[b] + more[b][: wants[b]] for b in histories}

  def begin(self, gen) -> None:
    """After the run's prefill (its generation `gen`): a drafter with a cache of its own fills it."""
    if hasattr(self.drafter, "begin"):
      self.drafter.begin(gen)

  def close(self) -> None:
    if hasattr(self.drafter, "close"):
      self.drafter.close()

  def summary(self) -> dict | None:
    """The drafter's telemetry (a drafter with a cache of its own), else None."""
    return self.drafter.summary() if hasattr(self.drafter, "summary") else None

  def idle_passes(self, b: int) -> int:
    """Passes for which row b certainly drafts nothing: switched off, nothing pending (0 where it may draft)."""
    return 0 if self.switch is None or self.pending.get(b) else self.switch.off_passes_left(b)

  def passed(self, b: int, drafted: int, accepted: int, pending: list[int]) -> None:
    """After a pass: row b drafted `drafted` tokens (its drafter asked or not) and accepted `accepted`; `pending`
    heads its next draft, unless its switch turned it off (the plain steps give those tokens again)."""
    looked = b in self._looked
    self._looked.discard(b)
    if self.switch is not None:
      self.switch.passed(b, drafted if drafted or looked else None, accepted)
    self.pending[b] = pending if self.switch is None or self.switch.on(b) else []

  def verified(self, b: int, drafted: int, accepted: int, n: int, tokens: np.ndarray, sampled: bool) -> None:
    """After a verify pass that recorded n tokens of every row: row b drafted `drafted`, accepted `accepted`,
    tokens i32[T] its verified ones. A greedy row's tokens n .. accepted head its next draft; a sampled row keeps only
    what was recorded (position n's decision is made again, from its key, next pass)."""
    if sampled:
      self.passed(b, drafted, min(accepted, n), [])
    else:
      self.passed(b, drafted, accepted, tokens[n : accepted + 1].tolist())

  def stepped(self, b: int, passes: int) -> None:
    """After `passes` one-token steps of the plain loop: row b's pending tokens are recorded by them (dropped), and a
    switched-off row waited that many passes (at most idle_passes(b))."""
    self.pending.pop(b, None)
    if self.switch is not None and not self.switch.on(b):
      self.switch.idle(b, passes)

  def forget(self, b: int) -> None:
    """Row b starts a new sequence (a server's slot taking a request): nothing pending, its switch afresh."""
    self.pending.pop(b, None)
    self._looked.discard(b)
    if self.switch is not None:
      self.switch.forget(b)


def plain_state(engine, gen, tokens: np.ndarray, index: np.ndarray, settings, prompts=None):
  """The plain loop's decode state (jaxkv.meta.DecodeState) after verify passes, its next pass at gen.end: tokens
  i32[B] each row's last recorded token (host; the pass writes it), index i32[B] the token index each row samples
  next, settings the rows' jaxkv.sampling.SamplingParams (host arrays), prompts as engine.state's."""
  state = engine.state(engine.embed(tokens), gen.start, gen.end, settings, prompts)
  return dataclasses.replace(state, index=engine.put(index, np.int32))


def _plain_steps(engine, gen, recorder, owners, prompts, settings, steps: int, on_step) -> int:
  """`steps` one-token steps of the plain loop (jaxkv.decode.DecodeLoop: the head samples on the device, each step
  read back READ_LAG steps behind), from each row's last recorded token, sampled with `settings`
  (jaxkv.sampling.SamplingParams host arrays) at each row's token index. Returns the passes run."""
  records = [recorder.records[o] for o in owners]
  tokens, index = np.array([r.tokens[-1] for r in records], np.int32), np.array([len(r.tokens) for r in records])
  state = plain_state(engine, gen, tokens, index, settings, prompts)
  loop = decode.DecodeLoop(engine, gen, recorder)
  for i in range(steps):
    state = loop.step(state, list(owners), next_pass=i < steps - 1, run_ahead=False)
    while loop.lagging() or (i == steps - 1 and loop.pending):
      step, _ = loop.read()
      if on_step is not None:
        on_step(step.index, gen.cache)
  return steps


def verify_pass(
    engine, gen, tokens: np.ndarray, drafts: dict[int, list[int]], t: int, params, index: np.ndarray, next_pass: bool
):
  """One pass of generation `gen` at its end over T = t tokens per row (t = 1: a one-token step through the verify
  head): tokens i32[B] each row's last token (host), drafts row -> its draft (at most t - 1 tokens; rows left out
  draft none), params the rows' jaxkv.sampling.SamplingParams on the devices, index i32[B] each row's token index of
  position 0. Returns, on the host, logits f32[B, t, V], the verified tokens i32[B, t] and accepted i32[B]
  (jaxkv.jitted.verify_head); gen.end has moved by one row (the caller sets it to end + n)."""
  batch, end = len(tokens), gen.end
  proposed = np.zeros((batch, t - 1), np.int32)
  lengths = np.zeros(batch, np.int32)
  for b, d in drafts.items():
    proposed[b, : len(d)], lengths[b] = d, len(d)
  x = engine.embed(np.concatenate([tokens[:, None], proposed], axis=1) if t > 1 else tokens)
  y, issued = decode.decode_pass(engine, gen, x, engine.meta(gen.start, end), next_pass, run_ahead=False)
  put = lambda a: engine.put(a, np.int32)
  out = engine.fns.verify(engine.top_last, y, put(proposed), put(lengths), params, put(index))
  gen.add_counters("decode", issued + Issued(calls=VERIFY_CALLS))
  return jax.device_get(out)


def run(
    engine, gen, recorder, owners: Sequence[int], prompts: Sequence[Sequence[int]], speculator, seed: int, on_step=None
):
  """Decodes generation `gen` (jaxkv.engine.Generation, its first tokens recorded) speculatively until every owner's
  record is done (jaxkv.telemetry.Recorder); row b is owners[b]'s, prompts[b] its prompt, sampled as
  engine.sampling(B, seed) says. on_step(step, cache) after each recorded token step. Returns the Stats."""
  try:
    speculator.begin(gen)
    return _run(engine, gen, recorder, owners, prompts, speculator, seed, on_step)
  finally:
    speculator.close()


def _run(engine, gen, recorder, owners, prompts, speculator, seed: int, on_step) -> Stats:
  cache, block, k = gen.cache, gen.cache.block, speculator.k
  batch, stats = len(owners), Stats(k, histogram=[0] * (k + 1))
  records = [recorder.records[o] for o in owners]
  settings = engine.sampling(batch, seed)
  sampled = settings.temperature > 0  # [B]
  params = jax.tree.map(lambda a: engine.put(a, a.dtype), settings)
  t0 = time.perf_counter()
  while True:
    live = [b for b in range(batch) if not records[b].done]
    if not live:
      break
    remaining = max(records[b].max_new_tokens - len(records[b].tokens) for b in live)
    idle = min(speculator.idle_passes(b) for b in live)
    if idle:  # No sequence drafts for `idle` passes: one-token steps, read back behind (the plain loop's lag).
      steps = _plain_steps(engine, gen, recorder, owners, prompts, settings, min(idle, remaining), on_step)
      stats.passes, stats.tokens = stats.passes + steps, stats.tokens + steps
      for b in live:
        speculator.stepped(b, min(idle, remaining))
      continue
    end = gen.end
    cap = min(k, block - 2 - end % block, remaining - 1)  # Never the page's last row; never past the tokens wanted.
    histories = {b: list(prompts[b]) + records[b].tokens for b in live}
    drafts = speculator.drafts(histories, cap, end) if cap > 0 else {b: [] for b in live}
    t = k + 1 if any(drafts.values()) else 1
    tokens = np.array([r.tokens[-1] if r.tokens else 0 for r in records], np.int32)
    index = np.array([len(r.tokens) for r in records], np.int32)  # Position 0's token index.
    logits, verified, accepted = verify_pass(engine, gen, tokens, drafts, t, params, index, remaining > 1)
    n = 1 + min(int(accepted[b]) for b in live)
    for j in range(n):
      recorder.record(list(owners), np.asarray(logits[:, j], np.float32), np.asarray(verified[:, j]))
      stats.tokens += 1
      if on_step is not None:
        on_step(stats.passes, cache)
    gen.end = end + n
    for b in live:
      a = int(accepted[b])
      speculator.verified(b, len(drafts[b]), a, n, verified[b], bool(sampled[b]))
      if drafts[b]:
        stats.drafted += len(drafts[b])
        stats.accepted += a
        stats.histogram[a] += 1
    stats.passes += 1
    stats.verify_passes += t > 1
  stats.decode_s = time.perf_counter() - t0
  stats.switched_off = 0 if speculator.switch is None else speculator.switch.switched_off
  stats.draft = speculator.summary()
  return stats
