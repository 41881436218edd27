"""Library entry points behind the apps: build the mesh, the weights and the engine from a config."""

from __future__ import annotations

import jax
import numpy as np

from jaxkv import config as config_lib
from jaxkv import engine as engine_lib
from jaxkv import mesh as mesh_lib
from jaxkv import model


def build(config: config_lib.Config, seed: int):
  """Returns (mesh, params, engine) for a config, with seeded random weights."""
  mesh = mesh_lib.make_mesh(config.mesh)
  params = model.init_params(config.model, jax.random.key(seed), mesh)
  return mesh, params, engine_lib.Engine(config, mesh, params)


def random_prompts(vocab_size: int, lengths, seed: int) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(0, vocab_size, size=n).tolist() for n in lengths]


def generate_random(config_dict, lengths, max_new_tokens: int, seed: int) -> dict:
  """Generates from random prompts of the given lengths; returns a JSON-ready dict."""
  config = config_lib.from_config_dict(config_dict)
  prompts = random_prompts(config.model.vocab_size, lengths, seed)
  _, _, engine = build(config, seed)
  res = engine.generate(prompts, max_new_tokens, seed=seed)
  return dict(
      tokens=res.tokens,
      tokens_sha256=res.tokens_sha256,
      logits_sha256=res.logits_sha256,
      transport=res.transport,
      timing=res.timing,
      prompt_lengths=list(lengths),
      max_new_tokens=max_new_tokens,
      seed=seed,
      config=config_dict.to_dict(),
      devices=[str(d) for d in jax.devices()],
  )
