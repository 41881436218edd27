"""jaxkv's decoder against jaxkv.reference.forward_numpy, which shares no code with jaxkv.model (numpy, float64):
the plain JAX reference and the engine's decode, in the Llama family (Llama-3 RoPE scaling) and the Qwen3 one (q/k
RMSNorm, tied embeddings)."""

import dataclasses

import helpers
import jax
import numpy as np
import pytest

from jaxkv import config as config_lib
from jaxkv import engine as engine_lib
from jaxkv import model
from jaxkv import reference

# Both in float32 against float64: what differs is rounding (RoPE's frequencies and angles included), ~1e-6.
RTOL = 1e-5
FAMILIES = {
    # head_dim 16, theta 1e4: wavelengths 6.3 (kept, < 32 / 4), 20 (smoothed) and 63 and up (divided by 8).
    "llama": dict(rope_scaling=config_lib.RopeScaling(original_max_position=32)),
    "qwen3": dict(qk_norm=True, tie_embeddings=True),
}


def _model(family: str, tensor: int):
  """(config, params): the tiny model of a family with its norm weights drawn around 1 (init_params makes them ones),
  so that every weight shows in the logits."""
  cfg = helpers.tiny_config()
  cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **FAMILIES[family]))
  params = model.init_params(cfg.model, jax.random.key(3), helpers.mesh(tensor))
  rng = np.random.default_rng(3)

  def norms_away_from_one(path, a):
    if not path[-1].key.endswith("norm"):
      return a
    return jax.device_put((1 + 0.3 * rng.standard_normal(a.shape)).astype(a.dtype), a.sharding)

  return cfg, jax.tree_util.tree_map_with_path(norms_away_from_one, params)


def _relative_error(got, want) -> float:
  return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


def test_the_frequencies_of_llama3_scaling():
  cfg = dataclasses.replace(helpers.tiny_config().model, **FAMILIES["llama"])
  inv = reference.inverse_frequencies(cfg)
  base = 10_000.0 ** (-np.arange(0, 16, 2) / 16)
  assert inv[0] == base[0] and (inv[2:] == base[2:] / 8).all()  # Kept, then divided.
  assert base[1] / 8 < inv[1] < base[1]  # Smoothed.
  np.testing.assert_allclose(model.rope_frequencies(cfg), inv, rtol=1e-7)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_plain_reference_matches_float64(family):
  cfg, params = _model(family, 1)
  tokens = np.array(helpers.prompts([20, 20]))
  want = reference.forward_numpy(params, tokens, cfg.model)
  assert _relative_error(reference.forward(params, tokens, cfg.model), want) < RTOL


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_engine_decode_matches_float64(family):
  """Host placement, depth 2, 2 devices, prompts of 9 and 20 tokens (left padding, two prefill chunks): every step's
  logits, and the greedy tokens are the float64 argmax."""
  cfg, params = _model(family, 2)
  kv = dataclasses.replace(cfg.kv, placement="host", pipeline_depth=2)
  engine = engine_lib.Engine(dataclasses.replace(cfg, kv=kv), helpers.mesh(2), params)
  prompts = helpers.prompts([9, 20])
  res = engine.generate(prompts, 8, keep_logits=True)
  for b, prompt in enumerate(prompts):
    want = reference.forward_numpy(params, np.array([prompt + res.tokens[b][:-1]]), cfg.model)[0, len(prompt) - 1 :]
    assert _relative_error(res.logits[:, b], want) < RTOL
    assert res.tokens[b] == want.argmax(-1).tolist()
