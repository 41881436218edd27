"""Concurrent sequences with slot reuse: `parallel` slots serve a queue of requests.

The batch of an `Engine` becomes `parallel` slots, scheduled by jaxkv.serving.scheduler (first in, first out, from
token counts alone). A `Run` is one serve: its requests, their records and the telemetry, fed by `submit` (and `end`)
before or while it serves. Its epochs are iterators: before each scheduling decision an epoch yields what it did
since (`Progress`: the requests placed, the tokens read), and whoever iterates may submit or end requests before it
goes on (`Server.serve` gives a list up front; jaxkv.serving.loop feeds requests as they arrive), so control flows
one way down.

Each `Epoch` makes a fresh cache, prefills its first requests one by one like any later request, then runs the
decode loop (jaxkv.decode.DecodeLoop, the one generate runs), and before each step lets the requests that fit enter
the free slots (jaxkv.serving.slots): the deliveries already issued for the next step are dropped (they hold the
slot's old rows), the request is prefilled alone and put into its slot, and the head samples its first token; the
decode state takes its row (jaxkv.meta.DecodeState.with_row). Tokens are read
jaxkv.decode.READ_LAG steps late, so a slot frees that many steps after its last token.

Speculative decoding (speculate.mode lookup, jaxkv.spec_decode): while every live slot may draft, a step of the
epoch is a verify pass, read back before the next (the drafter reads the tokens): each live slot drafts its own tokens
(0 .. k, from its prompt and tokens, with its own switch; a slot taking a request starts afresh), the slots advance
together by the smallest acceptance + 1, each token recorded as a one-token step's, and a greedy slot's further
verified tokens head its next draft (a sampled request's tokens then depend on the batch's acceptances:
docs/design.md). While a live slot is switched off (jaxkv.speculate.Switch: drafts that fail, or lookups that find
nothing, turn it off, each failed probe for longer) a verify pass could advance the batch by one token only, so
the steps are the plain loop's, run ahead as without speculation, from the tokens read (their passes count as the
slot's wait); they read back and verify again once every live slot may draft (what drafts that fail cost:
docs/design.md, "In the server"). Requests that it cannot verify (penalties, logit rules, a grammar) are refused
(`Server.check`).

Sampling: request r's token i draws with key fold_in(fold_in(key(seed_r), 0), i) (jaxkv.sampling), whatever its
slot or step, so sampled output does not depend on the neighbours either. Each request has its own settings
(`Request.sampling`, default the engine's) and logit rules (`Request.rules`), per-row arguments of the one compiled
head.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import time
from collections.abc import Iterator, Sequence

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import decode
from jaxkv import spec_decode
from jaxkv import telemetry
from jaxkv.config import SamplingConfig
from jaxkv.sampling import SamplingParams
from jaxkv.serving import prefix_cache as prefix_cache_lib
from jaxkv.serving import slots as slots_lib
from jaxkv.serving.requests import Request, RequestResult, ServeResult
from jaxkv.serving.scheduler import Scheduler


@dataclasses.dataclass
class Progress:
  """What an epoch did since it last yielded: requests placed (request, slot, epoch, first row, its prompt tokens
  taken from the prefix cache), tokens read
  (request, token, end: "eos", "length" or None, logprob: jaxkv.telemetry.Recorder.record's), the indices of the
  steps read, and the prompt logprobs of the requests placed that asked (request, SlotFiller.prompt_logprobs's).
  """

  placed: list[tuple[int, int, int, int, int]] = dataclasses.field(default_factory=list)
  tokens: list[tuple[int, int, str | None]] = dataclasses.field(default_factory=list)
  steps: list[int] = dataclasses.field(default_factory=list)
  prompt_logprobs: list[tuple[int, list]] = dataclasses.field(default_factory=list)


class Server:
  """Serves requests on `parallel` slots of an engine (its config gives placement, depth, capacity...)."""

  def __init__(self, engine, parallel: int, prefix_cache_bytes: int = 0):
    """engine: a jaxkv.engine.Engine. prefix_cache_bytes: the prefix cache's budget in host memory (0 = off;
    jaxkv.serving.prefix_cache), kept across serve() calls and epochs."""
    if parallel < 1:
      raise ValueError(f"parallel must be >= 1, got {parallel}")
    slots_lib.check_prefix_cache_budget(prefix_cache_bytes)
    if engine.config.speculate.mode == "self":
      raise ValueError(
          "the server drafts with --speculate=lookup only (self-speculation's draft cache is generate's); use "
          "--speculate=lookup or off"
      )
    self.engine, self.parallel = engine, parallel
    self.speculating = engine.config.speculate.mode != "off"
    self.prefix_cache = None
    if prefix_cache_bytes:
      self.prefix_cache = prefix_cache_lib.PrefixCache(prefix_cache_bytes, engine.config.engine.prefill_chunk)

  def sampling(self, requests: Sequence[Request | None]) -> SamplingParams:
    """The rows of the head's sampling for slots holding `requests`: each its own seed, stream 0 and rules (an
    empty slot, None, samples greedily)."""
    settings = [SamplingConfig() if r is None else r.sampling or self.engine.config.sampling for r in requests]
    seeds, rules = [0 if r is None else r.seed for r in requests], [None if r is None else r.rules for r in requests]
    return SamplingParams.rows(settings, seeds, [0] * len(requests), rules)

  def check(self, request: Request) -> None:
    """ValueError, naming the request's field, where this server cannot run it: speculative decoding verifies drafts
    without penalties, logit rules (logit_bias, min_tokens) or a grammar (jaxkv.config.check_speculate)."""
    if not self.speculating:
      return
    why = f"--speculate={self.engine.config.speculate.mode} verifies drafts without"
    s = request.sampling or self.engine.config.sampling
    for name, value, off in (
        ("presence_penalty", s.presence_penalty, 0.0),
        ("frequency_penalty", s.frequency_penalty, 0.0),
        ("repetition_penalty", s.repetition_penalty, 1.0),
    ):
      if value != off:
        raise ValueError(f"{name}: {why} penalties; leave it out, or serve with --speculate=off")
    if request.rules is not None:
      name = "logit_bias" if request.rules.logit_bias else "min_tokens"
      raise ValueError(f"{name}: {why} logit rules; leave it out, or serve with --speculate=off")
    if request.grammar is not None:
      self.check_grammar("grammar")

  def check_grammar(self, name: str) -> None:
    """ValueError where a request's structured output field `name` cannot run (under speculative decoding)."""
    if self.speculating:
      raise ValueError(
          f"{name}: --speculate={self.engine.config.speculate.mode} verifies drafts without structured output; leave it"
          " out, or serve with --speculate=off"
      )

  def validate(self, requests: Sequence[Request]) -> list[str | None]:
    """Why each request cannot run (None: it can). ValueError when there is none to run."""
    if not requests:
      raise ValueError("no requests given")
    errors = []
    for r in requests:
      try:
        self.engine.validate([r.prompt], r.max_new_tokens or 1)
        self.check(r)
        errors.append(None)
      except ValueError as e:
        errors.append(str(e).replace("prompt 0", "its prompt", 1))  # The engine numbers the prompts of a batch.
    if all(errors):
      raise ValueError(f"every request was rejected; request 0: {errors[0]}")
    return errors

  def work(self, job):
    """Runs a slot job (jaxkv.serving.slot_files) to its end on this thread, between serves; returns its result."""
    run = Run(self, 1)
    run.jobs.append(job)
    try:
      while run.jobs:
        run.work()
    finally:
      run.close()
    return job.future.result()

  def serve(self, requests: Sequence[Request], on_step=None) -> ServeResult:
    """Runs every request that can run to its end, and rejects the others (their results say why); on_step(step,
    slots) after each decode step is read (for monitoring)."""
    errors = self.validate(requests)
    t0 = time.perf_counter()
    run = Run(self, batch=min(self.parallel, errors.count(None)))
    try:
      ids = [None if e else run.submit(r) for r, e in zip(requests, errors)]
      while run.scheduler.queue:
        for progress in run.epoch():
          for step in progress.steps if on_step is not None else ():
            on_step(step, list(run.scheduler.slots))
      return run.result(ids, errors, time.perf_counter() - t0)
    finally:
      run.close()


