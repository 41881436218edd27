"""Next-token selection, per row: greedy, or seeded sampling with temperature, top-k and top-p.

Every row has its own settings (`SamplingParams`, a pytree of per-row arrays: traced arguments of the one compiled
head, so rows with different settings share a batch) and its own keys: row b's token i draws with

  key(b, i) = fold_in(fold_in(key(seed[b]), stream[b]), i)

whatever its slot, its step or its neighbours, so a sequence samples the same tokens alone, in a batch, or in a
server's slot. `stream` tells apart sequences that share a seed: generate's sequence b is stream b of the run's seed,
a served request stream 0 of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.config import SamplingConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Per-row sampling settings (B rows): temperature f32[B] (0 = greedy), top_k i32[B] (0 = off), top_p f32[B]
  (1 = off), seed i32[B] and stream i32[B] (the row's keys, above). Built with `rows`; a field added later takes its
  default there, so callers do not change."""

  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  seed: jax.Array
  stream: jax.Array

  @classmethod
  def rows(cls, settings: Sequence[SamplingConfig], seeds: Sequence[int], streams: Sequence[int]) -> SamplingParams:
    """Host arrays (numpy) of one row per entry; the end ids are the host's business (jaxkv.telemetry.Recorder)."""
    return cls(
        temperature=np.array([s.temperature for s in settings], np.float32),
        top_k=np.array([s.top_k for s in settings], np.int32),
        top_p=np.array([s.top_p for s in settings], np.float32),
        seed=np.array(seeds, np.int32),
        stream=np.array(streams, np.int32),
    )


def row_key(seed: jax.Array, stream: jax.Array, index: jax.Array) -> jax.Array:
  """The key of a row's token `index` (i32[] each): the one key derivation (module docstring)."""
  return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), stream), index)


def sample(logits: jax.Array, params: SamplingParams, index: jax.Array) -> jax.Array:
  """logits f32[B, V], params of B rows, index i32[B] (each row's token index) -> i32[B].

  Greedy rows take the largest logit; where every row is greedy, nothing else is computed."""

  def drawn(lg):
    def one(row, temperature, top_k, top_p, seed, stream, i):
      return sample_row(row, row_key(seed, stream, i), temperature, top_k, top_p)

    p = params
    return jax.vmap(one)(lg, p.temperature, p.top_k, p.top_p, p.seed, p.stream, index)

  greedy = lambda lg: jnp.argmax(lg, axis=-1).astype(jnp.int32)
  return jax.lax.cond(jnp.all(params.temperature == 0.0), greedy, drawn, logits)


def sample_row(logits, key, temperature, top_k, top_p):
  """One row: logits f32[V]; temperature f32[], top_k i32[], top_p f32[] -> i32[].

  Greedy when temperature == 0 (key unused). Otherwise logits / temperature, keep the top_k largest (0 = all), then
  the smallest set whose probability reaches top_p, and draw one token."""
  x = logits[None]
  greedy = jnp.argmax(x, axis=-1).astype(jnp.int32)
  x = x / jnp.where(temperature == 0.0, 1.0, temperature)
  k = jnp.clip(top_k, 1, x.shape[-1])
  kth = jnp.take_along_axis(jnp.sort(x, axis=-1), jnp.broadcast_to(x.shape[-1] - k, (x.shape[0], 1)), axis=-1)
  x = jnp.where((top_k > 0) & (x < kth), -jnp.inf, x)
  order = jnp.argsort(-x, axis=-1)
  sorted_x = jnp.take_along_axis(x, order, axis=-1)
  cum = jnp.cumsum(jax.nn.softmax(sorted_x, axis=-1), axis=-1)
  # Keep a token if the mass before it is < top_p (the first token is always kept).
  keep_sorted = (cum - jax.nn.softmax(sorted_x, axis=-1)) < top_p
  keep = jnp.zeros_like(keep_sorted).at[jnp.arange(x.shape[0])[:, None], order].set(keep_sorted)
  x = jnp.where(keep | (top_p >= 1.0), x, -jnp.inf)
  drawn = jax.random.categorical(key, x, axis=-1).astype(jnp.int32)
  return jnp.where(temperature == 0.0, greedy, drawn)[0]
