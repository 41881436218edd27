"""Concurrent sequences with slot reuse: `parallel` slots serve a queue of requests.

The batch of an `Engine` becomes `parallel` slots. Prompts are right-aligned and every slot writes its next row
at the same row `end` (jaxkv.cache), so a request enters a free slot b at the current end E: its prompt takes
rows [E - L, E) of slot b (start[b] = E - L), which needs L <= E and E + max_new_tokens - 1 <= capacity.

Entering (`_insert`): the request alone (batch 1) is prefilled as if its prompt ended at row E, in a cache of
its own with the engine's placement and transport; chunks wholly before E - L are skipped (their rows start as
zeros: left padding). Its last chunk yields rows [0, W) and the open page [W, W + P) with the same W as the
shared cache, which replace slot b of every layer: one donated `dynamic_update_slice` per layer into the
window where it lives (in place in pinned host memory for a streamed layer) and one into the open page.
Other slots are not touched; slot b's older rows are below start[b], masked. Positions are r - start[b], so a
request sees the same positions, keys and values as when decoded alone.

Scheduling, deterministic from tokens alone: requests enter in order (first in, first out). A request that
does not fit yet (L > E) waits while the end moves on; one that cannot fit before the capacity runs out waits
until every slot is free, and the next epoch starts a fresh cache with a batched prefill of the next requests.
Tokens are read `engine.READ_LAG` steps late, so a slot frees that many steps after its last token.

Sampling: request r's token i uses key fold_in(fold_in(key(seed_r), 0), i), whatever its slot or step, so
sampled output does not depend on the neighbours either. Each request has its own temperature, top-k and top-p
(`Request.sampling`, default the engine's), traced arguments of one compiled head.

`_Run` serves a list given up front (`Server.serve`); its hooks (`arrivals`, `placed`, `emitted`) let
jaxkv.serving_loop feed it requests as they arrive and report each token as it is read back.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import json
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from jaxkv import cache as cache_lib
from jaxkv import digest
from jaxkv import engine as engine_lib
from jaxkv import mesh as mesh_lib
from jaxkv import model
from jaxkv import prefix_cache as prefix_cache_lib
from jaxkv import sampling as sampling_lib
from jaxkv import telemetry
from jaxkv.config import SamplingConfig
from jaxkv.meta import Meta

# The counters summed over a serve(), in ServeResult.transport whatever the run did.
TOTALS = ("h2d_bytes", "d2h_bytes", "ring_high_water_bytes_per_device", "insertions")


@dataclasses.dataclass(frozen=True)
class Request:
  """prompt: token ids; max_new_tokens: tokens to generate (EOS ends it earlier); seed: its sampling seed;
  sampling: its temperature, top_k and top_p (None = the engine's; the engine's eos_id applies to all)."""

  prompt: tuple[int, ...]
  max_new_tokens: int
  seed: int = 0
  sampling: SamplingConfig | None = None


@dataclasses.dataclass
class RequestResult:
  """tokens: generated ids (up to and including EOS); logits_sha256: over its f32 logits rows, in order;
  slot, epoch: where it ran; first_row: start of its prompt in the slot (E - L); ttft_s: seconds from the serve's
  start to its first token on the host. A request that cannot run (its prompt does not fit the capacity, ...) is
  rejected alone: `error` says why, no tokens, slot/epoch/first_row -1, ttft_s None."""

  tokens: list[int]
  logits_sha256: str
  slot: int
  epoch: int
  first_row: int
  error: str | None = None
  ttft_s: float | None = None


@dataclasses.dataclass
class ServeResult:
  """results: one per request, in request order; transcript_sha256: sha256 of the JSON list of every
  request's [tokens, logits_sha256] (and its error, if rejected); transport: telemetry summed over the epochs;
  timing: wall_s, decode_steps, tokens."""

  results: list[RequestResult]
  transcript_sha256: str
  transport: dict
  timing: dict


@dataclasses.dataclass(frozen=True)
class _SlotFns:
  head: object
  enter: object
  insert_device: object  # Into a window or open page in device memory.
  insert_host: object  # Into a window in pinned host memory, in place.
  place: object  # Prefix cache: a prompt's rows moved to the slot's rows.
  block: object  # Prefix cache: a block of rows, to pinned host memory.
  join: object  # Prefix cache: blocks, moved to the devices, concatenated.


@functools.lru_cache(maxsize=None)
def _slot_functions(cfg, mesh: jax.sharding.Mesh) -> _SlotFns:
  rep = mesh_lib.replicated(mesh)
  kv_device = mesh_lib.sharding(mesh, mesh_lib.CACHE_AXES, "device")
  kv_host = mesh_lib.sharding(mesh, mesh_lib.CACHE_AXES, "pinned_host")

  def head(top, x, meta, keys, knobs):
    """x [B, D]; meta i32[B + 3]; keys i32[B, 3] (request seed, step of its token 0, top_k); knobs f32[B, 2]
    (temperature, top_p) -> logits, tokens, their embeddings, next meta. Row b samples with its request's key for
    token index meta step - keys[b, 1]."""
    lg = model.logits(top, x, cfg)

    def one(row, seed, index, top_k, temperature, top_p):
      key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), 0), index)
      return sampling_lib.sample_traced(row[None], key, temperature, top_k, top_p)[0]

    def drawn(lg):
      return jax.vmap(one)(lg, keys[:, 0], Meta.step(meta) - keys[:, 1], keys[:, 2], knobs[:, 0], knobs[:, 1])

    greedy = lambda lg: jnp.argmax(lg, axis=-1).astype(jnp.int32)
    tok = jax.lax.cond(jnp.all(knobs[:, 0] == 0.0), greedy, drawn, lg)
    return lg, tok, model.embed(top, tok), Meta.advance(meta)

  def enter(x, meta, keys, knobs, x_new, b, start_b, key_b, knobs_b):
    """Slot b takes a new request: its hidden state, start row and sampling key and knobs."""
    x = jax.lax.dynamic_update_slice(x, x_new, (b, 0))
    meta = Meta.with_start(meta, b, start_b)
    keys = jax.lax.dynamic_update_slice(keys, key_b[None], (b, 0))
    return x, meta, keys, jax.lax.dynamic_update_slice(knobs, knobs_b[None], (b, 0))

  def insert(rows, new, b):
    """rows [2, B, K, R, E] (donated); new [2, 1, K, R, E] on the devices -> rows with slot b = new."""
    return jax.lax.dynamic_update_slice(rows, new, (0, b, 0, 0, 0))

  def insert_host(rows, new, b):
    return insert(rows, jax.device_put(new, jax.memory.Space.Host), b)

  def place(head, open_page, offset, w_rows):
    """A prompt prefilled at rows [0, L) (head [2, 1, K, H, E] or None, open_page [2, 1, K, P, E] after it) -> its
    rows at [offset, offset + L) of a slot's window [2, 1, K, w_rows, E] and open page (rows after the prompt's
    are those after it in the prefilled ones, and decode masks them until it writes them)."""
    full = open_page if head is None else jnp.concatenate([head, open_page], axis=3)
    p = open_page.shape[3]
    dest = jnp.zeros(full.shape[:3] + (w_rows + p + full.shape[3], full.shape[4]), full.dtype)
    dest = jax.lax.dynamic_update_slice(dest, full, (0, 0, 0, offset, 0))
    return dest[:, :, :, :w_rows], dest[:, :, :, w_rows : w_rows + p]

  def block(rows, first, size):
    """rows [2, 1, K, R, E] on the devices -> rows [first, first + size), in pinned host memory."""
    return jax.device_put(jax.lax.dynamic_slice_in_dim(rows, first, size, axis=3), jax.memory.Space.Host)

  def join(blocks):
    """blocks: [2, 1, K, C, E] each, on the devices -> [2, 1, K, n C, E]."""
    return jnp.concatenate(blocks, axis=3)

  return _SlotFns(
      place=jax.jit(place, static_argnames="w_rows", out_shardings=kv_device),
      block=jax.jit(block, static_argnames="size", out_shardings=kv_host),
      join=jax.jit(join, out_shardings=kv_device),
      head=jax.jit(head, out_shardings=rep),
      enter=jax.jit(enter, out_shardings=rep, donate_argnums=(0, 1, 2, 3)),
      insert_device=jax.jit(insert, out_shardings=kv_device, donate_argnums=(0,)),
      insert_host=jax.jit(insert_host, out_shardings=kv_host, donate_argnums=(0,)),
  )


def check_prefix_cache_budget(nbytes: int) -> None:
  """ValueError for a prefix cache budget below 0 or past this backend's pinned host pool (run after the platform
  is set)."""
  if nbytes < 0:
    raise ValueError(f"the prefix cache budget must be >= 0, got {nbytes} B")
  pool = cache_lib.pinned_pool_limit_bytes()
  if pool is not None and nbytes >= pool:
    raise ValueError(
        f"the prefix cache budget ({nbytes / 2**30:.2f} GiB) does not fit the pinned host pool ({pool / 2**30:.2f} "
        f"GiB) beside the KV cache; lower --prefix_cache_gib or raise {cache_lib.POOL_ENV}"
    )


@dataclasses.dataclass(frozen=True)
class _Slot:
  """What a slot holds now (host side): its request and the last row its decode writes (the row of its first
  token + max_new_tokens - 2)."""

  request: int
  last_row: int


class Server:
  """Serves requests on `parallel` slots of an engine (its config gives placement, depth, capacity...)."""

  def __init__(self, engine: engine_lib.Engine, parallel: int, prefix_cache_bytes: int = 0):
    """prefix_cache_bytes: the prefix cache's budget in host memory (0 = off; jaxkv.prefix_cache), kept across
    serve() calls and epochs."""
    if parallel < 1:
      raise ValueError(f"parallel must be >= 1, got {parallel}")
    check_prefix_cache_budget(prefix_cache_bytes)
    self.engine, self.parallel = engine, parallel
    self.prefix_cache = None
    if prefix_cache_bytes:
      self.prefix_cache = prefix_cache_lib.PrefixCache(prefix_cache_bytes, engine.config.engine.prefill_chunk)
    cfg = engine.config
    self.fns = _slot_functions(cfg.model, engine.layout.last)  # The head's stage.
    self.layer_fns = [_slot_functions(cfg.model, engine.layout.mesh(l)) for l in range(len(engine.params["layers"]))]

  def sampling_of(self, request: Request | None) -> tuple[list[int], list[float]]:
    """A slot's rows of the head's keys (seed, step of token 0 = 0, top_k) and knobs (temperature, top_p); an empty
    slot (None) samples greedily."""
    s = SamplingConfig() if request is None else request.sampling or self.engine.config.sampling
    return [0 if request is None else request.seed, 0, s.top_k], [s.temperature, s.top_p]

  def validate(self, requests: Sequence[Request]) -> list[str | None]:
    """Why each request cannot run (None: it can). ValueError when there is none to run."""
    if not requests:
      raise ValueError("no requests given")
    errors = []
    for r in requests:
      try:
        self.engine.validate([r.prompt], r.max_new_tokens)
        errors.append(None)
      except ValueError as e:
        errors.append(str(e).replace("prompt 0", "its prompt", 1))  # The engine numbers the prompts of a batch.
    if all(errors):
      raise ValueError(f"every request was rejected; request 0: {errors[0]}")
    return errors

  def serve(self, requests: Sequence[Request], on_step=None) -> ServeResult:
    """Runs every request that can run to its end, and rejects the others (their results say why); on_step(step,
    slots) after each decode step is read (for monitoring)."""
    errors = self.validate(requests)
    t0 = time.perf_counter()
    run = _Run(self, requests, on_step, errors)
    epoch = 0
    try:
      while run.queue:
        run.epoch(epoch)
        epoch += 1
      return run.result(time.perf_counter() - t0, epochs=epoch)
    finally:
      run.digests.close()


class _Run:
  """The state of one serve(): the queue, the per-request records, telemetry. batch: the slots of an epoch's cache
  (default as many as there are requests, at most `parallel`)."""

  def __init__(
      self,
      server: Server,
      requests: Sequence[Request],
      on_step,
      errors: Sequence[str | None] | None = None,
      batch: int | None = None,
  ):
    self.server, self.engine = server, server.engine
    self.requests, self.on_step = requests, on_step
    self.errors = list(errors) if errors is not None else [None] * len(requests)  # Why a request was rejected.
    self.queue = collections.deque(i for i, e in enumerate(self.errors) if e is None)
    self.batch = batch or min(server.parallel, len(self.queue))
    self.tokens: list[list[int]] = [[] for _ in requests]
    self.digests = digest.Digests()  # Closed by whoever runs this (Server.serve, ServingLoop).
    self.hashes = [self.digests.new() for _ in requests]  # Per request; None where nobody reads it (serving_loop).
    self.done = [False] * len(requests)
    self.where: list[tuple[int, int, int] | None] = [None] * len(requests)  # (slot, epoch, first row).
    self.shapes: set[tuple] = set()
    self.counts = telemetry.Counters()
    self.insertions = 0
    self.summary: dict = {}
    self.steps = 0
    self.t_progress = self.t_start = time.perf_counter()
    self.ttft_s: list[float | None] = [None] * len(requests)

  # Hooks for a run fed while it serves (jaxkv.serving_loop); a list given up front needs none.
  def arrivals(self) -> None:
    """Called before each scheduling decision: may append requests to `requests` and `queue`, or end some."""

  def placed(self, r: int, slot: int, epoch: int, first_row: int) -> None:
    """Request r took a slot."""
    self.where[r] = (slot, epoch, first_row)

  def emitted(self, r: int, token: int, end: str | None) -> None:
    """Request r's next token was read back; end: why it ended with it ("eos", "length") or None."""

  # Recording.
  @property
  def totals(self) -> collections.Counter:
    """Every counter of TOTALS, present from the start (a run without slot reuse has 0 insertions)."""
    c = self.counts
    return collections.Counter(
        h2d_bytes=c.h2d_bytes,
        d2h_bytes=c.d2h_bytes,
        ring_high_water_bytes_per_device=c.ring_high_water_bytes_per_device,
        insertions=self.insertions,
    )

  def record(self, owners: list[int | None], lg, tok) -> None:
    """Records one read step for the slots' owners (row b of lg and tok belongs to owners[b])."""
    lg, tok = telemetry.read_back(lg, tok)
    eos = self.engine.config.sampling.eos_id
    for b, r in enumerate(owners):
      if r is None or self.done[r]:
        continue
      t = int(tok[b])
      self.tokens[r].append(t)
      if len(self.tokens[r]) == 1:
        self.ttft_s[r] = time.perf_counter() - self.t_start
      if self.hashes[r] is not None:
        self.digests.update(self.hashes[r], lg[b])
      end = "eos" if t == eos else "length" if len(self.tokens[r]) >= self.requests[r].max_new_tokens else None
      self.done[r] = end is not None
      self.emitted(r, t, end)

  # One epoch: a fresh cache, a batched prefill of the first requests, then decode with slot reuse.
  def epoch(self, epoch: int) -> None:
    eng, cfg = self.engine, self.engine.config
    cap, parallel = cfg.engine.capacity, self.server.parallel
    first = [self.queue.popleft()]  # Fits alone (validated).
    while self.queue and len(first) < parallel:
      longest = max(len(self.requests[r].prompt) for r in first + [self.queue[0]])
      if any(longest + self.requests[r].max_new_tokens - 1 > cap for r in first + [self.queue[0]]):
        break
      first.append(self.queue.popleft())
    owners: list[int | None] = first + [None] * (self.batch - len(first))
    prompts = [self.requests[r].prompt if r is not None else (0,) for r in owners]
    gen = eng.start(self.batch, self.counts, self.shapes)
    try:
      self._epoch(epoch, owners, prompts, gen)
    finally:
      gen.close()
      self.summary = gen.summary()

  def _epoch(self, epoch, owners, prompts, gen: engine_lib.Generation) -> None:
    eng, fns, cache = self.engine, self.server.fns, gen.cache
    cfg = eng.config
    if self.server.prefix_cache is None:
      x, meta, keys, knobs, start, longest, pending = self._first_batched(owners, prompts, gen)
    else:
      x, meta, keys, knobs, start, longest, pending = self._first_alone(owners, gen)
    slots: list[_Slot | None] = [
        None if r is None else _Slot(r, longest + self.requests[r].max_new_tokens - 2) for r in owners
    ]
    for b, r in enumerate(owners):
      if r is not None:
        self.placed(r, b, epoch, int(start[b]))
    end = longest  # The row the next decode step writes.
    step = 1
    while True:
      # Free slots take the next requests that fit.
      self.arrivals()
      for b, s in enumerate(slots):
        if s is None or self.done[s.request]:
          slots[b] = None
      while self.queue and None in slots:
        r = self.queue[0]
        req = self.requests[r]
        if len(req.prompt) > end or end + req.max_new_tokens - 1 > cfg.engine.capacity:
          break
        self.queue.popleft()
        b = slots.index(None)
        gen.transport.drop()  # Deliveries issued for the next step hold slot b's old rows.
        # The windows are overwritten in place below: no copy of the last step may still read them, and no
        # store may still write them (x depends on every delivery that step consumed).
        jax.block_until_ready((x, cache.windows, cache.heads))
        x, meta, keys, knobs, entry = self._insert(cache, x, meta, keys, knobs, b, r, end, step)
        self.insertions += 1
        slots[b] = _Slot(r, end + req.max_new_tokens - 2)
        start[b] = end - len(req.prompt)
        self.placed(r, b, epoch, int(start[b]))
        pending.append(entry)
      need = max((s.last_row for s in slots if s is not None and not self.done[s.request]), default=-1)
      if end <= need:
        x, d2h = eng.decode_pass(gen, x, meta, end, end + 1 <= need)
        lg, tok, x, meta = fns.head(eng.top_last, x, meta, keys, knobs)
        lg.copy_to_host_async()
        tok.copy_to_host_async()
        gen.add_counters("decode", d2h, cache.rows)
        pending.append((step, [None if s is None else s.request for s in slots], lg, tok))
        end += 1
        step += 1
        self.steps += 1
        if len(pending) <= engine_lib.READ_LAG:
          continue
      elif not pending:
        return
      self._read(pending.popleft(), slots)

  def _first_batched(self, owners, prompts, gen):
    """The epoch's first requests prefilled as one batch; returns the decode state, start, longest and the first
    tokens' pending read."""
    eng, fns = self.engine, self.server.fns
    x_last, start, longest = eng.prefill_prompts(gen, prompts, next_pass=True)
    keys, knobs = zip(*(self.server.sampling_of(None if r is None else self.requests[r]) for r in owners))
    keys, knobs = eng.put(keys, np.int32), eng.put(knobs, np.float32)
    lg, tok, x, _ = fns.head(eng.top_last, x_last, eng.meta(start, longest, 0, 0), keys, knobs)
    meta = eng.meta(start, longest, 1, 0)
    pending = collections.deque([(0, list(owners), lg, tok)])
    return x, meta, keys, knobs, start, longest, pending

  def _first_alone(self, owners, gen):
    """With the prefix cache: the epoch's first requests enter their slots one by one at end = the longest prompt,
    each prefilled alone like any later request (so that a prompt's rows never depend on its neighbours)."""
    eng, cfg, cache = self.engine, self.engine.config, gen.cache
    longest = max(len(self.requests[r].prompt) for r in owners if r is not None)
    w_rows = longest // cfg.kv.block * cfg.kv.block
    if w_rows and self.batch > 1:  # The other slots' rows; one slot's window is stored whole (_put_slot).
      cache.store_zeros(w_rows)
    cache.store_zero_opens()
    cache.rows = w_rows
    start = gen.start = np.full(self.batch, longest - 1, np.int32)  # An empty slot attends one zero row.
    keys, knobs = zip(*(self.server.sampling_of(None) for _ in owners))
    keys, knobs = eng.put(keys, np.int32), eng.put(knobs, np.float32)
    x = eng.put(np.zeros((self.batch, cfg.model.d_model)), jnp.dtype(cfg.model.dtype))
    meta = eng.meta(start, longest, 1, 0)
    pending = collections.deque()
    for b, r in enumerate(owners):
      if r is not None:
        x, meta, keys, knobs, entry = self._insert(cache, x, meta, keys, knobs, b, r, longest, 1)
        start[b] = longest - len(self.requests[r].prompt)
        pending.append(entry)
    return x, meta, keys, knobs, start, longest, pending

  def _read(self, entry, slots) -> None:
    step, owners, lg, tok = entry
    self.record(owners, lg, tok)
    if self.on_step is not None:
      self.on_step(step, list(slots))
    if time.perf_counter() - self.t_progress > 10.0:
      self.t_progress = time.perf_counter()
      logging.info("serve: %d of %d requests done", sum(self.done), len(self.requests))

  def _insert(self, cache, x, meta, keys, knobs, b, r, end, step):
    """Prefills request r alone, its prompt ending at row `end`, and puts it in slot b."""
    eng, fns = self.engine, self.server.fns
    req = self.requests[r]
    length = len(req.prompt)
    if self.server.prefix_cache is None:
      x_new = self._prefill_in_place(cache, b, req.prompt, end)
    else:
      x_new = self._prefill_from_zero(cache, b, req.prompt, end)
    start = np.array([end - length], np.int32)
    put = lambda v, dtype=np.int32: eng.put(v, dtype)
    key, knob = self.server.sampling_of(req)
    lg, tok, x_new, _ = fns.head(eng.top_last, x_new, eng.meta(start, end, 0, 0), put([key]), put([knob], np.float32))
    lg.copy_to_host_async()
    tok.copy_to_host_async()
    key[1] = step - 1
    x, meta, keys, knobs = fns.enter(
        x, meta, keys, knobs, x_new, put(b), put(end - length), put(key), put(knob, np.float32)
    )
    return x, meta, keys, knobs, (step - 1, [r], lg, tok)

  def _put_slot(self, cache, l, b, window, open_page) -> None:
    """Replaces slot b of layer l's window (rows [0, W) [2, 1, K, W, E] on the devices, None while W = 0) and open
    page, in place where they live."""
    fns = self.server.layer_fns[l]
    if window is not None and cache.windows[l] is None:  # One slot, no rows yet (_first_alone): the whole window.
      cache.store(l, window)
    elif window is not None:
      insert = fns.insert_host if cache.streamed[l] else fns.insert_device
      r1 = cache.head_rows(l)  # Host attention: rows [0, r1) go to the layer's head, the rest to its tail.
      if r1:
        host_rows, window = cache_lib.split_rows(window, r1, cache.device_shardings[l])
        old = cache.heads[l]
        cache.set_head(l, None)  # Drops the host kernel's views of the head before the insert donates it.
        cache.set_head(l, insert(old, host_rows, b))
      cache.windows[l] = insert(cache.windows[l], window, b)
    cache.opens[l] = fns.insert_device(cache.opens[l], open_page, b)

  def _prefill_own(self, tokens, start, longest, finish, first=0, below=None):
    """Prefills one prompt (tokens i32[1, n * chunk]) in a cache of its own; rows [0, first * chunk) are zeros, or
    `below(l)`'s rows (Engine.prefill). Returns the hidden state of its last row."""
    eng, cfg = self.engine, self.engine.config
    # With rows from the prefix cache the prompt's cache lives on the devices (the same bits in every placement): its
    # window arrives there from the prefix cache's blocks, and would otherwise be stored to host memory and delivered
    # back for the next chunk. The price: the prompt's rows in device memory during its prefill.
    device = dict(placement="device", host_attention=False, host_attention_fraction=0.0)
    kv = cfg.kv if below is None else dataclasses.replace(cfg.kv, **device)

    def fill(own):
      if first and below is None:  # Skipped chunks: zero rows below the prompt (left padding).
        own.store_zeros(first * cfg.engine.prefill_chunk)

    own = eng.start(1, self.counts, self.shapes, kv=kv, fill=fill)
    try:
      return eng.prefill(own, tokens, start, longest, finish, next_pass=False, first=first, below=below)
    finally:
      own.close()

  def _prefill_in_place(self, cache, b, prompt, end):
    """Prefills the prompt as if it ended at row `end` (chunks aligned to row 0 of the slot) straight into slot b."""
    chunk, length = self.engine.config.engine.prefill_chunk, len(prompt)
    tokens = np.zeros((1, -(-end // chunk) * chunk), np.int32)
    tokens[0, end - length : end] = prompt

    def finish(l, head, open_page):
      self._put_slot(cache, l, b, head, open_page)
      return 0

    start = np.array([end - length], np.int32)
    return self._prefill_own(tokens, start, end, finish, first=(end - length) // chunk)

  def _prefill_from_zero(self, cache, b, prompt, end):
    """With the prefix cache: prefills the prompt at rows [0, L) (its chunks aligned to its position 0), its first
    cached blocks taken from the prefix cache, stores its new whole blocks there, and moves its rows to
    [end - L, end) of slot b."""
    cfg, pc = self.engine.config, self.server.prefix_cache
    chunk, length, block = cfg.engine.prefill_chunk, len(prompt), cfg.kv.block
    keys, hit = pc.match(prompt)
    tokens = np.zeros((1, -(-length // chunk) * chunk), np.int32)
    tokens[0, :length] = prompt
    fresh = [[] for _ in range(len(hit), len(keys))]  # Per new block, its rows of each layer.

    def finish(l, head, open_page):
      fns = self.server.layer_fns[l]
      for i, rows in enumerate(fresh):
        rows.append(fns.block(head, np.int32((len(hit) + i) * chunk), size=chunk))
      window, open_page = fns.place(head, open_page, np.int32(end - length), w_rows=end // block * block)
      self._put_slot(cache, l, b, window if window.shape[3] else None, open_page)
      return 0

    try:
      # Every layer's blocks start moving to the devices now, one transfer a layer on the host-to-device copy stream;
      # each layer's are joined just before its prefill, so the transfers run behind the earlier layers' compute.
      fns = self.server.layer_fns
      blocks = [[e.rows[l] for e in hit] for l in range(len(fns))]
      moved = [jax.device_put(rows, rows[0].sharding.with_memory_kind("device")) for rows in blocks if rows]
      below = lambda l: fns[l].join(moved[l]) if moved else None  # None: no hit, the prompt's first chunk.
      x_new = self._prefill_own(tokens, np.zeros(1, np.int32), length, finish, first=len(hit), below=below)
      if fresh:  # Its own blocks stay pinned meanwhile: a block is not evicted to make room for its children.
        pc.add(keys, fresh, sum(a.nbytes for a in fresh[0]))
    finally:
      pc.release(hit)
    return x_new

  def result(self, wall_s: float, epochs: int) -> ServeResult:
    results = [
        RequestResult(t, self.digests.hexdigest(h), *(w or (-1, -1, -1)), error=e, ttft_s=f)
        for t, h, w, e, f in zip(self.tokens, self.hashes, self.where, self.errors, self.ttft_s)
    ]
    transcript = json.dumps([[r.tokens, r.logits_sha256] + ([r.error] if r.error else []) for r in results])
    report = dict(self.summary, compiled_shapes=len(self.shapes), epochs=epochs, **self.totals)
    if self.server.prefix_cache is not None:
      report["prefix_cache"] = self.server.prefix_cache.summary()
    report.update(self.counts.by_device())
    timing = dict(wall_s=wall_s, decode_steps=self.steps, tokens=sum(len(t) for t in self.tokens))
    return ServeResult(results, hashlib.sha256(transcript.encode()).hexdigest(), report, timing)
