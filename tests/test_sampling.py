"""Sampling keeps exactly the tokens that temperature, top-k and top-p leave, and draws them in proportion;
sample_traced (the serving head's per-request settings) draws the same tokens as sample with a SamplingConfig."""

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


def _draw(cfg: SamplingConfig, logits=LOGITS) -> np.ndarray:
  """i32[DRAWS, B]: one token per row for each of DRAWS keys."""
  keys = jax.random.split(jax.random.key(0), DRAWS)
  return np.asarray(jax.jit(jax.vmap(lambda k: sampling.sample(logits, k, cfg)))(keys))


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


def test_traced_settings_give_the_same_tokens_as_static_ones():
  logits = jax.random.normal(jax.random.key(1), (1, 256)) * 3
  traced = jax.jit(sampling.sample_traced)
  for temperature in (0.0, 0.7, 1.3):
    for top_k in (0, 1, 5, 300):
      for top_p in (1.0, 0.9, 0.3):
        cfg = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
        for seed in range(3):
          key = jax.random.key(seed)
          want = sampling.sample(logits, key, cfg)
          got = traced(logits, key, jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p))
          np.testing.assert_array_equal(got, want, err_msg=str((cfg, seed)))
