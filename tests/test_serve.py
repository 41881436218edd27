"""The HTTP server (jaxkv.serving.api over jaxkv.serving.loop) on the tiny model, through the openai client and httpx:
greedy tokens equal generate's, continuous batching leaves the others' tokens alone, bad input is a 400 and the
server keeps serving, a disconnect frees its slot, a full queue is a 429, 64 concurrent requests on 8 slots all
answered, and `python3 -m jaxkv.serve` drains its requests on SIGTERM."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import helpers
import numpy as np
import pytest

for _extra in ("fastapi", "uvicorn", "prometheus_client", "httpx", "openai"):
  pytest.importorskip(_extra, reason="the serve extra: pip install -e '.[serve]'")

# pylint: disable=g-import-not-at-top,g-bad-import-order
import httpx
import openai
import serve_helpers

from jaxkv import serve as serve_app

# pylint: enable=g-import-not-at-top,g-bad-import-order

TIMEOUT_S = 120.0  # Bound on any one request in these tests.
SLOTS = 8


@pytest.fixture(scope="module")
def engine():
  return helpers.engine(2, placement="host", depth=1)


@pytest.fixture(scope="module")
def reference():
  """generate's greedy tokens for a prompt (the device placement: every mode gives the same bits)."""
  eng = helpers.engine(2, placement="device")
  return lambda prompt, n: eng.generate([list(prompt)], n).tokens[0]


@pytest.fixture(scope="module")
def server(engine):
  with serve_helpers.running(engine, parallel=SLOTS, max_queue=64) as (url, model):
    yield url, model


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)


metrics = serve_helpers.metrics


def wait_for(predicate, what: str, timeout: float = 30.0):
  t0 = time.monotonic()
  while not predicate():
    assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
    time.sleep(0.05)


def test_models_health_and_metric_names(server, client):
  url, _ = server
  assert [m.id for m in client.models.list().data] == ["tiny"]
  assert httpx.get(url + "/health", timeout=TIMEOUT_S).json() == {"status": "ok"}
  names = metrics(url)
  for name in (
      "jaxkv_requests_total",
      "jaxkv_generated_tokens_total",
      "jaxkv_tokens_per_second",
      "jaxkv_queue_length",
      "jaxkv_slots_busy",
      "jaxkv_epoch_running",
      "jaxkv_host_to_device_bytes_total",
      "jaxkv_ring_high_water_bytes",
      "jaxkv_time_to_first_token_seconds_count",
  ):
    assert any(k.split("{")[0] == name for k in names), name
  assert all(k.startswith("jaxkv_") for k in names)


def test_greedy_tokens_equal_generate_streamed_or_not(client, reference):
  prompt = helpers.prompts([13], seed=5)[0]
  want = reference(prompt, 9)
  out = client.completions.create(model="tiny", prompt=prompt, max_tokens=9, temperature=0)
  choice = out.choices[0]
  assert choice.token_ids == want and choice.finish_reason == "length" and choice.text == ""
  assert out.usage.prompt_tokens == 13 and out.usage.completion_tokens == 9
  chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=9, temperature=0, stream=True))
  assert [t for c in chunks for t in c.choices[0].token_ids] == want
  assert chunks[-1].choices[0].finish_reason == "length"


def test_sampling_is_seeded_per_request(client):
  prompt = helpers.prompts([6], seed=6)[0]
  ask = lambda seed: client.completions.create(
      model="tiny", prompt=prompt, max_tokens=12, temperature=1.5, top_p=0.95, seed=seed, extra_body={"top_k": 40}
  )
  a, b, c = ask(3), ask(3), ask(4)
  assert a.choices[0].token_ids == b.choices[0].token_ids != c.choices[0].token_ids


def test_a_request_arriving_mid_decode_takes_a_slot_without_disturbing(server, client, reference):
  url, _ = server
  long_prompt, short_prompt = helpers.prompts([6, 3], seed=7)
  want_long, want_short = reference(long_prompt, 60), reference(short_prompt, 10)
  before = metrics(url)["jaxkv_slot_insertions_total"]
  stream = client.completions.create(model="tiny", prompt=long_prompt, max_tokens=60, temperature=0, stream=True)
  got_long, short = [], {}
  for chunk in stream:
    got_long += chunk.choices[0].token_ids
    if len(got_long) == 4:  # The long one decodes: the short one arrives.
      thread = threading.Thread(
          target=lambda: short.update(
              out=client.completions.create(model="tiny", prompt=short_prompt, max_tokens=10, temperature=0)
          )
      )
      thread.start()
  thread.join(TIMEOUT_S)
  assert got_long == want_long
  assert short["out"].choices[0].token_ids == want_short
  assert metrics(url)["jaxkv_slot_insertions_total"] > before  # It entered the running batch.


