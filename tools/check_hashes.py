"""Check (GPU): the tokens and logits hashes of a fixed set of runs, written to JSON and compared with another
checkout's, e.g. before and after a change that must keep them.

Runs, on one process's devices (the GPU's by default; --cpu for 4 simulated CPU devices): generate greedy in the
device, host depth 0 (one layer a call), host depth 2 and auto (a budget of half the layers) placements, generate
seeded, host attention (f = 0.5), and the server (8 requests on 4 slots: greedy in the device and host placements,
seeded, with the prefix cache cold and hit). Llama-3-8B geometry with --layers layers and random weights on the GPU,
the tiny config on the CPU. It uses only the library's public entry points (jaxkv.run.build, Engine.generate,
jaxkv.serving.Server), so the same script runs against another checkout: PYTHONPATH names the checkout whose jaxkv
and experiments run. From this checkout's root, with the other one at ../main:

  PYTHONPATH=../main python3 tools/check_hashes.py --json_out=old.json
  PYTHONPATH=. python3 tools/check_hashes.py --compare=old.json --json_out=new.json   # pass/fail table last

With --compare, each run passes when both hashes equal the other file's; --expect_changed names runs that are
meant to differ (by default generate_seeded: the per-row key derivation), which pass when their tokens differ.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--json_out", required=True, help="Write this run's hashes here.")
  p.add_argument("--compare", help="Another run's JSON to compare with.")
  p.add_argument("--expect_changed", default="generate_seeded", help="Comma-separated runs meant to differ.")
  p.add_argument("--cpu", action="store_true", help="4 simulated CPU devices and the tiny config.")
  p.add_argument("--layers", type=int, default=2, help="Layers of the 8B geometry on the GPU.")
  return p.parse_args(argv)


def runs(cpu: bool, layers: int) -> dict:
  import numpy as np  # pylint: disable=g-import-not-at-top  (after the platform is set)

  from experiments import llama3_8b, tiny  # pylint: disable=g-import-not-at-top
  from jaxkv import config as config_lib  # pylint: disable=g-import-not-at-top
  from jaxkv import engine as engine_lib  # pylint: disable=g-import-not-at-top
  from jaxkv import run as run_lib  # pylint: disable=g-import-not-at-top
  from jaxkv import serving  # pylint: disable=g-import-not-at-top

  cd = (tiny if cpu else llama3_8b).get_config().unlock()
  if not cpu:
    cd.model.num_layers = layers
  cd.engine.capacity, cd.engine.prefill_chunk, cd.kv.block = (128, 16, 8) if cpu else (2048, 512, 256)
  config = config_lib.from_config_dict(cd)
  mesh, params, base = run_lib.build(config, 0)
  block, chunk, cap = config.kv.block, config.engine.prefill_chunk, config.engine.capacity

  def engine(sampling=None, **kv):
    c = dataclasses.replace(config, kv=dataclasses.replace(config.kv, **kv), sampling=sampling or config.sampling)
    return engine_lib.Engine(c, mesh, params, base.layout)

  rng = np.random.default_rng(0)
  lengths = [1, block - 1, block + 1, chunk + 3]
  prompts = [rng.integers(0, config.model.vocab_size, n).tolist() for n in lengths]
  new = block + 4  # Crosses a block boundary.
  seeded = config_lib.SamplingConfig(temperature=0.8, top_k=50, top_p=0.95)
  layer_gib = 2 * len(prompts) * config.model.num_kv_heads * cap * config.model.head_dim * 2 / 2**30
  out = {}
  for name, eng in {
      "generate_device": engine(),
      "generate_host_d0_g1": engine(placement="host", pipeline_depth=0, group_layers=1),
      "generate_host_d2": engine(placement="host", pipeline_depth=2),
      "generate_auto": engine(placement="auto", group_layers=1, device_budget_gib=layer_gib * layers / 2),
      "generate_seeded": engine(seeded),
      "generate_host_attention": engine(placement="host", host_attention=True, host_attention_fraction=0.5),
  }.items():
    res = eng.generate(prompts, new, seed=3)
    out[name] = [res.tokens_sha256, res.logits_sha256]
    print(name, out[name][0][:16], out[name][1][:16], flush=True)
  lens = rng.integers(1, cap // 4, 8).tolist()
  news = rng.integers(2, cap // 4, 8).tolist()
  requests = [
      serving.Request(tuple(rng.integers(0, config.model.vocab_size, n).tolist()), m, seed=i)
      for i, (n, m) in enumerate(zip(lens, news))
  ]
  prefix = serving.Server(engine(placement="host"), 4, prefix_cache_bytes=2**30)
  for name, serve in {
      "serve_device": lambda: serving.Server(engine(), 4).serve(requests),
      "serve_host": lambda: serving.Server(engine(placement="host", pipeline_depth=1), 4).serve(requests),
      "serve_seeded": lambda: serving.Server(engine(seeded, placement="host"), 4).serve(requests),
      "serve_prefix_cold": lambda: serving.Server(engine(placement="host"), 4, prefix_cache_bytes=1).serve(requests),
      "serve_prefix_fill": lambda: prefix.serve(requests),
      "serve_prefix_hit": lambda: prefix.serve(requests),
  }.items():
    res = serve()
    out[name] = [res.transcript_sha256, json.dumps([r.tokens for r in res.results])]
    print(name, out[name][0][:16], flush=True)
  return out


def compare(mine: dict, other: dict, changed: set[str]) -> bool:
  rows, ok = [], True
  for name in sorted(mine):
    if name not in other:
      rows.append((name, "missing in --compare", "FAIL"))
      ok = False
      continue
    same = mine[name] == other[name]
    if name in changed:
      passed = mine[name][0] != other[name][0]
      what = "changed, as meant" if passed else "unchanged, meant to change"
    else:
      passed, what = same, "same" if same else "DIFFERENT"
    ok &= passed
    rows.append((name, what, "pass" if passed else "FAIL"))
  print(f"{'run':<28} {'hashes':<28} result")
  for name, what, result in rows:
    print(f"{name:<28} {what:<28} {result}")
  return ok


def main(argv) -> int:
  args = _args(argv)
  if args.cpu:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
  mine = runs(args.cpu, args.layers)
  import jax  # pylint: disable=g-import-not-at-top

  with open(args.json_out, "w") as f:
    json.dump(dict(runs=mine, devices=[str(d) for d in jax.devices()], jax=jax.__version__), f, indent=1)
  if args.compare is None:
    return 0
  with open(args.compare) as f:
    other = json.load(f)["runs"]
  return 0 if compare(mine, other, set(filter(None, args.expect_changed.split(",")))) else 1


if __name__ == "__main__":
  raise SystemExit(main(sys.argv[1:]))
