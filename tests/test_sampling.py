"""Sampling keeps exactly the tokens that temperature, min-p, top-k and top-p leave (their boundaries included), and
draws them in proportion; each row samples with its own settings and keys, so its tokens do not depend on the rows
beside it. Shaping (penalties, logit bias, held ids) equals the rules written out, and leaves alone the rows that ask
for none; log-probabilities are the float32 log-softmax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import reference
from jaxkv import sampling
from jaxkv.config import SamplingConfig

DRAWS = 4096  # Seeded: the same draws every run. A kept token of probability >= 0.03 is drawn ~120 times.
# Two rows in one call, their tokens in no particular order (the top-p mask is scattered back from sorted order).
PROBS = np.array([[0.1, 0.4, 0.05, 0.2, 0.25], [0.25, 0.05, 0.35, 0.15, 0.2]])
LOGITS = np.log(PROBS).astype(np.float32)


def _params(settings, seeds=None, streams=None, rules=None) -> sampling.SamplingParams:
  n = len(settings)
  return sampling.SamplingParams.rows(settings, seeds or [0] * n, range(n) if streams is None else streams, rules)


def _draw(cfg: SamplingConfig, logits=LOGITS) -> np.ndarray:
  """i32[DRAWS, B]: one token per row for each of DRAWS token indices (each its own key)."""
  params = _params([cfg] * logits.shape[0])
  draw = lambda i: sampling.sample(logits, params, jnp.full(logits.shape[0], i, jnp.int32))
  return np.asarray(jax.jit(jax.vmap(draw))(jnp.arange(DRAWS)))


def _expected(probs: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
  """f64[V]: the distribution that the config leaves, written out: p^(1/T), the top_k largest, then the smallest
  prefix (in order of probability) whose mass before each kept token is < top_p."""
  p = probs ** (1 / temperature)
  p = p / p.sum()
  order = np.argsort(-p, kind="stable")
  keep = np.zeros(len(p), bool)
  keep[order[: top_k or len(p)]] = True
  p = np.where(keep, p, 0)
  p = p / p.sum()
  before = np.cumsum(p[order]) - p[order]
  keep[order[before >= top_p]] = False
  p = np.where(keep, p, 0)
  return p / p.sum()


@pytest.mark.parametrize(
    "temperature, top_k, top_p, kept",
    [
        (1.0, 0, 1.0, [{0, 1, 2, 3, 4}, {0, 1, 2, 3, 4}]),
        (1.0, 3, 1.0, [{1, 3, 4}, {0, 2, 4}]),
        (1.0, 0, 0.62, [{1, 4}, {0, 2, 4}]),  # Mass before the third: 0.65 and 0.6.
        (1.0, 3, 0.45, [{1}, {0, 2}]),  # top_k first, then top_p of what it left: 0.4 / 0.85 >= 0.45 (0.4 < 0.45).
        (0.5, 0, 0.62, [{1, 4}, {0, 2}]),  # Sharper: row 1's 0.2 falls out (mass before it 0.74 of p^2).
        (1.0, 1, 1.0, [{1}, {2}]),  # top_k 1 is greedy.
    ],
)
def test_kept_tokens_and_their_frequencies(temperature, top_k, top_p, kept):
  toks = _draw(SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p))
  for b in range(len(PROBS)):
    want = _expected(PROBS[b], temperature, top_k, top_p)
    assert set(np.flatnonzero(want)) == kept[b], (b, want)  # The written-out rule agrees with the table.
    assert set(toks[:, b].tolist()) == kept[b], b
    freq = np.bincount(toks[:, b], minlength=PROBS.shape[1]) / DRAWS
    np.testing.assert_allclose(freq, want, atol=0.03)


def test_greedy_ignores_the_key_and_takes_the_largest():
  toks = _draw(SamplingConfig())
  assert (toks == PROBS.argmax(-1)).all()


def test_a_row_samples_alone_what_it_samples_among_others():
  """Rows of different settings, seeds and token indices in one batch: each row's token is the one it draws alone,
  and a greedy row among sampled ones takes its largest logit."""
  logits = jax.random.normal(jax.random.key(1), (6, 256)) * 3
  settings = [
      SamplingConfig(),
      SamplingConfig(temperature=0.7),
      SamplingConfig(temperature=1.3, top_k=5),
      SamplingConfig(temperature=1.0, top_p=0.3),
      SamplingConfig(temperature=0.9, top_k=300, top_p=0.9),
      SamplingConfig(temperature=1.0, top_k=1),
  ]
  params, index = _params(settings, seeds=[3, 1, 4, 1, 5, 9]), jnp.array([0, 7, 2, 2, 11, 3], jnp.int32)
  sample = jax.jit(sampling.sample)
  batched = np.asarray(sample(logits, params, index))
  for b in range(len(settings)):
    row = jax.tree.map(lambda a: a[b : b + 1], params)
    np.testing.assert_array_equal(sample(logits[b : b + 1], row, index[b : b + 1]), batched[b : b + 1], err_msg=b)
  assert batched[0] == np.argmax(logits[0]) and batched[5] == np.argmax(logits[5])


def test_a_row_without_truncation_draws_the_plain_categorical_of_its_key():
  """temperature 1, no top-k or top-p: the token jax.random.categorical draws with the row's key (the reference)."""
  logits = jax.random.normal(jax.random.key(2), (256,)) * 2
  for seed, stream, index in ((0, 0, 0), (7, 0, 5), (7, 3, 5), (2**31 - 1, 1, 1000)):
    key = sampling.row_key(jnp.int32(seed), jnp.int32(stream), jnp.int32(index))
    got = sampling.sample_row(logits, key, jnp.float32(1.0), jnp.int32(0), jnp.float32(1.0))
    np.testing.assert_array_equal(got, jax.random.categorical(key, logits), err_msg=str((seed, stream, index)))


