"""The decode state the jitted functions read, with names: ONE array meta i32[B + 3] = start[B], end, step, seed.

start[b]: the first valid row of sequence b (jaxkv.cache); end: the row the pass writes; step: the token index the
head samples (0 for the prompt's last row); seed: the sampling seed. One array, so that a prefill chunk's state is one
explicit host->device transfer; during decode the head computes the next step's on the device (`advance`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


class Meta:
  """Named views of a meta array (host or device), and the operations the engine and the server apply to it."""

  @staticmethod
  def pack(start: np.ndarray, end: int, step: int, seed: int) -> np.ndarray:
    """i32[B + 3] on the host, from start i32[B]."""
    return np.asarray(np.concatenate([start, [end, step, seed]]), np.int32)

  @staticmethod
  def start(meta: jax.Array) -> jax.Array:
    """i32[B]."""
    return meta[:-3]

  @staticmethod
  def end(meta: jax.Array) -> jax.Array:
    return meta[-3]

  @staticmethod
  def step(meta: jax.Array) -> jax.Array:
    return meta[-2]

  @staticmethod
  def seed(meta: jax.Array) -> jax.Array:
    return meta[-1]

  @staticmethod
  def advance(meta: jax.Array) -> jax.Array:
    """The next decode step's meta: end + 1, step + 1."""
    return meta + jnp.zeros_like(meta).at[-3:-1].set(1)

  @staticmethod
  def with_start(meta: jax.Array, b: jax.Array, start_b: jax.Array) -> jax.Array:
    """meta with start[b] = start_b (i32[]): a slot taking a new request."""
    return jax.lax.dynamic_update_slice(meta, start_b[None], (b,))
