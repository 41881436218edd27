"""The decode state, with names: what the layers read (`Meta`), what the head carries from one step to the next
(`DecodeState`) and what it returns (`HeadOut`).

Meta is ONE array, meta i32[B + 1] = start[B], end: start[b] is the first valid row of sequence b (jaxkv.cache), end
the row the pass writes (the same for every sequence). One array, so that a prefill chunk's state is one explicit
host->device transfer; during decode the head computes the next step's on the device (`advance`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.sampling import SamplingParams


class Meta:
  """Named views of a meta array (host or device), and the operations the engine and the server apply to it."""

  @staticmethod
  def pack(start: np.ndarray, end: int) -> np.ndarray:
    """i32[B + 1] on the host, from start i32[B]."""
    return np.asarray(np.concatenate([start, [end]]), np.int32)

  @staticmethod
  def start(meta: jax.Array) -> jax.Array:
    """i32[B]."""
    return meta[:-1]

  @staticmethod
  def end(meta: jax.Array) -> jax.Array:
    return meta[-1]

  @staticmethod
  def advance(meta: jax.Array) -> jax.Array:
    """The next pass's meta: end + 1."""
    return meta + jnp.zeros_like(meta).at[-1].set(1)

  @staticmethod
  def with_start(meta: jax.Array, b: jax.Array, start_b: jax.Array) -> jax.Array:
    """meta with start[b] = start_b (i32[]): a slot taking a new request."""
    return jax.lax.dynamic_update_slice(meta, start_b[None], (b,))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
  """What one decode step reads and the head writes, on the head's devices (B = batch, D = d_model).

  x: [B, D], the head's input (the last pass's output, or the prompts' last rows after a prefill); in the head's
    output, the embeddings of the tokens it sampled: the next pass's input.
  meta: i32[B + 1] (Meta); end is the row the last pass wrote (the prompts' last row after a prefill), and in the
    head's output the row the next pass writes.
  index: i32[B], the token index that row b samples next (0: its first generated token).
  sampling: row b's sampling settings (jaxkv.sampling.SamplingParams).
  counts: i32[B, V], how often row b generated each token (what its penalties read).
  prompt: bool[B, V], the tokens of row b's prompt (marked where its repetition penalty reads them).
  allowed: bool[B, V], the tokens row b may sample next (all, but under a grammar: jaxkv.serving.grammar sets its
    row before each step; `allow`).
  """

  x: jax.Array
  meta: jax.Array
  index: jax.Array
  sampling: SamplingParams
  counts: jax.Array
  prompt: jax.Array
  allowed: jax.Array

  def with_row(self, b: jax.Array, row: DecodeState) -> DecodeState:
    """Inside jit: this state with row b replaced by `row`'s only row (a slot taking a request; end stays)."""
    put = lambda a, r: jax.lax.dynamic_update_slice_in_dim(a, r.astype(a.dtype), b, axis=0)
    return DecodeState(
        x=put(self.x, row.x),
        meta=Meta.with_start(self.meta, b, Meta.start(row.meta)[0]),
        index=put(self.index, row.index),
        sampling=jax.tree.map(put, self.sampling, row.sampling),
        counts=put(self.counts, row.counts),
        prompt=put(self.prompt, row.prompt),
        allowed=put(self.allowed, row.allowed),
    )

  def allow(self, b: jax.Array, allowed: jax.Array) -> DecodeState:
    """Inside jit: this state with row b's allowed tokens replaced by allowed bool[V]."""
    return dataclasses.replace(self, allowed=jax.lax.dynamic_update_slice(self.allowed, allowed[None], (b, 0)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HeadOut:
  """What the head returns of a step, copied to the host: logits f32[B, V] (the model's, before sampling: what the
  logits hashes cover and what log-probabilities derive from) and the sampled tokens i32[B]."""

  logits: jax.Array
  tokens: jax.Array

  def copy_to_host_async(self) -> None:
    self.logits.copy_to_host_async()
    self.tokens.copy_to_host_async()
