"""The server benchmark's load (`python3 -m jaxkv.serve_bench`): request throughput and time to first token.

`run` starts `python3 -m jaxkv.serve` with the server's flags on a free localhost port, waits for /health, then sends
two rounds of `requests` conversations, at most `concurrency` in flight, and SIGTERMs the server. A conversation is
`turns` streamed requests (greedy, `max_tokens` new tokens each), one after the other: the first prompt is
`prompt_len` random token ids, each next one the previous prompt, its answer and `turn_len` new random ids (a chat's
next turn, which a server with a prefix cache prefills only in part). The first round compiles the shapes that the
second, measured, one meets (the cache grows by kv.block rows at a time, a new shape each time). It returns
requests/s, generated tokens/s, time to first token (TTFT: from sending to the first token's event; of every request
and per turn) and end-to-end latency percentiles, time per output token after the first, and the server's transport
and prefix cache counters from /metrics.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np


class LoadError(Exception):
  """The load could not run: the server did not start, refused the requests, or cannot hold them (status 2: the
  flags must change; 1: the server failed)."""

  def __init__(self, message: str, hint: str | None = None, status: int = 1):
    super().__init__(message)
    self.hint, self.status = hint, status


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
  """Returns once the server at `url` answers /health; LoadError when `proc` exits first, or after `timeout` s."""
  t0 = time.monotonic()
  while time.monotonic() - t0 < timeout:
    if proc.poll() is not None:
      raise LoadError(f"the server exited with status {proc.returncode} before serving", "its error is above")
    try:
      if httpx.get(url + "/health", timeout=5).status_code == 200:
        return
    except httpx.TransportError:
      pass
    time.sleep(1.0)
  raise LoadError(f"the server did not answer /health within {timeout:.0f} s", "raise --startup_timeout_s")


async def _one(http: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> dict:
  """One streamed request: its TTFT, latency and generated ids."""
  body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
  t0 = time.perf_counter()
  ttft, out = None, []
  async with http.stream("POST", "/v1/completions", json=body) as r:
    if r.status_code != 200:
      raise LoadError(f"the server refused a request: HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
    async for line in r.aiter_lines():
      if not line.startswith("data: {"):
        continue
      ids = json.loads(line[6:])["choices"][0]["token_ids"]
      if ids and ttft is None:
        ttft = time.perf_counter() - t0
      out += ids
  return dict(ttft_s=ttft, latency_s=time.perf_counter() - t0, tokens=len(out), ids=out)


async def _load(url: str, turns: list[list[list[int]]], max_tokens: int, concurrency: int) -> tuple[list[dict], float]:
  """turns[c][t]: conversation c's new ids of turn t (turn 0: its first prompt). Returns every request's result
  (with its turn) and the wall time."""
  limit = asyncio.Semaphore(concurrency)
  limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

  async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as http:

    async def conversation(new_ids):
      async with limit:
        prompt, out = [], []
        for t, ids in enumerate(new_ids):
          prompt = prompt + (out[-1]["ids"] if out else []) + ids
          out.append(dict(await _one(http, prompt, max_tokens), turn=t + 1))
        return out

    t0 = time.perf_counter()
    out = await asyncio.gather(*(conversation(c) for c in turns))
    return [r for c in out for r in c], time.perf_counter() - t0


def _metrics(url: str) -> dict[str, float]:
  text = httpx.get(url + "/metrics", timeout=30).text
  return {k: float(v) for k, v in (l.rsplit(" ", 1) for l in text.splitlines() if l and not l.startswith("#"))}


def _percentiles(xs) -> dict:
  return {f"p{q}": float(np.percentile(xs, q)) for q in (50, 90, 99)} | {"mean": float(np.mean(xs))}


def longest_request(prompt_len: int, max_tokens: int, turns: int, turn_len: int) -> int:
  """Cache rows that a conversation's last request needs: its prompt (the first prompt, each earlier answer and
  turn) plus its new tokens - 1."""
  return prompt_len + (turns - 1) * (max_tokens + turn_len) + max_tokens - 1


def run(
    server_flags: list[str],
    requests: int,
    concurrency: int,
    prompt_len: int,
    max_tokens: int,
    seed: int,
    startup_s: float,
    turns: int = 1,
    turn_len: int = 0,
) -> dict:
  """Starts the server, runs the warm-up and the measured load, stops the server; returns a JSON-ready dict."""
  port = free_port()
  url = f"http://127.0.0.1:{port}"
  cmd = [sys.executable, "-m", "jaxkv.serve", f"--port={port}", f"--max_queue={max(requests, 1)}", *server_flags]
  proc = subprocess.Popen(cmd, env=os.environ.copy())
  try:
    wait_healthy(url, proc, startup_s)
    card = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]
    rows = longest_request(prompt_len, max_tokens, turns, turn_len)
    if rows > card["max_model_len"]:
      raise LoadError(
          f"a conversation's last request needs {rows} cache rows (--prompt_len={prompt_len}, --max_tokens="
          f"{max_tokens}, --turns={turns}, --turn_len={turn_len}), more than the server's {card['max_model_len']}",
          "lower them, or raise the server's --capacity in --server_flags",
          status=2,
      )
    vocab = card["vocab_size"]
    rng = np.random.default_rng(seed)
    new = lambda: [rng.integers(0, vocab, prompt_len if t == 0 else turn_len).tolist() for t in range(turns)]
    conversations = [new() for _ in range(2 * requests)]
    asyncio.run(_load(url, conversations[:requests], max_tokens, concurrency))  # Compiles; not measured.
    before = _metrics(url)
    results, wall = asyncio.run(_load(url, conversations[requests:], max_tokens, concurrency))
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
      requests=len(results),
      conversations=requests,
      turns=turns,
      turn_len=turn_len,
      concurrency=concurrency,
      prompt_len=prompt_len,
      max_tokens=max_tokens,
      wall_s=wall,
      requests_per_s=len(results) / wall,
      generated_tokens_per_s=tokens / wall,
      generated_tokens=tokens,
      ttft_s=_percentiles(ttft),
      ttft_s_by_turn={t: _percentiles([r["ttft_s"] for r in results if r["turn"] == t]) for t in range(1, turns + 1)},
      latency_s=_percentiles([r["latency_s"] for r in results]),
      time_per_output_token_s=_percentiles(tpot) if tpot else None,
      h2d_bytes=delta("jaxkv_host_to_device_bytes_total"),
      slot_insertions=delta("jaxkv_slot_insertions_total"),
      ring_high_water_bytes_per_device=after.get("jaxkv_ring_high_water_bytes", 0.0),
      prefix_cache_hits=delta("jaxkv_prefix_cache_hits_total"),
      prefix_cache_hit_tokens=delta("jaxkv_prefix_cache_hit_tokens_total"),
  )
