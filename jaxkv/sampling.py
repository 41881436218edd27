"""Next-token selection: greedy, or seeded sampling with temperature, top-k and top-p."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.config import SamplingConfig


def sample(logits, key, cfg: SamplingConfig):
  """logits f32[B, V]; key: a PRNG key for this step -> i32[B].

  Greedy when cfg.temperature == 0 (key unused). Otherwise logits / temperature, keep the top_k largest
  (0 = all), then the smallest set whose probability reaches top_p, and draw one token per row.
  """
  if cfg.temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  x = logits / cfg.temperature
  if cfg.top_k:
    kth = jax.lax.top_k(x, min(cfg.top_k, x.shape[-1]))[0][:, -1:]
    x = jnp.where(x < kth, -jnp.inf, x)
  if cfg.top_p < 1.0:
    order = jnp.argsort(-x, axis=-1)
    sorted_x = jnp.take_along_axis(x, order, axis=-1)
    cum = jnp.cumsum(jax.nn.softmax(sorted_x, axis=-1), axis=-1)
    # Keep a token if the mass before it is < top_p (the first token is always kept).
    keep_sorted = (cum - jax.nn.softmax(sorted_x, axis=-1)) < cfg.top_p
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(x.shape[0])[:, None], order].set(keep_sorted)
    x = jnp.where(keep, x, -jnp.inf)
  return jax.random.categorical(key, x, axis=-1).astype(jnp.int32)
