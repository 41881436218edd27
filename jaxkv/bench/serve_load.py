"""The server benchmark's load (`python3 -m jaxkv.serve_bench`): request throughput and time to first token.

`run` drives any OpenAI-compatible server (jaxkv.serve started by `jaxkv_server`, llama-server, vLLM) with two rounds
of `requests` conversations, at most `concurrency` in flight: the first compiles / warms, the second is measured. A
conversation is `turns` streamed requests (greedy, `max_tokens` new tokens each, past any end of sequence unless
`ignore_eos` is off), one after the other: the first prompt is
`prompt_len` random token ids, each next one the previous prompt, its answer and `turn_len` new random ids (a chat's
next turn, which a server with a prefix cache prefills only in part; it needs a server that streams token ids, as
jaxkv.serve does). It returns
requests/s, generated tokens/s, time to first token (TTFT: from sending to the first token's event; of every request
and per turn) and end-to-end latency percentiles, time per output token after the first, and jaxkv's transport and
prefix cache counters from /metrics (zero for another server).
"""

from __future__ import annotations

import asyncio
import contextlib
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


async def _one(http: httpx.AsyncClient, prompt: list[int], max_tokens: int, extra: dict) -> dict:
  """One streamed request: its TTFT, latency, generated ids (when the server streams them, as jaxkv.serve does) and
  generated tokens (the final usage chunk's count, else the ids', else one per chunk with text, as llama-server
  streams)."""
  body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, **extra}
  body["stream_options"] = {"include_usage": True}
  t0 = time.perf_counter()
  ttft, ids, chunks, usage = None, [], 0, None
  async with http.stream("POST", "/v1/completions", json=body) as r:
    if r.status_code != 200:
      raise LoadError(f"the server refused a request: HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
    async for line in r.aiter_lines():
      if not line.startswith("data: {"):
        continue
      event = json.loads(line[6:])
      usage = event.get("usage") or usage
      for choice in event.get("choices") or []:
        new = choice.get("token_ids") or []
        if new or choice.get("text"):
          ttft = time.perf_counter() - t0 if ttft is None else ttft
          ids, chunks = ids + new, chunks + 1
  tokens = usage["completion_tokens"] if usage else len(ids) or chunks
  return dict(ttft_s=ttft, latency_s=time.perf_counter() - t0, tokens=tokens, ids=ids)


async def _load(
    url: str, turns: list[list[list[int]]], max_tokens: int, concurrency: int, extra: dict
) -> tuple[list[dict], float]:
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
          out.append(dict(await _one(http, prompt, max_tokens, extra), turn=t + 1))
        return out

    t0 = time.perf_counter()
    out = await asyncio.gather(*(conversation(c) for c in turns))
    return [r for c in out for r in c], time.perf_counter() - t0


def _metrics(url: str) -> dict[str, float]:
  """The server's Prometheus counters; none from a server without /metrics."""
  r = httpx.get(url + "/metrics", timeout=30)
  if r.status_code != 200:
    return {}
  return {k: float(v) for k, v in (l.rsplit(" ", 1) for l in r.text.splitlines() if l and not l.startswith("#"))}


def _percentiles(xs) -> dict:
  return {f"p{q}": float(np.percentile(xs, q)) for q in (50, 90, 99)} | {"mean": float(np.mean(xs))}


def longest_request(prompt_len: int, max_tokens: int, turns: int, turn_len: int) -> int:
  """Cache rows that a conversation's last request needs: its prompt (the first prompt, each earlier answer and
  turn) plus its new tokens - 1."""
  return prompt_len + (turns - 1) * (max_tokens + turn_len) + max_tokens - 1


@contextlib.contextmanager
def jaxkv_server(server_flags: list[str], max_queue: int, startup_s: float):
  """`python3 -m jaxkv.serve *server_flags` on a free localhost port, healthy; yields its URL, SIGTERMs it at the end."""
  port = free_port()
  url = f"http://127.0.0.1:{port}"
  cmd = [sys.executable, "-m", "jaxkv.serve", f"--port={port}", f"--max_queue={max_queue}", *server_flags]
  proc = subprocess.Popen(cmd, env=os.environ.copy())
  try:
    wait_healthy(url, proc, startup_s)
    yield url
  finally:
    proc.send_signal(signal.SIGTERM)
    try:
      proc.wait(120)
    except subprocess.TimeoutExpired:
      proc.kill()


def _card(url: str) -> tuple[int | None, int | None]:
  """(context rows, vocabulary) from /v1/models: vLLM's and jaxkv's `max_model_len` and `vocab_size`, llama-server's
  `meta.n_vocab`; None where the server does not say."""
  card = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]
  return card.get("max_model_len"), card.get("vocab_size") or (card.get("meta") or {}).get("n_vocab")


def run(
    url: str,
    requests: int,
    concurrency: int,
    prompt_len: int,
    max_tokens: int,
    seed: int,
    turns: int = 1,
    turn_len: int = 0,
    vocab_size: int | None = None,
    ignore_eos: bool = True,
    warmup: int | None = None,
) -> dict:
  """Runs the warm-up (`warmup` conversations, by default `requests`) and the measured load against the server at
  `url`; returns a JSON-ready dict."""
  rows_limit, vocab = _card(url)
  rows = longest_request(prompt_len, max_tokens, turns, turn_len)
  if rows_limit is not None and rows > rows_limit:
    raise LoadError(
        f"a conversation's last request needs {rows} cache rows (--prompt_len={prompt_len}, --max_tokens="
        f"{max_tokens}, --turns={turns}, --turn_len={turn_len}), more than the server's {rows_limit}",
        "lower them, or raise the server's --capacity in --server_flags",
        status=2,
    )
  vocab = vocab_size or vocab
  if vocab is None:
    raise LoadError(f"the server at {url} does not state its vocabulary in /v1/models", "give --vocab_size", 2)
  extra = {"ignore_eos": True} if ignore_eos else {}
  rng = np.random.default_rng(seed)
  new = lambda: [rng.integers(0, vocab, prompt_len if t == 0 else turn_len).tolist() for t in range(turns)]
  warmup = requests if warmup is None else warmup
  conversations = [new() for _ in range(warmup + requests)]
  warm, _ = asyncio.run(_load(url, conversations[:warmup], max_tokens, concurrency, extra))  # Compiles.
  if turns > 1 and not all(r["ids"] for r in warm):
    raise LoadError(f"--turns={turns} needs the answers' token ids, which the server at {url} does not stream", None, 2)
  before = _metrics(url)
  results, wall = asyncio.run(_load(url, conversations[warmup:], max_tokens, concurrency, extra))
  after = _metrics(url)
  tokens = sum(r["tokens"] for r in results)
  ttft = [r["ttft_s"] for r in results]
  tpot = [(r["latency_s"] - r["ttft_s"]) / (r["tokens"] - 1) for r in results if r["tokens"] > 1]
  delta = lambda k: after.get(k, 0.0) - before.get(k, 0.0)
  return dict(
      url=url,
      requests=len(results),
      conversations=requests,
      warmup_conversations=warmup,
      turns=turns,
      turn_len=turn_len,
      concurrency=concurrency,
      prompt_len=prompt_len,
      max_tokens=max_tokens,
      ignore_eos=ignore_eos,
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
