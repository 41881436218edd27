"""Library entry points behind the apps: build the mesh, the weights and the engine from a config."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import numpy as np
import tqdm

from jaxkv import checkpoint
from jaxkv import compile_cache
from jaxkv import config as config_lib
from jaxkv import distributed
from jaxkv import engine as engine_lib
from jaxkv import gguf_loader
from jaxkv import model
from jaxkv import preflight
from jaxkv import serving
from jaxkv import tokenizer as tokenizer_lib


def build(config: config_lib.Config, seed: int):
  """Returns (mesh, params, engine) for a config, with seeded random weights, after jaxkv.preflight's checks."""
  job = preflight.resolve(config)
  return (job.mesh, *_random_engine(job, seed))


make_layout = preflight.layout  # The layout of config.split over a mesh.


def build_from_checkpoint(
    config: config_lib.Config, checkpoint_dir: str | None, dtype: str | None = None, *, gguf: str | None = None
):
  """Returns (config, mesh, params, engine) with the model and weights of a Hugging Face checkpoint folder, or of
  the GGUF file `gguf` (then checkpoint_dir is None).

  The returned config is `config` with its model replaced by the checkpoint's (jaxkv.checkpoint.load,
  jaxkv.gguf_loader.load); the kv, engine, sampling, mesh and split settings are kept. The checks of jaxkv.preflight
  run first.
  """
  job = preflight.resolve(config, checkpoint_dir, dtype, gguf)
  engine = _checkpoint_engine(job, checkpoint_dir, dtype, gguf)
  return job.config, job.mesh, engine.params, engine


def _random_engine(job: preflight.Job, seed: int):
  """(params, engine) of a checked job with seeded random weights."""
  params = model.init_params(job.config.model, jax.random.key(seed), job.mesh, job.layout)
  return params, engine_lib.Engine(job.config, job.mesh, params, job.layout)


def _checkpoint_engine(
    job: preflight.Job, checkpoint_dir: str | None, dtype: str | None, gguf: str | None = None
) -> engine_lib.Engine:
  """The engine of a checked job (preflight.resolve with the same folder or file and dtype) with its weights."""
  if gguf is not None:
    model_config, params = gguf_loader.load(gguf, job.mesh, dtype, job.layout)
  else:
    model_config, params = checkpoint.load(checkpoint_dir, job.mesh, dtype, job.layout)
  assert model_config == job.config.model, (model_config, job.config.model)
  return engine_lib.Engine(job.config, job.mesh, params, job.layout)


def random_prompts(vocab_size: int, lengths, seed: int) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(0, vocab_size, size=n).tolist() for n in lengths]