@pytest.mark.parametrize(
    "body, message",
    [
        ('{"prompt": [1, 2', "malformed JSON"),
        ('{"prompt": [1, 2], "temperature": "hot"}', "temperature"),
        ('{"prompt": [1, "2"]}', "prompt"),
        ('{"prompt": [1, 2], "max_tokens": 200}', "capacity 128"),
        ('{"prompt": [' + ", ".join(["3"] * 129) + "]}", "longer than the cache capacity"),
        ('{"prompt": []}', "empty"),
        ('{"prompt": [1, 999]}', "outside"),
        ('{"prompt": "some text"}', "token ids"),
        ('{"prompt": [1], "n": 17}', "n: Input should be less than or equal to 16"),
        ('{"prompt": [1], "stop": ["x"]}', "stop"),
        ('{"messages": [{"role": "user", "content": "hi"}]}', "chat needs"),
        ("[1, 2]", "invalid request"),
    ],
)
def test_bad_input_is_a_400_and_the_server_keeps_serving(server, client, body, message):
  url, _ = server
  path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
  r = httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=TIMEOUT_S)
  assert r.status_code == 400, r.text
  assert message in r.json()["error"]["message"]
  assert len(client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=2).choices[0].token_ids) == 2


def test_unknown_model_is_a_404(client):
  with pytest.raises(openai.NotFoundError, match="not served here"):
    client.completions.create(model="gpt-5", prompt=[1], max_tokens=1)


def test_a_client_that_disconnects_mid_stream_frees_its_slot(server):
  url, _ = server
  before = metrics(url)
  ended = serve_helpers.finished(url)[0]
  body = {"prompt": [5, 6, 7], "max_tokens": 120, "stream": True}
  with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT_S) as r:
    events, lines = [], r.iter_lines()  # Held: a dropped iterator closes the connection.
    for line in lines:
      if line.startswith("data:"):
        events.append(json.loads(line[5:]))
      if len(events) == 3:
        break
    assert metrics(url)["jaxkv_slots_busy"] == 1
  cancelled = 'jaxkv_requests_total{reason="cancelled"}'
  wait_for(lambda: metrics(url)[cancelled] == before[cancelled] + 1, "the cancellation")
  after = metrics(url)
  assert after["jaxkv_slots_busy"] == 0
  assert serve_helpers.one_more(ended, serve_helpers.finished(url)[0], "cancelled")
  assert 3 <= after["jaxkv_generated_tokens_total"] - before["jaxkv_generated_tokens_total"] < 60  # Not to its end.


def test_a_client_that_disconnects_before_its_answer_frees_its_slot(server, engine):
  """Not streaming: the server hears the disconnect (not only a failed write) and ends the request at the next decode
  step, long before its max_tokens."""
  url, model = server
  ended, tokens = serve_helpers.finished(url)
  engine_tokens = model.loop.stats.tokens
  body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 120}).encode()
  head = f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {len(body)}"
  with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as sock:
    sock.sendall(head.encode() + b"\r\n\r\n" + body)
    wait_for(lambda: model.loop.stats.tokens > engine_tokens, "its first token", timeout=TIMEOUT_S)
  wait_for(lambda: serve_helpers.finished(url)[0]["cancelled"] == ended["cancelled"] + 1, "the cancellation")
  wait_for(lambda: metrics(url)["jaxkv_slots_busy"] == 0, "its slot")
  assert serve_helpers.one_more(ended, serve_helpers.finished(url)[0], "cancelled")
  assert model.loop.stats.tokens - engine_tokens < 60  # Not run to its end.
  assert serve_helpers.finished(url)[1] - tokens < 60


@pytest.mark.parametrize(
    "method, path, body, status, message",
    [
        ("GET", "/v1/nowhere", None, 404, "Not Found: GET /v1/nowhere"),
        ("GET", "/v1/completions", None, 405, "Method Not Allowed: GET /v1/completions"),
        ("POST", "/v1/completions", b'{"prompt": [1], "stop": "\xff"}', 400, "not UTF-8"),
        ("POST", "/v1/completions", b'{"prompt": [1], "max_tokens": 0}', 400, "max_tokens"),
    ],
)
def test_framework_errors_are_openai_shaped(server, method, path, body, status, message):
  url, _ = server
  r = httpx.request(method, url + path, content=body, headers={"content-type": "application/json"}, timeout=TIMEOUT_S)
  assert r.status_code == status, r.text
  error = r.json()["error"]
  assert message in error["message"] and error["type"] == "invalid_request_error" and error["code"] == status, error
  assert set(error) == {"message", "type", "param", "code"}


