"""The runs behind the apps: a checked job (jaxkv.preflight), its engine (jaxkv.run), a generate or a serve of random
or text prompts, and the result as a JSON-ready dict with the compile counts."""

from __future__ import annotations

import dataclasses
import resource
import time
from collections.abc import Sequence

import jax
import numpy as np
import tqdm

from jaxkv import compile_cache
from jaxkv import distributed
from jaxkv import engine as engine_lib
from jaxkv import preflight
from jaxkv import run
from jaxkv import serving


def _generate(engine: engine_lib.Engine, prompts, max_new_tokens: int, seed: int):
  """engine.generate; the bytes of KV windows that this process holds in the cache's memory at the end (0 when no
  decode step ran); and when its decode started (time.perf_counter())."""
  last = {}

  def on_step(_, cache):
    last.update(cache=cache)
    bar.update()

  chunks = sum(-(-len(p) // engine.config.engine.prefill_chunk) for p in prompts)  # Each prompt's, alone.
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


def peak_memory(engine: engine_lib.Engine) -> dict:
  """The JSON's `memory`: the peak bytes in use of this process's fullest device (None without memory stats: CPU)
  and this process's peak resident set (ru_maxrss)."""
  return dict(
      device_peak_bytes=distributed.device_stat(engine.mesh),
      host_peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
  )


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
  prompts = run.random_prompts(job.config.model.vocab_size, lengths, seed)
  preflight.check_prompts(job, prompts, max_new_tokens)
  with compile_cache.CompileCounter() as counter:
    _, engine = run.random_engine(job, seed)
    res, kv_bytes, decode_start = _generate(engine, prompts, max_new_tokens, seed)
  return dict(
      _result(res, kv_bytes, config_dict, lengths, max_new_tokens, seed),
      compilation=compilation(counter, decode_start),
      memory=peak_memory(engine),
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
  preflight.check_host_memory(job, parallel)
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, max_length + 1, size=sequences).tolist()
  news = rng.integers(max(1, max_new_tokens // 2), max_new_tokens + 1, size=sequences).tolist()
  prompts = run.random_prompts(job.config.model.vocab_size, lengths, seed)
  requests = [serving.Request(tuple(p), n, seed=seed + i) for i, (p, n) in enumerate(zip(prompts, news))]
  with compile_cache.CompileCounter() as counter:
    engine = run.random_engine(job, seed)[1]
    server = serving.Server(engine, parallel, prefix_cache_bytes)
    with _progress("serve decode steps") as bar:
      res = server.serve(requests, on_step=lambda *_: bar.update())
  return dict(
      compilation=compilation(counter),
      memory=peak_memory(engine),
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
    eos: bool = True,
) -> dict:
  """Generates with a checkpoint folder's (or the GGUF file `gguf`'s) model and weights; returns a JSON-ready dict.

  With `prompts` (text, one per sequence) the checkpoint's tokenizer encodes them (as user turns in its chat
  template with `chat`) and decodes the output: the dict gains `prompts`, `prompt_tokens` and `text` (the decoded
  new tokens per sequence). Without, the prompts are random token ids of the given `lengths`, as in
  `generate_random`. The model section of `config_dict` is replaced by the checkpoint's (`model` in the dict); its
  kv, engine, sampling and mesh settings apply, and with `eos` the checkpoint's end-of-sequence ids end a sequence
  (jaxkv.preflight.resolve). The checks (jaxkv.preflight) run against the checkpoint's model, and the prompts are
  encoded, before any weight is read.
  """
  if not prompts and not lengths:
    raise ValueError("give text prompts or random prompt lengths")
  if chat and not prompts:
    raise ValueError("the chat template applies to text prompts: give prompts")
  job = preflight.resolve(config_dict, checkpoint_dir, dtype, gguf, eos=eos)
  tok = None
  if prompts:
    with preflight.input_errors(preflight.FAILURE):
      tok = run.tokenizer(checkpoint_dir, gguf)
    ids = [tok.encode_chat([{"role": "user", "content": p}]) if chat else tok.encode(p) for p in prompts]
  else:
    ids = run.random_prompts(job.config.model.vocab_size, lengths, seed)
  preflight.check_prompts(job, ids, max_new_tokens)
  with compile_cache.CompileCounter() as counter:
    engine = run.checkpoint_engine(job, checkpoint_dir, dtype, gguf)
    res, kv_bytes, decode_start = _generate(engine, ids, max_new_tokens, seed)
  out = _result(res, kv_bytes, config_dict, [len(p) for p in ids], max_new_tokens, seed)
  out.update(
      checkpoint_dir=checkpoint_dir,
      gguf=gguf,
      model=dataclasses.asdict(job.config.model),
      eos_ids=sorted(job.config.sampling.stop_ids),
      compilation=compilation(counter, decode_start),
      memory=peak_memory(engine),
  )
  if tok is not None:
    out.update(prompts=list(prompts), chat=chat, prompt_tokens=ids, text=[tok.decode(t) for t in res.tokens])
  return out
