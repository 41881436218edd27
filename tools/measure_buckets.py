"""Measure (CPU or GPU): how long a fresh server takes to answer requests of new lengths, and how many programs it
compiles (kv.window_buckets: decode windows in buckets of m * 2^s blocks, jaxkv.cache.window_rows).

Loads --gguf (or random weights of --config) into a server of one slot (jaxkv.serving.Server) with an empty
compilation cache (a fresh temporary folder unless --compilation_cache_dir is given), starts it as `python3 -m
jaxkv.serve` does (one request of one token, which compiles the head; with --warmup first every window bucket's
decode programs and every prefill shape's, jaxkv.warmup), then serves one request of each of --lengths random
prompt tokens with --new_tokens greedy tokens, one after another, timing each request and its first token (the
prefill's), and counting the programs compiled meanwhile and XLA's seconds compiling them
(jaxkv.compile_cache.CompileCounter; the rest of a request's time is its compute, tracing and dispatch). Prints a
table last and writes JSON to --json_out (default $OUT/buckets.json when $OUT is set). The issue's case (real SmolLM2, capacity 4096, 2 CPU
cores), with and without buckets:

  python3 tools/measure_buckets.py --gguf=SmolLM2-135M-Instruct.Q4_1.gguf --capacity=4096 --lengths=2000,1500
  python3 tools/measure_buckets.py --gguf=SmolLM2-135M-Instruct.Q4_1.gguf --capacity=4096 --lengths=2000,1500 \\
      --config.kv.window_buckets=0
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxkv.apps import cli  # pylint: disable=g-import-not-at-top,wrong-import-position

# --gguf, --seed, --json_out:
from jaxkv.apps import generate  # pylint: disable=g-import-not-at-top,wrong-import-position
from jaxkv.apps import launch  # pylint: disable=g-import-not-at-top,wrong-import-position

LENGTHS = flags.DEFINE_list("lengths", ["2000", "1500"], "Prompt tokens of each request, served one after another.")
NEW_TOKENS = flags.DEFINE_integer("new_tokens", 8, "Tokens generated per request (greedy).")
WARMUP = flags.DEFINE_bool("warmup", False, "Warm the server up for its capacity first (jaxkv.warmup).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  lengths = [int(n) for n in LENGTHS.value]
  if not lengths or min(lengths) < 1 or NEW_TOKENS.value < 1:
    raise app.UsageError("--lengths must be positive integers and --new_tokens >= 1")
  gguf = generate.GGUF.value
  if gguf and not os.path.isfile(gguf):
    raise app.UsageError(f"--gguf={gguf}: no such file")
  if not flags.FLAGS["compilation_cache_dir"].present:
    flags.FLAGS.compilation_cache_dir = tempfile.mkdtemp(prefix="jaxkv-buckets-cache-")
  cd = cli.resolved_config_dict(checkpoint=bool(gguf))
  cli.setup_platform(cli.model_of(cd, gguf=gguf, dtype=generate.checkpoint_dtype()))
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from jaxkv import compile_cache  # pylint: disable=g-import-not-at-top
  from jaxkv import preflight  # pylint: disable=g-import-not-at-top
  from jaxkv import run  # pylint: disable=g-import-not-at-top
  from jaxkv import serving  # pylint: disable=g-import-not-at-top
  from jaxkv import warmup  # pylint: disable=g-import-not-at-top

  t0 = time.perf_counter()
  if gguf:
    dtype = generate.checkpoint_dtype()
    job = preflight.resolve(cd, None, dtype, gguf, eos=False)
    engine = run.checkpoint_engine(job, None, dtype, gguf)
  else:
    engine = run.build(preflight.resolve(cd).config, generate.SEED.value)[2]
  config = engine.config
  for n in lengths:
    engine.validate([[0] * n], NEW_TOKENS.value)
  load_s = time.perf_counter() - t0
  server = serving.Server(engine, 1)
  rng = np.random.default_rng(generate.SEED.value)
  rows = []
  with compile_cache.CompileCounter() as counter:
    t0 = time.perf_counter()
    if WARMUP.value:
      warmup.warm_up(engine, 1, lambda line: print(line, flush=True))
    server.serve([serving.Request((0,), 2)])  # As jaxkv.serving.api.build_model starts a server.
    compiled = lambda t: dict(compile_s=counter.seconds(since=t), **counter.counts(since=t))
    rows.append(dict(what="start-up", seconds=time.perf_counter() - t0, **compiled(t0)))
    for n in lengths:
      prompt = tuple(rng.integers(0, config.model.vocab_size, n).tolist())
      t0 = time.perf_counter()
      out = server.serve([serving.Request(prompt, NEW_TOKENS.value)])
      seconds = time.perf_counter() - t0
      if out.results[0].error:
        raise RuntimeError(f"the request of {n} tokens was rejected: {out.results[0].error}")
      first = out.results[0].ttft_s
      rows.append(dict(what=f"request of {n} tokens", seconds=seconds, first_token_s=first, **compiled(t0)))
      print(f"{rows[-1]['what']}: {seconds:.1f} s", flush=True)
  result = dict(
      rows=rows,
      load_s=load_s,
      gguf=os.path.basename(gguf) if gguf else None,
      capacity=config.engine.capacity,
      block=config.kv.block,
      prefill_chunk=config.engine.prefill_chunk,
      window_buckets=config.kv.window_buckets,
      new_tokens=NEW_TOKENS.value,
      cpu_count=os.cpu_count(),
      devices=[str(d) for d in jax.devices()],
      jax=jax.__version__,
  )
  path = generate.JSON_OUT.value or (os.path.join(os.environ["OUT"], "buckets.json") if os.environ.get("OUT") else None)
  launch.write_json(result, path)
  print(
      f"\ncapacity {config.engine.capacity}, block {config.kv.block}, chunk {config.engine.prefill_chunk}, "
      f"window_buckets {config.kv.window_buckets}, load {load_s:.1f} s"
  )
  print(f"{'':28} {'seconds':>8} {'first token':>12} {'compiled':>9} {'from cache':>11} {'compile s':>10}")
  for r in rows:
    first = "-" if r.get("first_token_s") is None else f"{r['first_token_s']:.1f}"
    print(
        f"{r['what']:28} {r['seconds']:8.1f} {first:>12} {r['programs_compiled']:9d} {r['programs_from_cache']:11d} "
        f"{r['compile_s']:10.1f}"
    )


if __name__ == "__main__":
  cli.run(
      main,
      {
          "model and config": [*cli.CONFIG_GROUP, generate.GGUF, generate.SEED],
          "KV cache": cli.KV_GROUP,
          "measure": [LENGTHS, NEW_TOKENS, WARMUP, generate.JSON_OUT],
      },
      __doc__,
  )
