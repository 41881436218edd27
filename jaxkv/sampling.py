"""Next-token selection, per row: greedy, or seeded sampling with temperature, min-p, top-k and top-p, after the
logits are shaped by penalties, a logit bias and the ids held back until a minimum length.

Every row has its own settings (`SamplingParams`, a pytree of per-row arrays: traced arguments of the one compiled
head, so rows with different settings share a batch and no value recompiles) and its own keys: row b's token i draws
with

  key(b, i) = fold_in(fold_in(key(seed[b]), stream[b]), i)

whatever its slot, its step or its neighbours, so a sequence samples the same tokens alone, in a batch, or in a
server's slot. `stream` tells apart sequences that share a seed: generate's sequence b is stream b of the run's seed,
a served request stream 0 of its own.

Shaping (`shape`, vLLM's order and meaning) reads each row's generated-token counts i32[B, V] and its prompt's
tokens bool[B, V] (jaxkv.meta.DecodeState): the repetition penalty divides the positive logits (multiplies the
negative) of tokens in the prompt or generated; the frequency and presence penalties subtract count * frequency and
presence from the logits of generated tokens; the logit bias adds to its ids; held ids (a request's end ids while
fewer than min_tokens were generated) get -inf, and so do the tokens its grammar does not allow (its `allowed` row).
A row without these settings keeps the model's logits bit for bit, so its greedy tokens are the largest of the
model's own logits, as they always were.

Log-probabilities (`logprobs`) are taken on the host from the step's logits, which come back anyway (HeadOut).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.config import SamplingConfig

MAX_BIAS = 300  # logit_bias entries a row holds (OpenAI's limit).
MAX_HELD = 16  # Ids a row holds back until its min_tokens.
MAX_TOP_LOGPROBS = 20  # Most likely tokens a row's log-probabilities list (OpenAI's limit).
NO_ID = np.iinfo(np.int32).max  # Pads a row's lists of ids: out of range, its updates are dropped.


@dataclasses.dataclass(frozen=True)
class Rules:
  """A request's own logit rules (none in the config): logit_bias {token id: added to its logit}, and the ids held
  back (-inf) while fewer than min_tokens tokens were generated (its end ids)."""

  logit_bias: Mapping[int, float] = dataclasses.field(default_factory=dict)
  min_tokens: int = 0
  held: tuple[int, ...] = ()

  def __post_init__(self):
    if len(self.logit_bias) > MAX_BIAS:
      raise ValueError(f"logit_bias holds at most {MAX_BIAS} entries, got {len(self.logit_bias)}")
    if len(self.held) > MAX_HELD:
      raise ValueError(f"at most {MAX_HELD} ids can be held back until min_tokens, got {len(self.held)}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Per-row sampling settings (B rows): temperature f32[B] (0 = greedy), top_k i32[B] (0 = off), top_p f32[B]
  (1 = off), seed i32[B] and stream i32[B] (the row's keys, above), min_p f32[B] (0 = off), presence f32[B],
  frequency f32[B] (0 = off), repetition f32[B] (1 = off), bias_ids i32[B, MAX_BIAS] and bias f32[B, MAX_BIAS] (the
  logit bias, padded with NO_ID), min_tokens i32[B] and held i32[B, MAX_HELD] (padded with NO_ID). Built with `rows`;
  a field added later takes its default there, so callers do not change."""

  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  seed: jax.Array
  stream: jax.Array
  min_p: jax.Array
  presence: jax.Array
  frequency: jax.Array
  repetition: jax.Array
  bias_ids: jax.Array
  bias: jax.Array
  min_tokens: jax.Array
  held: jax.Array

  @classmethod
  def rows(
      cls,
      settings: Sequence[SamplingConfig],
      seeds: Sequence[int],
      streams: Sequence[int],
      rules: Sequence[Rules | None] | None = None,
  ) -> SamplingParams:
    """Host arrays (numpy) of one row per entry (rules: none by default); the end ids are the host's business
    (jaxkv.telemetry.Recorder)."""
    rules = [r or Rules() for r in (rules or [None] * len(settings))]
    bias_ids = np.full((len(rules), MAX_BIAS), NO_ID, np.int32)
    bias = np.zeros((len(rules), MAX_BIAS), np.float32)
    held = np.full((len(rules), MAX_HELD), NO_ID, np.int32)
    for b, r in enumerate(rules):
      bias_ids[b, : len(r.logit_bias)] = list(r.logit_bias)
      bias[b, : len(r.logit_bias)] = list(r.logit_bias.values())
      held[b, : len(r.held)] = r.held
    return cls(
        temperature=np.array([s.temperature for s in settings], np.float32),
        top_k=np.array([s.top_k for s in settings], np.int32),
        top_p=np.array([s.top_p for s in settings], np.float32),
        seed=np.array(seeds, np.int32),
        stream=np.array(streams, np.int32),
        min_p=np.array([s.min_p for s in settings], np.float32),
        presence=np.array([s.presence_penalty for s in settings], np.float32),
        frequency=np.array([s.frequency_penalty for s in settings], np.float32),
        repetition=np.array([s.repetition_penalty for s in settings], np.float32),
        bias_ids=bias_ids,
        bias=bias,
        min_tokens=np.array([r.min_tokens for r in rules], np.int32),
        held=held,
    )


