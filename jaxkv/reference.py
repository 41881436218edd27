"""Plain references: the whole sequence recomputed with a causal mask, no cache, no padding, no chunks.

`forward` runs jaxkv.model's own layer functions (qkv, attention, MLP) without the engine: tests check the engine
(cache, pages, delivery modes, chunked prefill) against it. `forward_numpy` shares no code with jaxkv.model: the
same decoder written again in numpy float64 after the Hugging Face Llama / Qwen3 definitions, so that the model's
maths is checked by something other than itself. `shaped_logits` writes out the sampler's logit shaping (penalties,
bias, held ids) in numpy, for jaxkv.sampling.shape.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import model
from jaxkv import sampling
from jaxkv.config import ModelConfig, RopeScaling, SamplingConfig


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


def inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
  """f64[Dh / 2]: theta^(-2i / Dh), each scaled as Llama-3 does when cfg.rope_scaling is set: wavelengths above
  original_max_position / low_freq_factor divided by the factor, below original_max_position / high_freq_factor
  kept, and in between interpolated by how many turns fit in the original context."""
  out = []
  for i in range(cfg.head_dim // 2):
    f = cfg.rope_theta ** (-2 * i / cfg.head_dim)
    s: RopeScaling | None = cfg.rope_scaling
    if s is not None:
      wavelength = 2 * math.pi / f
      if wavelength > s.original_max_position / s.low_freq_factor:
        f = f / s.factor
      elif wavelength >= s.original_max_position / s.high_freq_factor:
        t = (s.original_max_position / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        f = (1 - t) * f / s.factor + t * f
    out.append(f)
  return np.array(out)


def forward_numpy(params, tokens, cfg: ModelConfig) -> np.ndarray:
  """tokens int[B, S] -> f64 logits [B, S, V] for every position, in numpy float64 (params are gathered and cast).

  Per layer: RMSNorm (x / sqrt(mean(x^2) + eps) * w), q/k/v projections, per-head q/k RMSNorm (qk_norm),
  rotate-half RoPE at positions 0..S-1, causal softmax attention with query head h reading KV head h // (H / K),
  the output projection, a residual; RMSNorm, SwiGLU (silu(x W_gate) * x W_up) W_down, a residual. Then the final
  RMSNorm and the head (the embedding's transpose when tied).
  """
  p = jax.tree.map(lambda a: np.asarray(jax.device_get(a), np.float64), params)
  tokens = np.asarray(tokens)
  _, s = tokens.shape
  eps, half = cfg.rms_eps, cfg.head_dim // 2
  group = cfg.num_heads // cfg.num_kv_heads

  def norm(x, w):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w

  angle = np.arange(s)[:, None] * inverse_frequencies(cfg)[None, :]  # [S, Dh / 2]
  cos, sin = np.cos(angle)[None, :, None, :], np.sin(angle)[None, :, None, :]

  def rope(x):  # [B, S, N, Dh]
    first, second = x[..., :half], x[..., half:]
    return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)

  future = np.triu(np.ones((s, s), bool), k=1)  # [query, key]: True where the key comes later.
  x = p["embed"][tokens]  # [B, S, D]
  for w in p["layers"]:
    h = norm(x, w["attn_norm"])
    q, k, v = (np.einsum("bsd,dnk->bsnk", h, w[name]) for name in ("wq", "wk", "wv"))
    if cfg.qk_norm:
      q, k = norm(q, w["q_norm"]), norm(k, w["k_norm"])
    q, k = rope(q), rope(k)
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)  # [B, S, H, Dh]
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(cfg.head_dim)
    scores = np.where(future, -np.inf, scores)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    x = x + np.einsum("bhqk,bkhd,hde->bqe", weights, v, w["wo"])
    h = norm(x, w["mlp_norm"])
    gate, up = h @ w["w_gate"], h @ w["w_up"]
    x = x + (gate / (1 + np.exp(-gate)) * up) @ w["w_down"]
  head = p["embed"].T if cfg.tie_embeddings else p["lm_head"]
  return norm(x, p["final_norm"]) @ head


def shaped_logits(logits, counts, prompt, cfg: SamplingConfig, rules: sampling.Rules, index: int) -> np.ndarray:
  """One row's logits f32[V] shaped as jaxkv.sampling.shape shapes them, written out in numpy (vLLM's rules): counts
  [V] its generated tokens, prompt bool[V] its prompt's, index the tokens it generated."""
  x = np.asarray(logits, np.float32).copy()
  seen = (counts > 0) | prompt
  rep = np.float32(cfg.repetition_penalty)
  x[seen] = np.where(x[seen] > 0, x[seen] / rep, x[seen] * rep)
  c = np.asarray(counts, np.float32)
  x = x - c * np.float32(cfg.frequency_penalty) - (c > 0).astype(np.float32) * np.float32(cfg.presence_penalty)
  for i, b in rules.logit_bias.items():
    x[i] += np.float32(b)
  if index < rules.min_tokens:
    x[list(rules.held)] = -np.inf
  return x
