"""Server benchmark: `python3 -m jaxkv.serve_bench`, request throughput and time to first token under load.

Starts `python3 -m jaxkv.serve` with --server_flags on a free localhost port, waits for /health, then sends two
rounds of --requests streamed requests of --prompt_len random token ids and --max_tokens new tokens (greedy), at most
--concurrency in flight, and SIGTERMs the server. The first round compiles the shapes that the second, measured, one
meets (the cache grows by kv.block rows at a time, a new shape each time). Reports requests/s,
generated tokens/s, time to first token (TTFT: from sending to the first token's event) and end-to-end latency
percentiles, time per output token after the first, and the server's transport counters from /metrics; prints a
table last and writes JSON to --json_out.

  python3 -m jaxkv.serve_bench --server_flags="--cpu_devices=0 --config=experiments/llama3_8b.py \\
      --kv_placement=host --kv_pipeline_depth=2 --parallel=8" --requests=64 --concurrency=16 --prompt_len=2048 \\
      --max_tokens=128 --json_out=serve_bench.json
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
from absl import app
from absl import flags

from jaxkv import cli

SERVER_FLAGS = flags.DEFINE_string(
    "server_flags", "", "Flags for python3 -m jaxkv.serve (config, placement, depth, --parallel, --cpu_devices...)."
)
REQUESTS = flags.DEFINE_integer("requests", 64, "Measured requests.")
CONCURRENCY = flags.DEFINE_integer("concurrency", 16, "Requests in flight at most (the clients).")
PROMPT_LEN = flags.DEFINE_integer("prompt_len", 512, "Prompt tokens per request (random ids).")
MAX_TOKENS = flags.DEFINE_integer("max_tokens", 64, "New tokens per request.")
SEED = flags.DEFINE_integer("seed", 0, "Seeds the prompt ids.")
STARTUP_S = flags.DEFINE_float("startup_timeout_s", 900.0, "Bound on the server's start (weights, first compile).")
JSON_OUT = flags.DEFINE_string("json_out", None, "Write the results here.")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
  t0 = time.monotonic()
  while time.monotonic() - t0 < timeout:
    if proc.poll() is not None:
      raise RuntimeError(f"the server exited with {proc.returncode} before serving (its log is above)")
    try:
      if httpx.get(url + "/health", timeout=5).status_code == 200:
        return
    except httpx.TransportError:
      pass
    time.sleep(1.0)
  raise RuntimeError(f"the server did not answer /health within {timeout:.0f} s")


async def _one(http: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> dict:
  """One streamed request: its TTFT, latency and tokens."""
  body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
  t0 = time.perf_counter()
  ttft, tokens = None, 0
  async with http.stream("POST", "/v1/completions", json=body) as r:
    if r.status_code != 200:
      raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
    async for line in r.aiter_lines():
      if not line.startswith("data: {"):
        continue
      ids = json.loads(line[6:])["choices"][0]["token_ids"]
      if ids and ttft is None:
        ttft = time.perf_counter() - t0
      tokens += len(ids)
  return dict(ttft_s=ttft, latency_s=time.perf_counter() - t0, tokens=tokens)


async def _load(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> tuple[list[dict], float]:
  limit = asyncio.Semaphore(concurrency)
  limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

  async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as http:

    async def bounded(p):
      async with limit:
        return await _one(http, p, max_tokens)

    t0 = time.perf_counter()
    out = await asyncio.gather(*(bounded(p) for p in prompts))
    return out, time.perf_counter() - t0


def _metrics(url: str) -> dict[str, float]:
  text = httpx.get(url + "/metrics", timeout=30).text
  return {k: float(v) for k, v in (l.rsplit(" ", 1) for l in text.splitlines() if l and not l.startswith("#"))}


def _percentiles(xs) -> dict:
  return {f"p{q}": float(np.percentile(xs, q)) for q in (50, 90, 99)} | {"mean": float(np.mean(xs))}


def run(
    server_flags: list[str],
    requests: int,
    concurrency: int,
    prompt_len: int,
    max_tokens: int,
    seed: int,
    startup_s: float,
) -> dict:
  """Starts the server, runs the warm-up and the measured load, stops the server; returns a JSON-ready dict."""
  port = _free_port()
  url = f"http://127.0.0.1:{port}"
  cmd = [sys.executable, "-m", "jaxkv.serve", f"--port={port}", f"--max_queue={max(requests, 1)}", *server_flags]
  proc = subprocess.Popen(cmd, env=os.environ.copy())
  try:
    _wait_healthy(url, proc, startup_s)
    vocab = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["vocab_size"]
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, vocab, size=(2 * requests, prompt_len)).tolist()
    asyncio.run(_load(url, prompts[:requests], max_tokens, concurrency))  # Compiles; not measured.
    before = _metrics(url)
    results, wall = asyncio.run(_load(url, prompts[requests:], max_tokens, concurrency))
    after = _metrics(url)
  finally:
    proc.send_signal(signal.SIGTERM)
    try:
      proc.wait(120)
    except subprocess.TimeoutExpired:
      proc.kill()
  tokens = sum(r["tokens"] for r in results)
  ttft = [r["ttft_s"] for r in results]
  tpot = [(r["latency_s"] - r["ttft_s"]) / (r["tokens"] - 1) for r in results if r["tokens"] > 1]
  delta = lambda k: after.get(k, 0.0) - before.get(k, 0.0)
  return dict(
      server_flags=server_flags,
      requests=requests,
      concurrency=concurrency,
      prompt_len=prompt_len,
      max_tokens=max_tokens,
      wall_s=wall,
      requests_per_s=requests / wall,
      generated_tokens_per_s=tokens / wall,
      generated_tokens=tokens,
      ttft_s=_percentiles(ttft),
      latency_s=_percentiles([r["latency_s"] for r in results]),
      time_per_output_token_s=_percentiles(tpot) if tpot else None,
      h2d_bytes=delta("jaxkv_host_to_device_bytes_total"),
      slot_insertions=delta("jaxkv_slot_insertions_total"),
      ring_high_water_bytes_per_device=after.get("jaxkv_ring_high_water_bytes", 0.0),
  )


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if min(REQUESTS.value, CONCURRENCY.value, PROMPT_LEN.value, MAX_TOKENS.value) < 1:
    raise app.UsageError("--requests, --concurrency, --prompt_len and --max_tokens must be >= 1")
  logging.getLogger("httpx").setLevel(logging.WARNING)  # A line per request otherwise.
  out = run(
      shlex.split(SERVER_FLAGS.value),
      REQUESTS.value,
      CONCURRENCY.value,
      PROMPT_LEN.value,
      MAX_TOKENS.value,
      SEED.value,
      STARTUP_S.value,
  )
  cli.write_json(out, JSON_OUT.value)
  t, lat = out["ttft_s"], out["latency_s"]
  print(f"server: {' '.join(out['server_flags'])}")
  print(
      f"{'requests':>8} {'conc':>5} {'prompt':>6} {'new':>4} {'req/s':>7} {'tok/s':>8} "
      f"{'TTFT p50':>9} {'p90':>7} {'p99':>7} {'lat p50':>8} {'p99':>7}"
  )
  print(
      f"{out['requests']:>8} {out['concurrency']:>5} {out['prompt_len']:>6} {out['max_tokens']:>4} "
      f"{out['requests_per_s']:>7.2f} {out['generated_tokens_per_s']:>8.1f} {t['p50']:>8.3f}s {t['p90']:>6.3f}s "
      f"{t['p99']:>6.3f}s {lat['p50']:>7.3f}s {lat['p99']:>6.3f}s"
  )


if __name__ == "__main__":
  app.run(main)