def test_64_concurrent_requests_on_8_slots_are_all_answered(server, reference):
  url, _ = server
  rng = np.random.default_rng(8)
  lengths = rng.integers(1, 25, size=64).tolist()
  news = rng.integers(2, 13, size=64).tolist()
  prompts = helpers.prompts(lengths, seed=9)

  async def load():
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)
    calls = [client.completions.create(model="tiny", prompt=p, max_tokens=n) for p, n in zip(prompts, news)]
    return await asyncio.wait_for(asyncio.gather(*calls), 4 * TIMEOUT_S)

  outs = asyncio.run(load())
  assert [len(o.choices[0].token_ids) for o in outs] == news
  for i in (0, 21, 63):
    assert outs[i].choices[0].token_ids == reference(prompts[i], news[i]), i
  assert metrics(url)["jaxkv_queue_length"] == 0


def test_a_full_queue_is_a_429(engine):
  # A loop that is not started: the first request waits in the queue for good, the second finds it full.
  with serve_helpers.running(engine, parallel=2, max_queue=1, start_loop=False) as (url, model):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)

    async def two():
      async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as http:
        waiting = asyncio.ensure_future(http.post("/v1/completions", json={"prompt": [1], "max_tokens": 2}))
        t0 = time.monotonic()
        while model.loop.stats.waiting < 1:
          assert time.monotonic() - t0 < TIMEOUT_S
          await asyncio.sleep(0.02)
        with pytest.raises(openai.RateLimitError, match="queue holds 1"):
          await asyncio.to_thread(client.completions.create, model="tiny", prompt=[1], max_tokens=2)
        full = await http.post("/v1/completions", json={"prompt": [1], "max_tokens": 2})
        assert full.status_code == 429 and full.headers["retry-after"] == "1"
        assert full.json()["error"]["type"] == "rate_limit_error"
        waiting.cancel()

    asyncio.run(two())


def test_the_app_serves_and_drains_on_sigterm(reference):
  port = serve_helpers.free_port()
  url = f"http://127.0.0.1:{port}"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  cmd = [
      sys.executable,
      "-m",
      serve_app.__name__,
      "--cpu_devices=2",
      f"--port={port}",
      "--parallel=4",
      "--warmup",
  ]
  proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:

    def healthy():
      assert proc.poll() is None, proc.stdout.read()
      try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
      except httpx.TransportError:
        return False

    wait_for(healthy, "the server to start", timeout=240)
    prompt = helpers.prompts([5], seed=11)[0]
    body = {"prompt": prompt, "max_tokens": 60, "temperature": 0, "stream": True}
    ids, done = [], False
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT_S) as r:
      for line in r.iter_lines():
        if line == "data: [DONE]":
          done = True
        elif line.startswith("data:"):
          ids += json.loads(line[5:])["choices"][0]["token_ids"]
          if len(ids) == 2:
            proc.send_signal(signal.SIGTERM)  # Mid-stream: the request still runs to its end.
    assert done and ids == reference(prompt, 60)
    assert proc.wait(TIMEOUT_S) == 0
    # The tiny model's capacity (128 rows) is below a leaf: device windows of 0 rows and of 128, warmed up first,
    # then the prefill's 8 chunks of 16 rows (last chunks of 8 or 16 rows).
    lines = proc.stdout.read().splitlines()
    warm = [l for l in lines if l.startswith("warm-up: window ")]
    assert [l.split(",")[0] for l in warm] == ["warm-up: window 0 rows (1/2)", "warm-up: window 128 rows (2/2)"]
    prefill = [l for l in lines if l.startswith("warm-up: prefill ")]
    assert [l.rsplit(",", 1)[0] for l in prefill] == [
        f"warm-up: prefill chunk {c} ({c + 1}/8), 8 to 16 rows" for c in range(8)
    ]
    assert lines.index(warm[-1]) < lines.index(prefill[0])
    assert lines.index(prefill[-1]) < next(i for i, l in enumerate(lines) if l.startswith("serving "))
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
