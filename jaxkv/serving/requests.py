"""What the server is asked and what it answers: `Request`, `RequestResult`, `ServeResult`."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxkv.config import SamplingConfig
from jaxkv.sampling import Rules

# The counters summed over a serve(), in ServeResult.transport whatever the run did.
TOTALS = ("h2d_bytes", "d2h_bytes", "ring_high_water_bytes_per_device", "insertions")


@dataclasses.dataclass(frozen=True)
class Request:
  """prompt: token ids; max_new_tokens: tokens to generate (EOS ends it earlier; None: until EOS or the capacity,
  reserving no rows for it: it ends at the capacity, "length", whatever row it entered at); seed: its sampling seed
  (its tokens draw from stream 0 of it: jaxkv.sampling); sampling: its temperature, top_k, top_p, min_p and
  penalties (None = the engine's; the engine's end ids, sampling.stop_ids, apply to all); rules: its logit bias and
  the ids it holds back until min_tokens (None = none); logprobs: how many of the most likely tokens each of its
  tokens' log-probabilities lists (None = no log-probabilities; jaxkv.sampling.logprobs); prompt_logprobs: the same
  for its prompt's tokens, each under the ones before it (None = none; the prefix cache then serves it no rows);
  prompt_shares: how many requests after it with the same prompt take its prefilled rows instead of computing them
  (n samples of one prompt; jaxkv.serving.slots.SlotFiller.fill); grammar: the jaxkv.serving.grammar.Grammar its
  tokens follow (None = none; its matcher advances as they are read, so the loop reads each step before the next)."""

  prompt: tuple[int, ...]
  max_new_tokens: int | None
  seed: int = 0
  sampling: SamplingConfig | None = None
  rules: Rules | None = None
  logprobs: int | None = None
  prompt_logprobs: int | None = None
  prompt_shares: int = 0
  grammar: Any = None


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
