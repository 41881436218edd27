"""Check (GPU): window buckets (kv.window_buckets, jaxkv.cache.window_rows) give the bits of exact windows with the
decode attention that runs there (the Pallas leaves kernel on a CUDA GPU), in generate and in the server.

Random weights of --config (e.g. Llama-3-8B geometry with a few layers); for each placement (device, host depth 2),
generate and a server of 4 slots run with exact windows (kv.window_buckets=0) and with buckets of 1 and 4 sizes per
doubling; each bucketed run passes when its tokens and logits hashes equal the exact run's. The prompts and the
tokens generated cross several blocks and buckets (--kv_block small against the prompts). Prints a pass/fail table
last and writes JSON to --json_out (default $OUT/check_buckets.json when $OUT is set); exits 1 when a run fails. On
the H200:

  python3 tools/check_buckets.py --cpu_devices=0 --config=experiments/llama3_8b.py --config.model.num_layers=2 \\
      --kv_block=64 --capacity=2048
"""

from __future__ import annotations

import dataclasses
import os
import sys

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxkv.apps import cli  # pylint: disable=g-import-not-at-top,wrong-import-position

# --seed, --json_out:
from jaxkv.apps import generate  # pylint: disable=g-import-not-at-top,wrong-import-position
from jaxkv.apps import launch  # pylint: disable=g-import-not-at-top,wrong-import-position

NEW_TOKENS = flags.DEFINE_integer("new_tokens", 200, "Tokens generated per prompt (greedy).")
BUCKETS = (1, 4)  # kv.window_buckets compared with exact windows (0).


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  config = cli.resolved_config()
  cli.setup_platform(config.model)
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from jaxkv import engine as engine_lib  # pylint: disable=g-import-not-at-top
  from jaxkv import run as run_lib  # pylint: disable=g-import-not-at-top
  from jaxkv import serving  # pylint: disable=g-import-not-at-top

  mesh, params, base = run_lib.build(config, generate.SEED.value)
  block, cap, new = config.kv.block, config.engine.capacity, NEW_TOKENS.value
  lengths = [1, block - 1, 3 * block + 5, 5 * block + 1, 9 * block + 3]
  lengths = [n for n in lengths if n + new - 1 <= cap]
  rng = np.random.default_rng(generate.SEED.value)
  prompts = [rng.integers(0, config.model.vocab_size, n).tolist() for n in lengths]
  requests = [serving.Request(tuple(p), new) for p in prompts + prompts[::-1]]

  def engine(buckets: int, placement: str):
    kv = dataclasses.replace(config.kv, window_buckets=buckets, placement=placement, pipeline_depth=2)
    return engine_lib.Engine(dataclasses.replace(config, kv=kv), mesh, params, base.layout)

  rows, hashes = [], {}
  for placement in ("device", "host"):
    for buckets in (0, *BUCKETS):
      eng = engine(buckets, placement)
      res = eng.generate(prompts, new)
      served = serving.Server(eng, 4).serve(requests)
      hashes[(placement, buckets)] = dict(
          generate=[res.tokens_sha256, res.logits_sha256],
          serve=served.transcript_sha256,
          decode_attention=eng.stage_fns[0].decode_attention,
          compiled_shapes=res.transport["compiled_shapes"],
      )
      if buckets:
        exact = hashes[(placement, 0)]
        for what in ("generate", "serve"):
          same = hashes[(placement, buckets)][what] == exact[what]
          rows.append(dict(run=f"{what} {placement} buckets={buckets}", same=same))
  result = dict(
      rows=rows,
      runs={f"{p} buckets={b}": h for (p, b), h in hashes.items()},
      prompt_lengths=lengths,
      new_tokens=new,
      block=block,
      capacity=cap,
      config=cli.resolved_config_dict().to_dict(),
      devices=[str(d) for d in jax.devices()],
      jax=jax.__version__,
  )
  path = generate.JSON_OUT.value or (
      os.path.join(os.environ["OUT"], "check_buckets.json") if os.environ.get("OUT") else None
  )
  launch.write_json(result, path)
  print(f"\ndecode attention {hashes[('device', 0)]['decode_attention']}, prompts {lengths}, {new} new tokens")
  print(f"{'run':34} {'hashes vs exact windows':24} result")
  for r in rows:
    print(f"{r['run']:34} {'same' if r['same'] else 'DIFFERENT':24} {'pass' if r['same'] else 'FAIL'}")
  if not all(r["same"] for r in rows):
    raise SystemExit(1)


if __name__ == "__main__":
  cli.run(
      main,
      {
          "model and config": [*cli.CONFIG_GROUP, generate.SEED],
          "KV cache": cli.KV_GROUP,
          "check": [NEW_TOKENS, generate.JSON_OUT],
      },
      __doc__,
  )