@pytest.mark.parametrize("traced", [False, True])
def test_top_p_keeps_a_token_whose_mass_reaches_it_exactly_and_no_more(traced):
  """log([0.5, 0.25, 0.25]) with top_p 0.5: token 0's mass reaches top_p, so the next token's mass before it is not
  below it, and only token 0 is drawn (a `<=` in the rule would let tokens 1 and 2 in); min_p 0.5 keeps tokens whose
  probability is at least half the largest: all three, exactly at the boundary."""
  logits = np.log(np.array([[0.5, 0.25, 0.25]] * 2)).astype(np.float32)
  for cfg, kept in (
      (SamplingConfig(temperature=1.0, top_p=0.5), {0}),
      (SamplingConfig(temperature=1.0, min_p=0.5), {0, 1, 2}),
  ):
    params = _params([cfg] * 2, seeds=[5, 6])
    if traced:  # The settings as traced arguments of one compiled call, as the head gets them.
      draw = jax.jit(jax.vmap(lambda i, p: sampling.sample(logits, p, jnp.full(2, i, jnp.int32)), in_axes=(0, None)))
      toks = np.asarray(draw(jnp.arange(DRAWS), params))
    else:
      # Each eager call compiles its conditional's branches anew: few draws (64 per config still see every kept id).
      toks = np.stack([np.asarray(sampling.sample(logits, params, jnp.full(2, i, jnp.int32))) for i in range(32)])
    assert set(toks.ravel().tolist()) == kept, cfg


def test_min_p_keeps_the_tokens_at_least_that_fraction_of_the_largest():
  # Row 0: 0.4 is the largest; min_p 0.6 keeps p >= 0.24: tokens 1 and 4 (0.25). Row 1: 0.35 * 0.6 = 0.21: 0, 2.
  toks = _draw(SamplingConfig(temperature=1.0, min_p=0.6))
  assert set(toks[:, 0].tolist()) == {1, 4} and set(toks[:, 1].tolist()) == {0, 2}


