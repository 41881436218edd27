"""Library entry points behind the apps: build the mesh, the weights and the engine from a config."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from jaxkv import checkpoint
from jaxkv import config as config_lib
from jaxkv import distributed
from jaxkv import engine as engine_lib
from jaxkv import gguf_loader
from jaxkv import layout as layout_lib
from jaxkv import mesh as mesh_lib
from jaxkv import model
from jaxkv import serving
from jaxkv import tokenizer as tokenizer_lib


def build(config: config_lib.Config, seed: int):
  """Returns (mesh, params, engine) for a config, with seeded random weights."""
  mesh = mesh_lib.make_mesh(config.mesh)
  layout = make_layout(config, mesh)
  params = model.init_params(config.model, jax.random.key(seed), mesh, layout)
  return mesh, params, engine_lib.Engine(config, mesh, params, layout)


def make_layout(config: config_lib.Config, mesh) -> layout_lib.Layout:
  """The layout of config.split over the devices of `mesh`."""
  split = layout_lib.parse_layer_split(config.split.layer_split)
  return layout_lib.make_layout(config.split.mode, mesh, config.model.num_layers, split)


def build_from_checkpoint(
    config: config_lib.Config, checkpoint_dir: str | None, dtype: str | None = None, *, gguf: str | None = None
):
  """Returns (config, mesh, params, engine) with the model and weights of a Hugging Face checkpoint folder, or of
  the GGUF file `gguf` (then checkpoint_dir is None).

  The returned config is `config` with its model replaced by the checkpoint's (jaxkv.checkpoint.load,
  jaxkv.gguf_loader.load); the kv, engine, sampling and mesh settings are kept.
  """
  if config.split.mode != "tensor":
    raise ValueError(f"checkpoints load in split mode tensor only; got split mode {config.split.mode!r}")
  mesh = mesh_lib.make_mesh(config.mesh)
  if gguf is not None:
    model_config, params = gguf_loader.load(gguf, mesh, dtype)
  else:
    model_config, params = checkpoint.load(checkpoint_dir, mesh, dtype)
  config = dataclasses.replace(config, model=model_config)
  return config, mesh, params, engine_lib.Engine(config, mesh, params)


def random_prompts(vocab_size: int, lengths, seed: int) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(0, vocab_size, size=n).tolist() for n in lengths]


def _generate(engine: engine_lib.Engine, prompts, max_new_tokens: int, seed: int):
  """engine.generate, and the bytes of KV windows that this process holds in the cache's memory at the end (0 when
  no decode step ran)."""
  last = {}
  res = engine.generate(prompts, max_new_tokens, seed=seed, on_step=lambda _, cache: last.update(cache=cache))
  return res, distributed.process_bytes(last["cache"].windows) if last else 0


def _result(
    res: engine_lib.GenerateResult, kv_bytes: int, config_dict, prompt_lengths, max_new_tokens: int, seed: int
) -> dict:
  return dict(
      tokens=res.tokens,
      tokens_sha256=res.tokens_sha256,
      logits_sha256=res.logits_sha256,
      transport=dict(res.transport, kv_window_bytes_process=kv_bytes),
      timing=res.timing,
      prompt_lengths=list(prompt_lengths),
      max_new_tokens=max_new_tokens,
      seed=seed,
      config=config_dict.to_dict(),
      devices=[str(d) for d in jax.devices()],
      processes=jax.process_count(),
  )


def generate_random(config_dict, lengths, max_new_tokens: int, seed: int) -> dict:
  """Generates from random prompts of the given lengths; returns a JSON-ready dict."""
  config = config_lib.from_config_dict(config_dict)
  prompts = random_prompts(config.model.vocab_size, lengths, seed)
  _, _, engine = build(config, seed)
  res, kv_bytes = _generate(engine, prompts, max_new_tokens, seed)
  return _result(res, kv_bytes, config_dict, lengths, max_new_tokens, seed)


def serve_random(config_dict, sequences: int, parallel: int, max_length: int, max_new_tokens: int, seed: int) -> dict:
  """Serves `sequences` random requests on `parallel` slots (jaxkv.serving); prompt lengths are drawn from
  [1, max_length] and max_new_tokens from [max(1, max_new_tokens // 2), max_new_tokens]. Returns a JSON-ready dict."""
  config = config_lib.from_config_dict(config_dict)
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, max_length + 1, size=sequences).tolist()
  news = rng.integers(max(1, max_new_tokens // 2), max_new_tokens + 1, size=sequences).tolist()
  prompts = random_prompts(config.model.vocab_size, lengths, seed)
  requests = [serving.Request(tuple(p), n, seed=seed + i) for i, (p, n) in enumerate(zip(prompts, news))]
  _, _, engine = build(config, seed)
  res = serving.Server(engine, parallel).serve(requests)
  return dict(
      requests=[
          dict(prompt_length=len(r.prompt), max_new_tokens=r.max_new_tokens, **dataclasses.asdict(o))
          for r, o in zip(requests, res.results)
      ],
      transcript_sha256=res.transcript_sha256,
      transport=res.transport,
      timing=res.timing,
      parallel=parallel,
      seed=seed,
      config=config_dict.to_dict(),
      devices=[str(d) for d in jax.devices()],
  )


def generate_checkpoint(
    config_dict,
    checkpoint_dir: str | None,
    *,
    prompts: Sequence[str] | None = None,
    lengths: Sequence[int] = (),
    max_new_tokens: int,
    seed: int,
    dtype: str | None = None,
    gguf: str | None = None,
    chat: bool = False,
) -> dict:
  """Generates with a checkpoint folder's (or the GGUF file `gguf`'s) model and weights; returns a JSON-ready dict.

  With `prompts` (text, one per sequence) the checkpoint's tokenizer encodes them (as user turns in its chat
  template with `chat`) and decodes the output: the dict gains `prompts`, `prompt_tokens` and `text` (the decoded
  new tokens per sequence). Without, the prompts are random token ids of the given `lengths`, as in
  `generate_random`. The model section of `config_dict` is replaced by the checkpoint's (`model` in the dict); its
  kv, engine, sampling and mesh settings apply.
  """
  if not prompts and not lengths:
    raise ValueError("give text prompts or random prompt lengths")
  if chat and not prompts:
    raise ValueError("the chat template applies to text prompts: give prompts")
  tok = None
  if prompts:  # Before the weights: fails fast.
    tok = gguf_loader.tokenizer(gguf) if gguf is not None else tokenizer_lib.Tokenizer.from_dir(checkpoint_dir)
  config, _, _, engine = build_from_checkpoint(
      config_lib.from_config_dict(config_dict), checkpoint_dir, dtype, gguf=gguf
  )
  if tok is not None:
    ids = [tok.encode_chat([{"role": "user", "content": p}]) if chat else tok.encode(p) for p in prompts]
  else:
    ids = random_prompts(config.model.vocab_size, lengths, seed)
  res, kv_bytes = _generate(engine, ids, max_new_tokens, seed)
  out = _result(res, kv_bytes, config_dict, [len(p) for p in ids], max_new_tokens, seed)
  out.update(checkpoint_dir=checkpoint_dir, gguf=gguf, model=dataclasses.asdict(config.model))
  if tok is not None:
    out.update(prompts=list(prompts), chat=chat, prompt_tokens=ids, text=[tok.decode(t) for t in res.tokens])
  return out
