"""sample_traced (the serving head's per-request settings) draws the same tokens as sample with a SamplingConfig."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import sampling
from jaxkv.config import SamplingConfig


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
