"""Check (GPU): `jaxkv.serve` against llama-server under the same load, one machine, one call.

Two loads, each driven by jaxkv.bench.serve_load (streamed greedy token-id prompts, "ignore_eos", a warm-up round first:
the same size for the short load, --long_warmup requests for the long one):

  short: --short_requests requests (32) of --short_prompt (2,048) tokens, --short_new (64) new, 16 in flight on 8
         slots: llama-server with its KV on the GPU (flash attention) against jaxkv.serve with the cache on the
         device and in host memory;
  long:  --long_requests requests (4) of --long_prompt (32,000) tokens, --long_new (16) new, 4 in flight on 4 slots,
         the cache in host memory: llama-server -nkvo against jaxkv.serve --kv_placement=host.

jaxkv.serve runs experiments/llama3_8b.py (random bf16 weights, default settings but the placement, slots and
capacity); llama-server runs --gguf, a GGUF of the same geometry (F16 random weights). Prints a table last (requests/s,
generated tok/s, TTFT p50 and the jaxkv / llama-server ratios); writes every load's JSON to --json_out and
llama-server's log beside it. From the repo root:

  python3 tools/check_serving.py --llama_server=PATH/llama-server --gguf=PATH/llama3-8b-f16.gguf
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxkv.bench import serve_load  # pylint: disable=g-import-not-at-top,wrong-import-position

LLAMA_SERVER = flags.DEFINE_string("llama_server", None, "llama.cpp's llama-server binary.", required=True)
GGUF = flags.DEFINE_string("gguf", None, "The 8B-geometry GGUF that llama-server loads.", required=True)
LOADS = flags.DEFINE_list("loads", ["short", "long"], "Which loads to run.")
SHORT_REQUESTS = flags.DEFINE_integer("short_requests", 32, "The short load's measured requests.")
SHORT_PROMPT = flags.DEFINE_integer("short_prompt", 2048, "The short load's prompt tokens.")
SHORT_NEW = flags.DEFINE_integer("short_new", 64, "The short load's new tokens.")
LONG_REQUESTS = flags.DEFINE_integer("long_requests", 4, "The long load's measured requests.")
LONG_PROMPT = flags.DEFINE_integer("long_prompt", 32000, "The long load's prompt tokens.")
LONG_NEW = flags.DEFINE_integer("long_new", 16, "The long load's new tokens.")
LONG_WARMUP = flags.DEFINE_integer(
    "long_warmup", 1, "The long load's warm-up requests (one compiles jaxkv's shapes; llama-server's -nkvo is slow)."
)
JAXKV_FLAGS = flags.DEFINE_string(
    "jaxkv_flags", "--cpu_devices=0 --config=experiments/llama3_8b.py", "jaxkv.serve's model and devices."
)
STARTUP_S = flags.DEFINE_float("startup_timeout_s", 600.0, "Bound on a server's start.")
JSON_OUT = flags.DEFINE_string("json_out", os.path.join(os.environ.get("OUT", "."), "check_serving.json"), "Results.")

# (load, in flight, slots): the loads of the module docstring.
SHAPES = {"short": (16, 8), "long": (4, 4)}


@contextlib.contextmanager
def llama_server(slots: int, rows: int, host_kv: bool):
  """llama-server on a free localhost port: every layer on the GPU, flash attention, `slots` slots of `rows` tokens;
  -nkvo keeps the KV in host memory."""
  port = serve_load.free_port()
  cmd = [LLAMA_SERVER.value, "-m", GGUF.value, "-ngl", "99", "-fa", "on", "-np", str(slots), "-c", str(slots * rows)]
  cmd += ["--host", "127.0.0.1", "--port", str(port)] + (["-nkvo"] if host_kv else [])
  log = open(os.path.join(os.path.dirname(os.path.abspath(JSON_OUT.value)), "llama-server.log"), "a", encoding="utf-8")
  proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)  # Its error, if any, is in the log.
  try:
    url = f"http://127.0.0.1:{port}"
    serve_load.wait_healthy(url, proc, STARTUP_S.value)
    yield url
  finally:
    proc.terminate()
    proc.wait(60)
    log.close()


def main(argv):
  del argv
  logging.getLogger("httpx").setLevel(logging.WARNING)
  rows = {"short": SHORT_PROMPT.value + SHORT_NEW.value, "long": LONG_PROMPT.value + LONG_NEW.value}
  size = {
      "short": (SHORT_REQUESTS.value, SHORT_PROMPT.value, SHORT_NEW.value),
      "long": (LONG_REQUESTS.value, LONG_PROMPT.value, LONG_NEW.value),
  }
  results = {}
  for load in LOADS.value:
    conc, slots = SHAPES[load]
    requests, prompt, new = size[load]
    capacity = -(-rows[load] // 1024) * 1024
    jaxkv = {f"jaxkv {p}": ["--kv_placement=" + p] for p in (["device", "host"] if load == "short" else ["host"])}
    servers = {
        name: serve_load.jaxkv_server(
            JAXKV_FLAGS.value.split() + flags_ + [f"--parallel={slots}", f"--capacity={capacity}"],
            requests,
            STARTUP_S.value,
        )
        for name, flags_ in jaxkv.items()
    }
    servers["llama-server -nkvo" if load == "long" else "llama-server"] = llama_server(slots, capacity, load == "long")
    for name, server in servers.items():
      with server as url:
        out = serve_load.run(
            url, requests, conc, prompt, new, seed=0, warmup=LONG_WARMUP.value if load == "long" else None
        )
      results[f"{load}: {name}"] = out
      with open(JSON_OUT.value, "w", encoding="utf-8") as f:  # After each server: a cut-short call keeps the rest.
        json.dump(results, f, indent=1)
      print(f"{load}: {name}: {out['requests_per_s']:.2f} req/s, {out['generated_tokens_per_s']:.1f} tok/s", flush=True)
  print(f"{'load: server':<28} {'req/s':>7} {'tok/s':>8} {'TTFT p50':>9} {'x peer tok/s':>12}")
  for key, r in results.items():
    load = key.split(":")[0]
    peer = next(v for k, v in results.items() if k.startswith(f"{load}: llama"))
    ratio = r["generated_tokens_per_s"] / peer["generated_tokens_per_s"]
    print(
        f"{key:<28} {r['requests_per_s']:>7.2f} {r['generated_tokens_per_s']:>8.1f} {r['ttft_s']['p50']:>8.3f}s "
        f"{ratio:>12.2f}"
    )


if __name__ == "__main__":
  app.run(main)
