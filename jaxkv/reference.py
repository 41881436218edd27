"""Plain reference: the whole sequence recomputed with a causal mask, no cache, no padding, no chunks.

Tests check the engine (cache, pages, delivery modes, chunked prefill) against it.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxkv import model
from jaxkv.config import ModelConfig


def forward(params, tokens, cfg: ModelConfig):
  """tokens i32[B, S] -> f32 logits [B, S, V] for every position."""
  _, s = tokens.shape
  pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), tokens.shape)
  causal = jnp.tril(jnp.ones((s, s), bool))[None]
  x = model.embed(params, tokens)
  for p in params["layers"]:
    q, k, v = model.qkv(p, x, pos, cfg)
    kv = jnp.stack([k, v]).transpose(0, 1, 3, 2, 4)
    x = model.attn_out_and_mlp(p, x, model.attention(q, kv, causal), cfg)
  return model.logits(params, x, cfg)