def prompt_tokens(prompts: Sequence[Sequence[int] | None], params: SamplingParams, vocab: int) -> np.ndarray:
  """bool[B, V] on the host: row b marks its prompt's tokens where its repetition penalty is on (only those read
  it)."""
  seen = np.zeros((len(prompts), vocab), bool)
  for b, p in enumerate(prompts):
    if p is not None and params.repetition[b] != 1.0:
      seen[b, np.asarray(p, np.int64)] = True
  return seen


def row_key(seed: jax.Array, stream: jax.Array, index: jax.Array) -> jax.Array:
  """The key of a row's token `index` (i32[] each): the one key derivation (module docstring)."""
  return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), stream), index)


def shape(
    logits: jax.Array,
    params: SamplingParams,
    counts: jax.Array,
    prompt: jax.Array,
    index: jax.Array,
    allowed: jax.Array | None = None,
):
  """logits f32[B, V], counts i32[B, V] (each row's generated tokens), prompt bool[B, V] (its prompt's tokens),
  index i32[B] (tokens generated), allowed bool[B, V] (the tokens it may sample: -inf elsewhere; None: all) ->
  f32[B, V], shaped as the module docstring says. Branch-free (no conditional, which a GPU would evaluate on the
  host): a row without shaping subtracts zeros, adds no bias, holds no id and allows every token, so its logits come
  out bit for bit."""
  p = params
  rows = jnp.arange(logits.shape[0])[:, None]
  rep = p.repetition[:, None]
  x = jnp.where((counts > 0) | prompt, jnp.where(logits > 0, logits / rep, logits * rep), logits)
  x = x - counts * p.frequency[:, None] - (counts > 0) * p.presence[:, None]
  x = x.at[rows, p.bias_ids].add(p.bias, mode="drop")
  held = jnp.where((index < p.min_tokens)[:, None], p.held, NO_ID)
  x = x.at[rows, held].set(-jnp.inf, mode="drop")
  return x if allowed is None else jnp.where(allowed, x, -jnp.inf)


def count(counts: jax.Array, tokens: jax.Array) -> jax.Array:
  """counts i32[B, V] with each row's new token i32[B] counted."""
  return counts.at[jnp.arange(counts.shape[0]), tokens].add(1)


def sample(logits: jax.Array, params: SamplingParams, index: jax.Array) -> jax.Array:
  """logits f32[B, V] (shaped), params of B rows, index i32[B] (each row's token index) -> i32[B].

  Greedy rows take the largest logit; where every row is greedy, nothing else is computed."""

  def drawn(lg):
    def one(row, temperature, top_k, top_p, min_p, seed, stream, i):
      return sample_row(row, row_key(seed, stream, i), temperature, top_k, top_p, min_p)

    p = params
    return jax.vmap(one)(lg, p.temperature, p.top_k, p.top_p, p.min_p, p.seed, p.stream, index)

  greedy = lambda lg: jnp.argmax(lg, axis=-1).astype(jnp.int32)
  return jax.lax.cond(jnp.all(params.temperature == 0.0), greedy, drawn, logits)


def sample_row(logits, key, temperature, top_k, top_p, min_p=0.0):
  """One row: logits f32[V]; temperature f32[], top_k i32[], top_p f32[], min_p f32[] -> i32[].

  Greedy when temperature == 0 (key unused). Otherwise the tokens that `filtered` keeps, drawn from."""
  greedy = jnp.argmax(logits[None], axis=-1).astype(jnp.int32)
  drawn = jax.random.categorical(key, filtered(logits, temperature, top_k, top_p, min_p), axis=-1).astype(jnp.int32)
  return jnp.where(temperature == 0.0, greedy, drawn)[0]