class Run:
  """One serve: its requests (by id, from `submit`), their records (jaxkv.telemetry.Recorder; with hashed, each
  request's logits hash), where each ran, the progress not yielded yet, and the telemetry. batch: the slots of an
  epoch's cache."""

  def __init__(self, server: Server, batch: int, hashed: bool = True):
    self.server, self.batch, self.hashed = server, batch, hashed
    self.scheduler = Scheduler(server.engine.config.engine.capacity)
    self.recorder = telemetry.Recorder(server.engine.config.sampling.stop_ids)
    self.requests: dict[int, Request] = {}
    self.where: dict[int, tuple[int, int, int]] = {}  # Request -> (slot, epoch, first row).
    self.cached: dict[int, int] = {}  # Request -> its prompt tokens taken from the prefix cache, once placed.
    self.counters, self.shapes = telemetry.Counters(), set()
    self.insertions = self.steps = self.epochs = 0
    # Speculation: draft tokens proposed, and recorded as tokens; verify passes (read back) and plain steps.
    self.speculated = collections.Counter(drafted=0, accepted=0, verify_passes=0, plain_steps=0)
    self.summary: dict = {}
    self.progress = Progress()
    self.jobs: collections.deque = collections.deque()  # Waiting jaxkv.serving.slot_files jobs, first in first out.
    self._filler: slots_lib.SlotFiller | None = None  # The jobs' between epochs.
    self._ids = 0

  def submit(self, request: Request) -> int:
    """Queues a request (validated); returns its id."""
    r, self._ids = self._ids, self._ids + 1
    self.requests[r] = request
    capacity = self.scheduler.capacity  # Without max_new_tokens, a bound until it is placed.
    self.recorder.add(r, request.max_new_tokens or capacity, self.hashed, request.logprobs)
    self.scheduler.submit(r, len(request.prompt), request.max_new_tokens)
    return r

  def end(self, r: int) -> None:
    """Request r ends now (cancelled): nothing more is recorded for it, its slot frees before the next step."""
    self.recorder.end(r)
    self.scheduler.end(r)

  def forget(self, r: int) -> None:
    """Drops an ended request's records (a long-running server keeps no prompts or tokens)."""
    del self.requests[r]
    self.where.pop(r, None)
    self.recorder.forget(r)

  def placed(self, r: int, slot: int, epoch: int, first_row: int) -> None:
    """Request r entered `slot` with its prompt from `first_row` (before its first token is read)."""
    self.where[r] = (slot, epoch, first_row)
    request = self.requests[r]
    if request.max_new_tokens is None:  # Its tokens up to the capacity: the first at row first_row + L.
      end = first_row + len(request.prompt)
      self.recorder.records[r].max_new_tokens = self.scheduler.capacity - end + 1
    self.progress.placed.append((r, slot, epoch, first_row, self.cached.pop(r, 0)))

  def read(self, loop: decode.DecodeLoop) -> None:
    """Reads the oldest step in flight and ends the requests it ended."""
    step, taken = loop.read()
    self.took(step.index, taken)

  def took(self, step: int, taken: list[tuple]) -> None:
    """Step `step` gave `taken` (jaxkv.telemetry.Recorder.record): ends the requests it ended."""
    for r, token, end, _ in taken:
      if self.requests[r].grammar is not None:
        self.requests[r].grammar.consume(token)
      if end is not None:
        self.scheduler.end(r)
    self.progress.tokens += taken
    self.progress.steps.append(step)

  def work(self, filler: slots_lib.SlotFiller | None = None) -> None:
    """One unit of the first waiting job (jaxkv.serving.slot_files.Job.advance: at most one prefill chunk) with
    `filler`, an epoch's, or between epochs one of the run's own (closed once no job waits). A job that raises ends
    with its error in its future; the run goes on."""
    if filler is None:
      if self._filler is None:
        self._filler = slots_lib.SlotFiller(self.server.engine, self.server.prefix_cache, self.counters, self.shapes)
      filler = self._filler
    job = self.jobs[0]
    try:
      done = job.advance(filler)
    except Exception as e:  # pylint: disable=broad-except  (its caller hears why; the requests go on)
      if not isinstance(e, ValueError):
        logging.exception("serving: a slot job failed")
      job.future.set_exception(e)
      done = True
    if done:
      self.jobs.popleft()
    if not self.jobs:
      self.close_filler()

  def close_filler(self) -> None:
    """Frees the jobs' filler between epochs (its scratch generation's device memory)."""
    if self._filler is not None:
      self._filler.close()
      self._filler = None

  def take_progress(self) -> Progress:
    progress, self.progress = self.progress, Progress()
    return progress

  def epoch(self) -> Iterator[Progress]:
    """An epoch (module docstring), served as it is iterated, until its slots are free and nothing waiting fits."""
    return Epoch(self, self.epochs).serve()

  @property
  def totals(self) -> collections.Counter:
    """Every counter of TOTALS, present from the start (a run without slot reuse has 0 insertions)."""
    c = self.counters
    return collections.Counter(
        h2d_bytes=c.h2d_bytes,
        d2h_bytes=c.d2h_bytes,
        ring_high_water_bytes_per_device=c.ring_high_water_bytes_per_device,
        insertions=self.insertions,
    )

  def result(self, ids: list[int | None], errors: list[str | None], wall_s: float) -> ServeResult:
    """The results of the requests given as `ids` (None: rejected, its error in `errors`)."""
    results = []
    for r, e in zip(ids, errors):
      if r is None:
        results.append(RequestResult([], hashlib.sha256().hexdigest(), -1, -1, -1, error=e))
        continue
      rec = self.recorder.records[r]
      results.append(RequestResult(rec.tokens, self.recorder.hexdigest(rec.hash), *self.where[r], ttft_s=rec.ttft_s))
    transcript = json.dumps([[r.tokens, r.logits_sha256] + ([r.error] if r.error else []) for r in results])
    report = dict(self.summary, compiled_shapes=len(self.shapes), epochs=self.epochs, **self.totals)
    if self.server.prefix_cache is not None:
      report["prefix_cache"] = self.server.prefix_cache.summary()
    if self.server.speculating:
      report["speculate"] = dict(self.speculated)
    report.update(self.counters.by_device())
    timing = dict(wall_s=wall_s, decode_steps=self.steps, tokens=sum(len(r.tokens) for r in results))
    return ServeResult(results, hashlib.sha256(transcript.encode()).hexdigest(), report, timing)

  def close(self) -> None:
    self.close_filler()
    self.recorder.close()