def _generate(engine: engine_lib.Engine, prompts, max_new_tokens: int, seed: int):
  """engine.generate; the bytes of KV windows that this process holds in the cache's memory at the end (0 when no
  decode step ran); and when its decode started (time.perf_counter())."""
  last = {}

  def on_step(_, cache):
    last.update(cache=cache)
    bar.update()

  chunks = -(-max(len(p) for p in prompts) // engine.config.engine.prefill_chunk)
  with _progress("prefill chunks and decode steps", chunks + max_new_tokens - 1) as bar:
    res = engine.generate(prompts, max_new_tokens, seed=seed, on_step=on_step, on_chunk=lambda _: bar.update())
  decode_start = time.perf_counter() - res.timing["decode_s"]
  return res, distributed.process_bytes(last["cache"].windows) if last else 0, decode_start


def compilation(counter: compile_cache.CompileCounter, decode_start: float | None = None) -> dict:
  """The JSON's `compilation`: programs compiled and loaded from the persistent cache (`cache_dir`, None = off),
  and with `decode_start`, those of the timed decode (`during_decode`)."""
  out = dict(counter.counts(), cache_dir=jax.config.jax_compilation_cache_dir)
  if decode_start is not None:
    out["during_decode"] = counter.counts(since=decode_start)
  return out


def _progress(what: str, total: int | None = None) -> tqdm.tqdm:
  """A progress bar on stderr in process 0, shown once a run has taken 5 s."""
  return tqdm.tqdm(total=total, desc=what, unit="step", delay=5, leave=False, disable=not distributed.is_main())


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
  """Generates from random prompts of the given lengths; returns a JSON-ready dict. Checks the input
  (jaxkv.preflight) before it builds the weights."""
  job = preflight.resolve(config_dict)
  prompts = random_prompts(job.config.model.vocab_size, lengths, seed)
  preflight.check_prompts(job, prompts, max_new_tokens)
  with compile_cache.CompileCounter() as counter:
    _, engine = _random_engine(job, seed)
    res, kv_bytes, decode_start = _generate(engine, prompts, max_new_tokens, seed)
  return dict(
      _result(res, kv_bytes, config_dict, lengths, max_new_tokens, seed),
      compilation=compilation(counter, decode_start),
  )


def serve_random(
    config_dict,
    sequences: int,
    parallel: int,
    max_length: int,
    max_new_tokens: int,
    seed: int,
    prefix_cache_bytes: int = 0,
) -> dict:
  """Serves `sequences` random requests on `parallel` slots (jaxkv.serving; with a prefix cache of
  `prefix_cache_bytes`); prompt lengths are drawn from [1, max_length] and max_new_tokens from
  [max(1, max_new_tokens // 2), max_new_tokens]. A request that cannot fit is rejected on its own (its `error` says
  why). Returns a JSON-ready dict."""
  job = preflight.resolve(config_dict)
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, max_length + 1, size=sequences).tolist()
  news = rng.integers(max(1, max_new_tokens // 2), max_new_tokens + 1, size=sequences).tolist()
  prompts = random_prompts(job.config.model.vocab_size, lengths, seed)
  requests = [serving.Request(tuple(p), n, seed=seed + i) for i, (p, n) in enumerate(zip(prompts, news))]
  with compile_cache.CompileCounter() as counter:
    server = serving.Server(_random_engine(job, seed)[1], parallel, prefix_cache_bytes)
    with _progress("serve decode steps") as bar:
      res = server.serve(requests, on_step=lambda *_: bar.update())
  return dict(
      compilation=compilation(counter),
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
  kv, engine, sampling and mesh settings apply. The checks (jaxkv.preflight) run against the checkpoint's model,
  and the prompts are encoded, before any weight is read.
  """
  if not prompts and not lengths:
    raise ValueError("give text prompts or random prompt lengths")
  if chat and not prompts:
    raise ValueError("the chat template applies to text prompts: give prompts")
  job = preflight.resolve(config_dict, checkpoint_dir, dtype, gguf)
  tok = None
  if prompts:
    with preflight.input_errors(preflight.FAILURE):
      tok = gguf_loader.tokenizer(gguf) if gguf is not None else tokenizer_lib.Tokenizer.from_dir(checkpoint_dir)
    ids = [tok.encode_chat([{"role": "user", "content": p}]) if chat else tok.encode(p) for p in prompts]
  else:
    ids = random_prompts(job.config.model.vocab_size, lengths, seed)
  preflight.check_prompts(job, ids, max_new_tokens)
  with compile_cache.CompileCounter() as counter:
    engine = _checkpoint_engine(job, checkpoint_dir, dtype, gguf)
    res, kv_bytes, decode_start = _generate(engine, ids, max_new_tokens, seed)
  out = _result(res, kv_bytes, config_dict, [len(p) for p in ids], max_new_tokens, seed)
  out.update(
      checkpoint_dir=checkpoint_dir,
      gguf=gguf,
      model=dataclasses.asdict(job.config.model),
      compilation=compilation(counter, decode_start),
  )
  if tok is not None:
    out.update(prompts=list(prompts), chat=chat, prompt_tokens=ids, text=[tok.decode(t) for t in res.tokens])
  return out
