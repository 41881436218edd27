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


def sample_traced(logits, key, temperature, top_k, top_p):
  """`sample` with traced knobs (one jitted function serves requests with different settings): logits f32[B, V];
  temperature f32[], top_k i32[], top_p f32[] -> i32[B], the same bits as `sample` with a SamplingConfig of these
  values."""
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  x = logits / jnp.where(temperature == 0.0, 1.0, temperature)
  k = jnp.clip(top_k, 1, x.shape[-1])
  kth = jnp.take_along_axis(jnp.sort(x, axis=-1), jnp.broadcast_to(x.shape[-1] - k, (x.shape[0], 1)), axis=-1)
  x = jnp.where((top_k > 0) & (x < kth), -jnp.inf, x)
  order = jnp.argsort(-x, axis=-1)
  sorted_x = jnp.take_along_axis(x, order, axis=-1)
  cum = jnp.cumsum(jax.nn.softmax(sorted_x, axis=-1), axis=-1)
  keep_sorted = (cum - jax.nn.softmax(sorted_x, axis=-1)) < top_p
  keep = jnp.zeros_like(keep_sorted).at[jnp.arange(x.shape[0])[:, None], order].set(keep_sorted)
  x = jnp.where(keep | (top_p >= 1.0), x, -jnp.inf)
  drawn = jax.random.categorical(key, x, axis=-1).astype(jnp.int32)
  return jnp.where(temperature == 0.0, greedy, drawn)