def filtered(logits, temperature, top_k, top_p, min_p):
  """One row's logits f32[V] -> f32[1, V], what a sampled row draws from: logits / temperature (1 where it is 0),
  -inf but for the tokens at least min_p times as likely as the most likely, then the top_k largest (0 = all), then
  the smallest set whose probability reaches top_p."""
  x = logits[None]
  x = x / jnp.where(temperature == 0.0, 1.0, temperature)
  probs = jax.nn.softmax(x, axis=-1)
  x = jnp.where(probs >= min_p * jnp.max(probs, axis=-1, keepdims=True), x, -jnp.inf)
  k = jnp.clip(top_k, 1, x.shape[-1])
  kth = jnp.take_along_axis(jnp.sort(x, axis=-1), jnp.broadcast_to(x.shape[-1] - k, (x.shape[0], 1)), axis=-1)
  x = jnp.where((top_k > 0) & (x < kth), -jnp.inf, x)
  order = jnp.argsort(-x, axis=-1)
  sorted_x = jnp.take_along_axis(x, order, axis=-1)
  cum = jnp.cumsum(jax.nn.softmax(sorted_x, axis=-1), axis=-1)
  # Keep a token if the mass before it is < top_p (the first token is always kept).
  keep_sorted = (cum - jax.nn.softmax(sorted_x, axis=-1)) < top_p
  keep = jnp.zeros_like(keep_sorted).at[jnp.arange(x.shape[0])[:, None], order].set(keep_sorted)
  return jnp.where(keep | (top_p >= 1.0), x, -jnp.inf)


ACCEPT_STREAM = 1  # A draft's acceptance draws from fold_in(key(b, i), ACCEPT_STREAM), token i from key(b, i).


def draft_split(x, draft):
  """The standard rule's two branches for a draft token d proposed with certainty (a drafter's one-hot q): x f32[V]
  (`filtered`, p = softmax(x)) -> p(d), the probability to accept d, and f32[V], the logits of the residual
  distribution p with d removed, renormalized, drawn from where d is rejected: p(d) [t = d] + (1 - p(d)) residual(t)
  = p(t), so the token's distribution is p whatever d is."""
  return jax.nn.softmax(x)[draft], x.at[draft].set(-jnp.inf)


def verify_row(logits, drafts, length, temperature, top_k, top_p, min_p, seed, stream, index):
  """One row of a speculative verify pass (jaxkv.jitted.verify_head): logits f32[T, V] at its positions, drafts
  i32[T - 1] (the first `length` real: drafts[j] proposed for position j), its settings, index i32[] (the token
  index of position 0). Returns its tokens i32[T] and accepted i32[]: tokens[:accepted + 1] follow its row end.

  Greedy (temperature 0): each position's largest logit; drafts accepted while they equal them. Sampled: position j
  accepts drafts[j] with probability p_j(drafts[j]) (`draft_split`, uniform from the ACCEPT_STREAM of token index
  index + j's key) while all before did; the first rejected position draws from its residual, and with every draft
  accepted the next position from p (key(index + j), as `sample_row` draws: with no draft a row samples the plain
  loop's token)."""
  t = logits.shape[0]
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [T]
  keys = jax.vmap(lambda j: row_key(seed, stream, index + j))(jnp.arange(t))
  xs = jax.vmap(lambda lg: filtered(lg, temperature, top_k, top_p, min_p)[0])(logits)  # [T, V]
  accept, residual = jax.vmap(draft_split)(xs[:-1], drafts)  # [T - 1], [T - 1, V]
  u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, ACCEPT_STREAM)))(keys[:-1])
  drafted = jnp.arange(t - 1) < length
  is_greedy = temperature == 0.0
  agree = drafted & jnp.where(is_greedy, drafts == greedy[:-1], u < accept)
  accepted = jnp.sum(jnp.cumprod(agree.astype(jnp.int32))).astype(jnp.int32)
  source = jnp.where(jnp.append(drafted, False)[:, None], jnp.concatenate([residual, xs[-1:]]), xs)
  drawn = jax.vmap(lambda k, x: jax.random.categorical(k, x[None], axis=-1)[0].astype(jnp.int32))(keys, source)
  own = jnp.where(jnp.arange(t) < accepted, jnp.append(drafts, 0), drawn)
  return jnp.where(is_greedy, greedy, own), accepted


def logprobs(logits: np.ndarray, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
  """On the host: logits f32[V] (the model's) -> the log-softmax in float32 of `token`, and the `top` most likely
  tokens (id, log-probability), most likely first (ties: the lower id)."""
  x = np.asarray(logits, np.float32)
  m = x.max()
  lp = x - (m + np.log(np.exp(x - m, dtype=np.float32).sum(dtype=np.float32)))
  ids = np.lexsort((np.arange(len(x)), -lp))[:top] if top else []
  return float(lp[token]), [(int(i), float(lp[i])) for i in ids]
