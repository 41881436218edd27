"""Library entry points: the mesh, the weights and the engine of a config, checked first (jaxkv.preflight)."""

from __future__ import annotations

import jax
import numpy as np

from jaxkv import checkpoint
from jaxkv import config as config_lib
from jaxkv import engine as engine_lib
from jaxkv import gguf_loader
from jaxkv import model
from jaxkv import preflight
from jaxkv import tokenizer as tokenizer_lib


def build(config: config_lib.Config, seed: int):
  """Returns (mesh, params, engine) for a config, with seeded random weights, after jaxkv.preflight's checks."""
  job = preflight.resolve(config)
  return (job.mesh, *random_engine(job, seed))


make_layout = preflight.layout  # The layout of config.split over a mesh.


def build_from_checkpoint(
    config: config_lib.Config | None,
    checkpoint_dir: str | None,
    dtype: str | None = None,
    *,
    gguf: str | None = None,
):
  """Returns (config, mesh, params, engine) with the model and weights of a Hugging Face checkpoint folder, or of
  the GGUF file `gguf` (then checkpoint_dir is None).

  The returned config is `config` (None: the library's defaults, jaxkv.config) with its model replaced by the
  checkpoint's (jaxkv.checkpoint.load, jaxkv.gguf_loader.load) and the checkpoint's end-of-sequence ids added to
  sampling.eos_ids; the kv, engine, mesh and split settings are kept. The checks of jaxkv.preflight run first.
  """
  job = preflight.resolve(config, checkpoint_dir, dtype, gguf)
  engine = checkpoint_engine(job, checkpoint_dir, dtype, gguf)
  return job.config, job.mesh, engine.params, engine


def random_engine(job: preflight.Job, seed: int):
  """(params, engine) of a checked job with seeded random weights."""
  params = model.init_params(job.config.model, jax.random.key(seed), job.mesh, job.layout)
  return params, engine_lib.Engine(job.config, job.mesh, params, job.layout)


def checkpoint_engine(
    job: preflight.Job, checkpoint_dir: str | None, dtype: str | None, gguf: str | None = None
) -> engine_lib.Engine:
  """The engine of a checked job (preflight.resolve with the same folder or file and dtype) with its weights."""
  if gguf is not None:
    model_config, params = gguf_loader.load(gguf, job.mesh, dtype, job.layout)
  else:
    model_config, params = checkpoint.load(checkpoint_dir, job.mesh, dtype, job.layout)
  assert model_config == job.config.model, (model_config, job.config.model)
  return engine_lib.Engine(job.config, job.mesh, params, job.layout)


def tokenizer(checkpoint_dir: str | None, gguf: str | None = None) -> tokenizer_lib.Tokenizer:
  """The tokenizer (with its chat template, where the checkpoint has one) of a checkpoint folder (its tokenizer.json)
  or of the GGUF file `gguf` (its metadata); ValueError when there is none that jaxkv reads."""
  if gguf is not None:
    return gguf_loader.tokenizer(gguf)
  return tokenizer_lib.Tokenizer.from_dir(checkpoint_dir)


def random_prompts(vocab_size: int, lengths, seed: int) -> list[list[int]]:
  """Prompts of random token ids of the given lengths, drawn from the seed."""
  rng = np.random.default_rng(seed)
  return [rng.integers(0, vocab_size, size=n).tolist() for n in lengths]
