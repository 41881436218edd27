"""python3 -m jaxkv.serve_bench end to end on the tiny model: against a running server (--url) with conversations of
two turns, the second against the prefix cache; with a server of its own on a free localhost port; and the streams of
a server that sends text only (llama-server's)."""

import asyncio
import json
import subprocess
import sys

import httpx
import serve_helpers

from experiments import tiny
from jaxkv.bench import serve_load


def test_serve_bench_times_each_turn_and_the_second_turn_hits_the_prefix_cache(tmp_path):
  out = tmp_path / "serve_bench.json"
  args = ["--requests=2", "--concurrency=2", "--prompt_len=40", "--max_tokens=4", "--turns=2", "--turn_len=8"]
  with serve_helpers.app("--kv_placement=host", "--parallel=2", "--prefix_cache_gib=0.01", start_s=300) as (url, _):
    proc = subprocess.run(
        [sys.executable, "-m", "jaxkv.serve_bench", f"--url={url}", *args, f"--json_out={out}"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(out.read_text())
  assert (r["conversations"], r["requests"], r["generated_tokens"]) == (2, 4, 16)
  assert set(r["ttft_s_by_turn"]) == {"1", "2"} and all(t["p50"] > 0 for t in r["ttft_s_by_turn"].values())
  # Each second turn starts with its first prompt: two whole blocks of engine.prefill_chunk (16) of its 40 ids.
  assert (r["prefix_cache_hits"], r["prefix_cache_hit_tokens"]) == (2, 2 * 32)
  assert "TTFT p50 by turn: turn 1" in proc.stdout and f"server: {url}" in proc.stdout


def _stream(events: list[dict]) -> httpx.MockTransport:
  body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
  return httpx.MockTransport(lambda request: httpx.Response(200, text=body))


def test_a_server_that_streams_text_only_is_counted_by_its_chunks_or_its_usage():
  """llama-server streams a token's text per chunk, without ids; a final usage chunk, when sent, is the count."""
  text = lambda t: {"choices": [{"index": 0, "text": t}]}

  async def one(events):
    async with httpx.AsyncClient(transport=_stream(events), base_url="http://peer") as http:
      return await serve_load._one(http, [1, 2, 3], 3, {})  # pylint: disable=protected-access

  plain = asyncio.run(one([text("a"), text(""), text("b"), text("c")]))
  assert (plain["tokens"], plain["ids"]) == (3, []) and 0 < plain["ttft_s"] <= plain["latency_s"]
  usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}
  assert asyncio.run(one([text("ab"), text("cd"), usage]))["tokens"] == 4


def test_the_defaults_fit_the_default_server():
  """serve_bench's default prompts, new tokens and turns fit the default server's cache (the tiny config's rows)."""
  flags = "s.PROMPT_LEN, s.MAX_TOKENS, s.TURNS, s.TURN_LEN"
  code = f"from jaxkv.apps import serve_bench as s; print(*(f.default for f in ({flags})))"
  # A process of its own: the app's flags would clash with other apps' in this one.
  defaults = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
  assert serve_load.longest_request(*map(int, defaults)) <= tiny.get_config().engine.capacity


def test_requests_that_the_server_cannot_hold_are_one_line_before_the_load():
  proc = subprocess.run(
      [sys.executable, "-m", "jaxkv.serve_bench", "--prompt_len=200", "--startup_timeout_s=300"],
      capture_output=True,
      text=True,
      timeout=600,
      check=False,
  )
  lines = [l for l in proc.stderr.splitlines() if l.startswith("python3 -m jaxkv.serve_bench")]
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
  assert lines == [
      "python3 -m jaxkv.serve_bench: error: a conversation's last request needs 231 cache rows (--prompt_len=200, "
      "--max_tokens=32, --turns=1, --turn_len=64), more than the server's 128"
  ]
