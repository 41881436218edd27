"""Measure (GPU): time to first token of a prompt that shares a long prefix with an earlier one, against a cold
prefill (jaxkv.serving.prefix_cache).

Random weights of --config; each round draws a fresh random prefix of --prefix_len tokens and serves, one request at
a time on one slot (jaxkv.serving, greedy, 1 new token), and times each request's first token on the host (its
`ttft_s`; the serve's wall time, which also waits for the slot's rows to reach host memory, is in the JSON too):
  off   prefix + tail A on a server without the prefix cache (the plain cold prefill);
  cold  prefix + tail A with the cache on, a miss (the prefill also copies its blocks to host memory);
  warm  prefix + tail B with the cache on: the prefix's blocks come from host memory, only the tail is prefilled.
Round 0 compiles every shape and is not counted. Prints a table (median seconds per arm, warm / off and warm / cold)
last and writes JSON to --json_out (default $OUT/prefix_cache.json when $OUT is set); --seed seeds the weights and
prompts. On the H200, 8B geometry:

  python3 tools/measure_prefix_cache.py --cpu_devices=0 --config=experiments/llama3_8b.py --kv_placement=host \\
      --kv_pipeline_depth=2 --prefix_cache_gib=8 --prefix_len=32768 --tail_len=64 --rounds=4
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxkv.apps import cli  # pylint: disable=g-import-not-at-top,wrong-import-position
from jaxkv.apps import launch  # pylint: disable=g-import-not-at-top,wrong-import-position
from jaxkv.apps import generate  # pylint: disable=g-import-not-at-top,wrong-import-position  (--prefix_cache_gib, --seed, --json_out)

PREFIX_LEN = flags.DEFINE_integer("prefix_len", 32768, "Tokens of the shared prefix.")
TAIL_LEN = flags.DEFINE_integer("tail_len", 64, "Tokens after the prefix (different in the cold and warm prompt).")
ROUNDS = flags.DEFINE_integer("rounds", 4, "Rounds, each with a fresh prefix; round 0 compiles and is not counted.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if generate.prefix_cache_bytes() <= 0:
    raise app.UsageError("give --prefix_cache_gib (host memory for the prefix cache, e.g. 8)")
  if ROUNDS.value < 2 or PREFIX_LEN.value < 1 or TAIL_LEN.value < 1:
    raise app.UsageError("--rounds must be >= 2, --prefix_len and --tail_len >= 1")
  config = cli.resolved_config()
  cli.setup_platform(config.model)
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from jaxkv import run  # pylint: disable=g-import-not-at-top
  from jaxkv import serving  # pylint: disable=g-import-not-at-top

  _, _, engine = run.build(config, generate.SEED.value)
  off = serving.Server(engine, 1)
  on = serving.Server(engine, 1, generate.prefix_cache_bytes())
  rng = np.random.default_rng(generate.SEED.value)
  draw = lambda n: tuple(rng.integers(0, config.model.vocab_size, n).tolist())
  times: dict[str, list[float]] = {"off": [], "cold": [], "warm": []}
  walls: dict[str, list[float]] = {k: [] for k in times}
  tokens_equal = True
  for rnd in range(ROUNDS.value):
    prefix = draw(PREFIX_LEN.value)
    a, b = prefix + draw(TAIL_LEN.value), prefix + draw(TAIL_LEN.value)
    out = {}
    for arm, server, prompt in (("off", off, a), ("cold", on, a), ("warm", on, b)):
      t0 = time.perf_counter()
      out[arm] = server.serve([serving.Request(prompt, 1)])
      if out[arm].results[0].error:
        raise RuntimeError(f"the {arm} request was rejected: {out[arm].results[0].error}")
      if rnd:
        walls[arm].append(time.perf_counter() - t0)
        times[arm].append(out[arm].results[0].ttft_s)
    tokens_equal &= out["off"].results[0].tokens == out["cold"].results[0].tokens
    print(f"round {rnd}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in times.items() if rnd), flush=True)
  stats = on.prefix_cache.summary()
  med = {k: statistics.median(v) for k, v in times.items()}
  result = dict(
      seconds=times,
      median_s=med,
      serve_wall_s=walls,
      warm_over_off=med["warm"] / med["off"],
      warm_over_cold=med["warm"] / med["cold"],
      prefix_cache=stats,
      cold_tokens_equal_off=tokens_equal,
      prefix_len=PREFIX_LEN.value,
      tail_len=TAIL_LEN.value,
      config=cli.resolved_config_dict().to_dict(),
      devices=[str(d) for d in jax.devices()],
      jax=jax.__version__,
  )
  path = generate.JSON_OUT.value or (
      os.path.join(os.environ["OUT"], "prefix_cache.json") if os.environ.get("OUT") else None
  )
  launch.write_json(result, path)
  print(f"\nprefix {PREFIX_LEN.value} + tail {TAIL_LEN.value} tokens, {ROUNDS.value - 1} rounds, {stats}")
  print(f"{'arm':6} {'ttft_s (median)':>16} {'serve wall_s':>13}")
  for k, v in med.items():
    print(f"{k:6} {v:16.3f} {statistics.median(walls[k]):13.3f}")
  print(f"warm / off {result['warm_over_off']:.3f}, warm / cold {result['warm_over_cold']:.3f} (target <= 0.10)")


if __name__ == "__main__":
  cli.run(main, {"model and config": cli.CONFIG_GROUP, "prefix": [PREFIX_LEN, TAIL_LEN, ROUNDS]}, __doc__)