class Epoch:
  """One epoch of a run: a fresh cache, its first requests prefilled, then decode with slot reuse."""

  def __init__(self, run: Run, index: int):
    self.run, self.index, self.engine = run, index, run.server.engine
    self.scheduler = run.scheduler
    self.speculator = self.engine.speculator() if run.server.speculating else None  # Its slots' drafts.

  def serve(self) -> Iterator[Progress]:
    run, eng = self.run, self.engine
    owners, end = self.scheduler.open_epoch(run.batch)
    run.close_filler()  # The jobs go on with the epoch's.
    gen = eng.start(run.batch, counters=run.counters, shapes=run.shapes)
    filler = slots_lib.SlotFiller(eng, run.server.prefix_cache, run.counters, run.shapes)
    loop = decode.DecodeLoop(eng, gen, run.recorder)
    try:
      state = self._first_alone(gen, loop, filler, owners, end)
      for b, r in enumerate(owners):
        if r is not None:
          run.placed(r, b, self.index, int(gen.start[b]))
      yield from self._decode(gen, loop, filler, state)
    finally:
      filler.close()
      gen.close()
      run.summary = gen.summary()
      run.epochs += 1

  def _decode(self, gen, loop: decode.DecodeLoop, filler: slots_lib.SlotFiller, state) -> Iterator[Progress]:
    """Steps until every slot is free and nothing waiting fits; free slots take the next requests that fit. Yields
    the progress before each scheduling decision (the iterating side may submit or end requests meanwhile)."""
    run, sched = self.run, self.scheduler
    while True:
      yield run.take_progress()
      sched.free()
      for b, r in sched.admit(gen.end):
        gen.drop_pending(state.x)  # Deliveries issued for the next step hold slot b's old rows.
        state = self._enter(gen, loop, filler, state, b, r)
        if self.speculator is not None:
          self.speculator.forget(b)
        run.insertions += 1
        run.placed(r, b, self.index, int(gen.start[b]))
      if run.jobs:  # A saved slot's next block (its prefill on the filler's scratch: this cache is left alone).
        run.work(filler)
      need = sched.need()
      idle = self._idle()
      if gen.end <= need and idle is None:
        while loop.pending:  # The steps in flight: the drafts start from their tokens.
          run.read(loop)
        self._verify(gen, need)
        # The plain loop's state from the tokens read, before a request enters a slot of it (whose first token is
        # not read yet) or a plain step runs from it.
        state = self._plain_state(gen)
        continue
      if gen.end <= need:
        state = self._constrain(loop, state)
        state = loop.step(state, sched.owners(), next_pass=gen.end + 1 <= need, run_ahead=False)
        run.steps += 1
        if self.speculator is not None:
          for b in idle:
            self.speculator.stepped(b, 1)
          run.speculated["plain_steps"] += 1
        if not loop.lagging():
          continue
      elif not loop.pending:
        return
      run.read(loop)

  def _live(self) -> list[int]:
    """The slots whose request goes on, as far as its tokens were read."""
    records = [self.run.recorder.records.get(r) for r in self.scheduler.owners()]
    return [b for b, rec in enumerate(records) if rec is not None and not rec.done]

  def _idle(self) -> list[int] | None:
    """None where the next pass verifies drafts: every live slot may draft (or none is live: nothing to step). Else
    the next pass is a plain step, for the live slots returned ([] without speculation): a slot switched off drafts
    nothing, so that a verify pass would advance the batch by one token (the smallest acceptance + 1), as a step
    does, at the cost of a read-back."""
    if self.speculator is None:
      return []
    live = self._live()
    return live if any(self.speculator.idle_passes(b) for b in live) else None

  def _plain_state(self, gen):
    """The plain loop's state after verify passes (jaxkv.spec_decode.plain_state): each live slot from its last token
    read, the others idle (token 0, greedy)."""
    run, owners, live = self.run, self.scheduler.owners(), set(self._live())
    records = [run.recorder.records[owners[b]] if b in live else None for b in range(len(owners))]
    tokens = np.array([0 if rec is None else rec.tokens[-1] for rec in records], np.int32)
    index = np.array([0 if rec is None else len(rec.tokens) for rec in records], np.int32)
    requests = [run.requests[owners[b]] if b in live else None for b in range(len(owners))]
    prompts = [None if r is None else r.prompt for r in requests]
    return spec_decode.plain_state(self.engine, gen, tokens, index, run.server.sampling(requests), prompts)

  def _verify(self, gen, need: int) -> None:
    """One verify pass (jaxkv.spec_decode.verify_pass) of the live slots, each with its own draft: at most k tokens,
    none on the page's last row, none past the tokens its request wants; records the n tokens every slot advances by
    (n = the smallest acceptance + 1) as n one-token steps."""
    run, spec, eng = self.run, self.speculator, self.engine
    owners = self.scheduler.owners()
    records = [run.recorder.records.get(r) for r in owners]
    live = self._live()
    if not live:  # Every slot's request ended: they free before the next pass.
      return
    end, block = gen.end, gen.cache.block
    page = min(spec.k, block - 2 - end % block)  # Never the page's last row (jaxkv.spec_decode).
    drafts = {}
    for b in live:
      rec, prompt = records[b], run.requests[owners[b]].prompt
      cap = min(page, rec.max_new_tokens - len(rec.tokens) - 1)
      drafts[b] = spec.draft(b, list(prompt) + rec.tokens, cap) if cap > 0 else []
    t = spec.k + 1 if any(drafts.values()) else 1
    requests = [run.requests[owners[b]] if b in drafts else None for b in range(len(owners))]
    settings = run.server.sampling(requests)
    params = jax.tree.map(lambda a: eng.put(a, a.dtype), settings)
    tokens = np.array([records[b].tokens[-1] if b in drafts else 0 for b in range(len(owners))], np.int32)
    index = np.array([len(records[b].tokens) if b in drafts else 0 for b in range(len(owners))], np.int32)
    before = [len(records[b].tokens) for b in live]
    logits, verified, accepted = spec_decode.verify_pass(eng, gen, tokens, drafts, t, params, index, end + 1 <= need)
    n = 1 + min(int(accepted[b]) for b in live)
    for j in range(n):
      run.took(run.steps, run.recorder.record(owners, np.asarray(logits[:, j], np.float32), verified[:, j]))
      run.steps += 1
    gen.end = end + n
    run.speculated["verify_passes"] += 1
    for b, had in zip(live, before):
      spec.verified(b, len(drafts[b]), int(accepted[b]), n, verified[b], bool(settings.temperature[b] > 0))
      if drafts[b]:
        run.speculated.update(drafted=len(drafts[b]), accepted=len(records[b].tokens) - had - 1)

  def _constrain(self, loop: decode.DecodeLoop, state):
    """The state with each row under a grammar allowing what its grammar accepts next: with such a row, the steps in
    flight are read first (its matcher takes their tokens), so the loop does not run ahead of it."""
    run, sched, fns = self.run, self.scheduler, self.engine.fns
    under = lambda: [(b, r) for b, r in enumerate(sched.owners()) if r is not None and r not in sched.ended]
    if not any(run.requests[r].grammar is not None for _, r in under()):
      return state
    while loop.pending:
      run.read(loop)
    for b, r in under():
      if run.requests[r].grammar is not None:
        state = fns.allow(state, self.engine.put(b, np.int32), self.engine.put(run.requests[r].grammar.allowed(), bool))
    return state

  def _first_alone(self, gen, loop, filler, owners, longest: int):
    """The epoch's first requests enter their slots one by one at end = the longest prompt, each prefilled alone like
    any later request (so that a prompt's rows never depend on its neighbours)."""
    eng, cfg = self.engine, self.engine.config
    gen.cache.store_empty_slots(longest // cfg.kv.block * cfg.kv.block)
    gen.start, gen.end = np.full(len(owners), longest - 1, np.int32), longest  # An empty slot attends one zero row.
    x = eng.put(np.zeros((len(owners), cfg.model.d_model)), jnp.dtype(cfg.model.dtype))
    state = eng.state(x, gen.start, longest, self.run.server.sampling([None] * len(owners)))
    for b, r in enumerate(owners):
      if r is not None:
        state = self._enter(gen, loop, filler, state, b, r)
    return state

  def _enter(self, gen, loop: decode.DecodeLoop, filler: slots_lib.SlotFiller, state, b: int, r: int):
    """Request r prefilled alone into slot b at the current end; its first token's read queued; returns the state
    with its row."""
    eng, req, end, pc = self.engine, self.run.requests[r], gen.end, self.run.server.prefix_cache
    hits = pc.stats["hit_tokens"] if pc is not None else 0
    hidden = None if req.prompt_logprobs is None else []
    x_new = filler.fill(gen.cache, b, req.prompt, end, hidden, req.prompt_shares)
    self.run.cached[r] = pc.stats["hit_tokens"] - hits if pc is not None else 0
    if hidden is not None:
      self.run.progress.prompt_logprobs.append((r, filler.prompt_logprobs(req.prompt, hidden, req.prompt_logprobs)))
    gen.start[b] = end - len(req.prompt)
    row = eng.state(x_new, gen.start[b : b + 1], end - 1, self.run.server.sampling([req]), [req.prompt])
    if req.grammar is not None:
      row = eng.fns.allow(row, eng.put(0, np.int32), eng.put(req.grammar.allowed(), bool))
    row = loop.first(row, [r])
    return eng.fns.enter(state, eng.put(b, np.int32), row)
