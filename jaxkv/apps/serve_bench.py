"""Server benchmark: `python3 -m jaxkv.serve_bench`, request throughput and time to first token under load.

Starts `python3 -m jaxkv.serve` with --server_flags on a free localhost port (or drives the OpenAI-compatible server
already at --url: llama-server, vLLM, another jaxkv), waits for /health, then sends two rounds of --requests
conversations, at most --concurrency in flight, and SIGTERMs the server it started. A conversation is
--turns streamed requests (greedy, --max_tokens new tokens each, past any end of sequence: "ignore_eos") one after
the other: the first prompt is --prompt_len
random token ids, each next one the previous prompt, its answer and --turn_len new random ids (a chat's next turn).
The first round compiles the shapes that the second, measured, one meets (the cache grows by kv.block rows at a
time, a new shape each time). Reports requests/s, generated tokens/s, time to first token (TTFT: from sending to the
first token's event; per turn too) and end-to-end latency percentiles, time per output token after the first, and
the server's transport and prefix cache counters from /metrics; prints a table last and writes JSON to --json_out.

  python3 -m jaxkv.serve_bench --server_flags="--cpu_devices=0 --config=experiments/llama3_8b.py \\
      --kv_placement=host --kv_pipeline_depth=2 --parallel=8" --requests=64 --concurrency=16 --prompt_len=2048 \\
      --max_tokens=128 --json_out=serve_bench.json

Multi-turn chat against the prefix cache: add --prefix_cache_gib=8 to --server_flags, and --turns=2 --turn_len=64.
The same load against llama-server (its /v1/models gives the vocabulary; give --vocab_size to a server that does not):

  python3 -m jaxkv.serve_bench --url=http://127.0.0.1:8081 --requests=32 --concurrency=16 --prompt_len=2048 \\
      --max_tokens=64
"""

from __future__ import annotations

import logging
import shlex

from absl import app
from absl import flags

from jaxkv import preflight
from jaxkv.apps import launch
from jaxkv.bench import serve_load

SERVER_FLAGS = flags.DEFINE_string(
    "server_flags", "", "Flags for python3 -m jaxkv.serve (config, placement, depth, --parallel, --cpu_devices...)."
)
REQUESTS = flags.DEFINE_integer("requests", 64, "Measured requests.", lower_bound=1)
CONCURRENCY = flags.DEFINE_integer("concurrency", 16, "Requests in flight at most (the clients).", lower_bound=1)
# The defaults fit the default server (the tiny model's 128 rows): 64 + 32 - 1 rows a request.
PROMPT_LEN = flags.DEFINE_integer("prompt_len", 64, "Prompt tokens per request (random ids).", lower_bound=1)
MAX_TOKENS = flags.DEFINE_integer("max_tokens", 32, "New tokens per request.", lower_bound=1)
TURNS = flags.DEFINE_integer(
    "turns", 1, "Requests per conversation, each the previous prompt + answer + new ids.", lower_bound=1
)
TURN_LEN = flags.DEFINE_integer("turn_len", 64, "New random ids of each turn after the first.", lower_bound=1)
SEED = flags.DEFINE_integer("seed", 0, "Seeds the prompt ids.", lower_bound=0)
URL = flags.DEFINE_string("url", None, "Drive the OpenAI-compatible server at this URL instead of starting one.")
VOCAB_SIZE = flags.DEFINE_integer(
    "vocab_size", None, "Random prompt ids stay below this (default: the server's /v1/models).", lower_bound=1
)
IGNORE_EOS = flags.DEFINE_boolean("ignore_eos", True, "Every request runs to --max_tokens (random weights end early).")
STARTUP_S = flags.DEFINE_float(
    "startup_timeout_s", 900.0, "Bound on the server's start (weights, first compile).", lower_bound=1.0
)
JSON_OUT = flags.DEFINE_string("json_out", None, "Write the results here.")

HELP_GROUPS = {
    "server": [SERVER_FLAGS, URL, STARTUP_S],
    "load": [REQUESTS, CONCURRENCY, PROMPT_LEN, MAX_TOKENS, TURNS, TURN_LEN, SEED, VOCAB_SIZE, IGNORE_EOS],
    "output": [JSON_OUT],
}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  launch.check_outputs(JSON_OUT)
  try:
    server_flags = shlex.split(SERVER_FLAGS.value)
  except ValueError as e:
    raise app.UsageError(f"--server_flags={SERVER_FLAGS.value!r} does not split into flags: {e}") from e
  if URL.value and server_flags:
    raise app.UsageError("--server_flags starts a server and --url drives a running one: give one of them")
  logging.getLogger("httpx").setLevel(logging.WARNING)  # A line per request otherwise.
  load = (REQUESTS.value, CONCURRENCY.value, PROMPT_LEN.value, MAX_TOKENS.value, SEED.value, TURNS.value)
  load += (TURN_LEN.value, VOCAB_SIZE.value, IGNORE_EOS.value)
  try:
    if URL.value:
      out = serve_load.run(URL.value.rstrip("/"), *load)
    else:
      with serve_load.jaxkv_server(server_flags, REQUESTS.value, STARTUP_S.value) as url:
        out = serve_load.run(url, *load)
  except serve_load.LoadError as e:
    raise preflight.InputError(str(e), e.hint, e.status) from e
  out["server_flags"] = server_flags
  launch.write_json(out, JSON_OUT.value)
  t, lat = out["ttft_s"], out["latency_s"]
  print(f"server: {URL.value or 'python3 -m jaxkv.serve ' + ' '.join(server_flags)}")
  print(
      f"{'requests':>8} {'conc':>5} {'prompt':>6} {'new':>4} {'req/s':>7} {'tok/s':>8} "
      f"{'TTFT p50':>9} {'p90':>7} {'p99':>7} {'lat p50':>8} {'p99':>7}"
  )
  print(
      f"{out['requests']:>8} {out['concurrency']:>5} {out['prompt_len']:>6} {out['max_tokens']:>4} "
      f"{out['requests_per_s']:>7.2f} {out['generated_tokens_per_s']:>8.1f} {t['p50']:>8.3f}s {t['p90']:>6.3f}s "
      f"{t['p99']:>6.3f}s {lat['p50']:>7.3f}s {lat['p99']:>6.3f}s"
  )
  if out["turns"] > 1:
    by_turn = ", ".join(f"turn {n} {p['p50']:.3f}s" for n, p in out["ttft_s_by_turn"].items())
    print(f"TTFT p50 by turn: {by_turn}; prefix cache hits {out['prefix_cache_hits']:.0f}")


def run() -> None:
  """The app: `python3 -m jaxkv.serve_bench`."""
  launch.run(main, HELP_GROUPS, __doc__)


if __name__ == "__main__":
  run()