def test_shaping_applies_penalties_bias_and_held_ids_per_row():
  v = 64
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(4, v)).astype(np.float32) * 3
  counts = rng.integers(0, 3, size=(4, v)).astype(np.int32) * (rng.random((4, v)) < 0.2)
  prompt = rng.random((4, v)) < 0.1
  settings = [
      SamplingConfig(),  # No shaping: its logits as they are.
      SamplingConfig(presence_penalty=0.5, frequency_penalty=-0.25),
      SamplingConfig(repetition_penalty=1.3),
      SamplingConfig(temperature=0.7, presence_penalty=1.0),
  ]
  rules = [sampling.Rules(), sampling.Rules({3: -100.0, 7: 5.5}), sampling.Rules(min_tokens=2, held=(1, 9)), None]
  params = _params(settings, rules=rules)
  seen = sampling.prompt_tokens([[1], [2, 3], [int(i) for i in np.flatnonzero(prompt[2])], [4]], params, v)
  assert not seen[0].any() and not seen[1].any() and seen[2].sum() == prompt[2].sum()  # Read where repetition is on.
  index = np.array([0, 0, 1, 5], np.int32)
  got = np.asarray(jax.jit(sampling.shape)(logits, params, counts, seen, index))
  for b in range(4):
    want = reference.shaped_logits(logits[b], counts[b], seen[b], settings[b], rules[b] or sampling.Rules(), index[b])
    # XLA's CPU division is not correctly rounded (1 ulp off numpy's): the rule is the claim here, not the bits.
    np.testing.assert_allclose(got[b], want, rtol=2e-7, atol=0, err_msg=str(b))
  np.testing.assert_array_equal(got[0], logits[0])  # Shaped among others, a row without shaping is untouched.
  assert got[1, 3] < -90 and got[2, 1] == got[2, 9] == -np.inf
  # Past min_tokens, the held ids are back.
  later = np.asarray(sampling.shape(logits, params, counts, seen, np.full(4, 2, np.int32)))
  assert np.isfinite(later[2, [1, 9]]).all()


def test_without_shaping_the_logits_pass_through_bit_for_bit_and_tokens_are_counted():
  """Rows without shaping, with counts and prompt tokens marked (as beside a row with penalties): their logits as
  they are, -0.0 and -inf included."""
  logits = LOGITS.copy()
  logits[0, 1], logits[1, 3] = -0.0, -np.inf
  params = _params([SamplingConfig(), SamplingConfig(temperature=1.0, top_k=3)])
  counts = jnp.array([[0, 2, 0, 1, 0], [1, 0, 0, 3, 0]], jnp.int32)
  out = np.asarray(sampling.shape(logits, params, counts, np.ones((2, 5), bool), jnp.zeros(2, jnp.int32)))
  np.testing.assert_array_equal(out.view(np.int32), logits.view(np.int32))
  np.testing.assert_array_equal(sampling.count(counts, jnp.array([1, 2])), [[0, 3, 0, 1, 0], [1, 0, 1, 3, 0]])


def test_rules_are_bounded():
  with pytest.raises(ValueError, match="at most 300"):
    sampling.Rules({i: 1.0 for i in range(sampling.MAX_BIAS + 1)})
  with pytest.raises(ValueError, match="held back"):
    sampling.Rules(min_tokens=1, held=tuple(range(sampling.MAX_HELD + 1)))


def test_logprobs_are_the_float32_log_softmax_and_its_largest():
  logits = np.array([1.0, 3.0, -2.0, 3.0, 0.5], np.float32)
  want = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum())
  lp, top = sampling.logprobs(logits, 2, 3)
  np.testing.assert_allclose(lp, want[2], rtol=0, atol=1e-6)
  assert [i for i, _ in top] == [1, 3, 0]  # Ties: the lower id first.
  np.testing.assert_allclose([l for _, l in top], want[[1, 3, 0]], rtol=0, atol=1e-6)
  assert sampling.logprobs(logits, 0, 0)[1] == []
