"""Exactness through the server: the gate's 8 tasks (jaxkv.bench.gate_suite: prompts of 1 row, the block boundaries, past a
prefill chunk, near the capacity), sent over HTTP while the parallel gate's 16 requests are in flight, get
generate's greedy tokens in every placement and depth; every request's tokens hash the same across the arms."""

import asyncio
import hashlib
import json

import helpers
import pytest

for _extra in ("fastapi", "uvicorn", "prometheus_client", "httpx"):
  pytest.importorskip(_extra, reason="the serve extra: pip install -e '.[serve]'")

# pylint: disable=g-import-not-at-top,g-bad-import-order
import httpx
import serve_helpers

from jaxkv import run as run_lib
from jaxkv.bench import gate_suite

# pylint: enable=g-import-not-at-top,g-bad-import-order

NEW_TOKENS = 12
TIMEOUT_S = 300.0
ARMS = (("device", 1), ("host", 0), ("host", 1), ("host", 4))


@pytest.fixture(scope="module")
def cases():
  config = helpers.tiny_config()
  tasks = run_lib.random_prompts(config.model.vocab_size, gate_suite.task_lengths(config, NEW_TOKENS), 0)
  others = gate_suite.parallel_requests(config, 16, NEW_TOKENS, 0)
  reference = helpers.engine(2, placement="device")
  want = [reference.generate([p], NEW_TOKENS).tokens[0] for p in tasks]
  return tasks, others, want


async def _serve_all(url, tasks, others):
  """The 16 others (streamed) and the 8 tasks, all in flight together; returns every request's token ids."""

  async def complete(http, prompt, n):
    r = await http.post("/v1/completions", json={"prompt": list(prompt), "max_tokens": n, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]

  async def stream(http, prompt, n):
    ids = []
    body = {"prompt": list(prompt), "max_tokens": n, "temperature": 0, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as r:
      async for line in r.aiter_lines():
        if line.startswith("data: {"):
          ids += json.loads(line[6:])["choices"][0]["token_ids"]
    return ids

  async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as http:
    calls = [stream(http, r.prompt, r.max_new_tokens) for r in others]
    calls += [complete(http, p, NEW_TOKENS) for p in tasks]
    return await asyncio.wait_for(asyncio.gather(*calls), TIMEOUT_S)


def test_tasks_get_generate_s_tokens_in_every_arm_while_16_others_run(cases):
  tasks, others, want = cases
  hashes = {}
  for placement, depth in ARMS:
    with serve_helpers.running(helpers.engine(2, placement=placement, depth=depth), parallel=8) as (url, _):
      got = asyncio.run(_serve_all(url, tasks, others))
    assert got[len(others) :] == want, (placement, depth)
    assert [len(t) for t in got[: len(others)]] == [r.max_new_tokens for r in others]
    hashes[placement, depth] = [hashlib.sha256(json.dumps(t).encode()).hexdigest() for t in got]
  assert len({tuple(h) for h in hashes.values()}) == 1, hashes
