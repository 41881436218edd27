"""Sampling keeps exactly the tokens that temperature, top-k and top-p leave, and draws them in proportion; each row
samples with its own settings and keys, so its tokens do not depend on the rows beside it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import sampling
from jaxkv.config import SamplingConfig

DRAWS = 4096  # Seeded: the same draws every run. A kept token of probability >= 0.03 is drawn ~120 times.
# Two rows in one call, their tokens in no particular order (the top-p mask is scattered back from sorted order).
PROBS = np.array([[0.1, 0.4, 0.05, 0.2, 0.25], [0.25, 0.05, 0.35, 0.15, 0.2]])
LOGITS = np.log(PROBS).astype(np.float32)


def _params(settings, seeds=None, streams=None) -> sampling.SamplingParams:
  n = len(settings)
  return sampling.SamplingParams.rows(settings, seeds or [0] * n, range(n) if streams is None else streams)


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
