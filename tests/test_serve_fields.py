"""The OpenAI request fields of the HTTP server (jaxkv.serving.api) on the tiny model, through the openai client and
httpx: a field the server does not implement is a 400 naming it (its no-op value is accepted), logprobs are the
float32 log-softmax of the model's logits in the OpenAI shape (streamed too), the prompt's with echo, n samples share
one prefill, penalties and logit_bias reach the head per request (other values compile nothing new),
stop_token_ids and min_tokens, usage in a stream's last chunk, structured output's refusals without a tokenizer
(tests/test_gguf.py serves it on SmolLM2); an API key and CORS origins guard the endpoints; /props."""

import json
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

from jaxkv import compile_cache
from jaxkv import reference as reference_lib
from jaxkv import serving
from jaxkv.config import SamplingConfig
from jaxkv.serving import access as access_lib

# pylint: enable=g-import-not-at-top,g-bad-import-order

TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def server():
  with serve_helpers.running(helpers.engine(2, placement="host", depth=1), parallel=4) as (url, model):
    yield url, model


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def reference():
  """generate's run of one prompt (tokens and logits f32[steps, 1, V]), greedy with `sampling`."""
  engines = {}

  def run(prompt, n, sampling=SamplingConfig()):
    if sampling not in engines:
      engines[sampling] = helpers.engine(2, placement="device", sampling=sampling)
    return engines[sampling].generate([list(prompt)], n, keep_logits=True)

  return run


def _post(url, body):
  return httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT_S)


@pytest.mark.parametrize(
    "field, value",
    [
        ("frobnicate", 1),
        ("suffix", "x"),
        ("best_of", 2),
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ],
)
def test_a_field_the_server_does_not_implement_is_a_400_naming_it(server, field, value):
  r = _post(server[0], {"prompt": [1, 2], "max_tokens": 2, field: value})
  assert r.status_code == 400, r.text
  assert r.json()["error"]["message"].startswith(f"invalid request: unsupported field '{field}'"), r.text


def test_nested_unknown_fields_are_refused_and_no_op_values_accepted(server, client):
  r = _post(server[0], {"prompt": [1], "stream": True, "stream_options": {"include_usage": True, "extra": 1}})
  assert r.status_code == 400 and "unsupported field 'stream_options.extra'" in r.json()["error"]["message"]
  out = client.completions.create(
      model="tiny", prompt=[1, 2], max_tokens=2, echo=False, best_of=1, user="someone", extra_body={"tools": []}
  )
  assert len(out.choices[0].token_ids) == 2


def test_completion_logprobs_are_the_model_s_log_softmax_streamed_or_not(client, reference):
  prompt = helpers.prompts([11], seed=21)[0]
  ref = reference(prompt, 7)
  out = client.completions.create(model="tiny", prompt=prompt, max_tokens=7, temperature=0, logprobs=5)
  choice = out.choices[0]
  assert choice.token_ids == ref.tokens[0]
  lp = choice.logprobs
  assert lp.tokens == [f"token_id:{t}" for t in choice.token_ids] and lp.text_offset == [0] * 7  # No text.
  x = ref.logits[:, 0].astype(np.float64)
  want = x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)
  for t, token in enumerate(choice.token_ids):
    np.testing.assert_allclose(lp.token_logprobs[t], want[t, token], rtol=0, atol=1e-5)
    top = np.argsort(-want[t], kind="stable")[:5]
    assert list(lp.top_logprobs[t]) == [f"token_id:{i}" for i in top]
    np.testing.assert_allclose(list(lp.top_logprobs[t].values()), want[t, top], rtol=0, atol=1e-5)
    assert lp.top_logprobs[t][f"token_id:{token}"] == lp.token_logprobs[t]  # Greedy: the top one.
  chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=7, logprobs=5, stream=True))
  streamed = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
  assert streamed == lp.token_logprobs
  plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
  assert plain.choices[0].logprobs is None


def _log_softmax(x: np.ndarray) -> np.ndarray:
  x = x.astype(np.float64)
  m = x.max(-1, keepdims=True)
  return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_echo_with_logprobs_gives_the_prompt_tokens_logprobs_of_the_reference(server, client):
  """lm-eval's loglikelihood request (echo, logprobs, max_tokens 0) over a prompt of three prefill chunks: each
  prompt token's logprob under the tokens before it (the first null) equals the no-cache reference's log-softmax;
  with generated tokens after it, streamed or not, the prompt's entries are the same and the generated ones are a
  plain request's."""
  eng = server[1].loop.server.engine
  prompt = helpers.prompts([37], seed=26)[0]
  want = _log_softmax(np.asarray(reference_lib.forward(eng.params, np.array([prompt]), eng.config.model))[0])
  only = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=3)
  choice, usage = only.choices[0], only.usage
  assert choice.token_ids == [] and choice.finish_reason == "length"
  assert (usage.prompt_tokens, usage.completion_tokens) == (37, 0)
  lp = choice.logprobs
  assert lp.tokens == [f"token_id:{t}" for t in prompt] and lp.text_offset == [0] * 37
  assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
  np.testing.assert_allclose(lp.token_logprobs[1:], want[np.arange(36), prompt[1:]], rtol=0, atol=1e-4)
  for i in range(1, 37):
    top = np.argsort(-want[i - 1], kind="stable")[:3]
    assert list(lp.top_logprobs[i]) == [f"token_id:{t}" for t in top], i
    np.testing.assert_allclose(list(lp.top_logprobs[i].values()), want[i - 1, top], rtol=0, atol=1e-4)
  plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, logprobs=3).choices[0]
  echoed = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, logprobs=3, echo=True).choices[0]
  assert echoed.token_ids == plain.token_ids
  assert echoed.logprobs.token_logprobs == lp.token_logprobs + plain.logprobs.token_logprobs
  assert echoed.logprobs.top_logprobs == lp.top_logprobs + plain.logprobs.top_logprobs
  chunks = list(
      client.completions.create(model="tiny", prompt=prompt, max_tokens=4, logprobs=3, echo=True, stream=True)
  )
  streamed = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
  assert streamed == echoed.logprobs.token_logprobs


def test_n_samples_share_one_prefill_and_sample_i_draws_with_seed_plus_i(server, client, monkeypatch):
  eng = server[1].loop.server.engine
  prefills = []
  prefill_slot = eng.prefill_slot
  monkeypatch.setattr(eng, "prefill_slot", lambda *a, **k: prefills.append(1) or prefill_slot(*a, **k))
  prompt = helpers.prompts([21], seed=27)[0]
  sampled = dict(model="tiny", prompt=prompt, max_tokens=8, temperature=0.9, seed=5)
  out = client.completions.create(n=3, **sampled)
  assert len(prefills) == 1  # The other two samples took its rows.
  assert [c.index for c in out.choices] == [0, 1, 2]
  alone = [client.completions.create(**dict(sampled, seed=5 + i)).choices[0].token_ids for i in range(3)]
  assert [c.token_ids for c in out.choices] == alone and len({tuple(a) for a in alone}) == 3
  assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (21, 24)
  chunks = list(client.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **sampled))
  streamed, finished = [[], [], []], [None] * 3
  for c in chunks[:-1]:
    (choice,) = c.choices
    assert finished[choice.index] is None  # Nothing after a choice's last chunk.
    streamed[choice.index] += choice.token_ids
    finished[choice.index] = choice.finish_reason
  assert streamed == alone and finished == ["length"] * 3
  assert chunks[-1].usage.completion_tokens == 24 and chunks[-1].usage.prompt_tokens == 21


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"response_format": {"type": "json_object"}}, "response_format: structured output needs a checkpoint with a"),
        ({"guided_regex": "[0-9]+"}, "guided_regex: structured output needs a checkpoint with a tokenizer.json"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "needs json_schema.schema"),
        (
            {"grammar": 'root ::= "a"', "guided_json": {}},
            "one structured output field per request, got guided_json, gr",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ],
)
def test_structured_output_needs_a_tokenizer_and_one_grammar(server, fields, message):
  r = _post(server[0], dict({"prompt": [1, 2], "max_tokens": 2}, **fields))
  assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
  assert _post(server[0], {"prompt": [1, 2], "max_tokens": 2, "response_format": {"type": "text"}}).status_code == 200


def test_slots_show_the_request_each_slot_serves(server):
  """GET /slots; mid-request (its third token's callback, on the engine thread), its slot shows it."""
  url, model = server
  seen, done = [], threading.Event()

  def on_token(token, _):
    seen.append(token)
    if len(seen) == 3:
      seen.append(model.loop.slots())

  model.loop.submit(serving.Request((4, 5, 6, 7), 5), on_token, lambda *_: done.set())
  assert done.wait(TIMEOUT_S)
  tokens, slots = seen[:3] + seen[4:], seen[3]
  (busy,) = [s for s in slots if s["is_processing"]]
  assert busy["n_prompt_tokens"] == 4 and busy["tokens"] == tokens[:3] and busy["n_decoded"] == 3
  assert busy["id_task"] >= 0 and all(s["n_ctx"] == model.capacity for s in slots)
  idle = httpx.get(url + "/slots", timeout=TIMEOUT_S).json()
  assert [s["id"] for s in idle] == [0, 1, 2, 3]
  assert not any(s["is_processing"] for s in idle) and all(s["id_task"] == -1 and s["tokens"] == [] for s in idle)


def test_max_tokens_0_needs_echo_and_chat_does_not_echo(server):
  r = _post(server[0], {"prompt": [1, 2], "max_tokens": 0})
  assert r.status_code == 400 and "needs echo: true" in r.json()["error"]["message"], r.text
  r = httpx.post(
      server[0] + "/v1/chat/completions",
      json={"messages": [{"role": "user", "content": "hi"}], "echo": True},
      timeout=TIMEOUT_S,
  )
  assert r.status_code == 400 and "unsupported field 'echo'" in r.json()["error"]["message"], r.text


def test_penalties_and_min_p_equal_generate_with_them(client, reference):
  prompt = helpers.prompts([9], seed=22)[0]
  sampling = SamplingConfig(presence_penalty=0.5, frequency_penalty=1.25, repetition_penalty=1.2)
  want = reference(prompt, 12, sampling).tokens[0]
  out = client.completions.create(
      model="tiny",
      prompt=prompt,
      max_tokens=12,
      temperature=0,
      presence_penalty=0.5,
      frequency_penalty=1.25,
      extra_body={"repetition_penalty": 1.2, "min_p": 0.9},  # Greedy: min-p keeps the largest.
  )
  assert out.choices[0].token_ids == want != reference(prompt, 12).tokens[0]


def test_logit_bias_bans_and_forces_tokens(client, reference):
  prompt = helpers.prompts([7], seed=23)[0]
  plain = reference(prompt, 8).tokens[0]
  banned = client.completions.create(
      model="tiny", prompt=prompt, max_tokens=8, temperature=0, logit_bias={str(t): -100 for t in set(plain)}
  )
  assert not set(banned.choices[0].token_ids) & set(plain)
  forced = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0.9, logit_bias={"17": 100})
  assert forced.choices[0].token_ids == [17] * 4


@pytest.mark.parametrize(
    "body, message",
    [
        ({"logit_bias": {"x": 1}}, "keys are token ids"),
        ({"logit_bias": {"3": 101}}, "[-100, 100]"),
        ({"logit_bias": {"999": 1}}, "outside the vocabulary"),
        ({"stop_token_ids": [1000]}, "outside the vocabulary"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options: only with stream: true"),
    ],
)
def test_bad_sampling_fields_are_a_400(server, body, message):
  r = _post(server[0], dict({"prompt": [1, 2], "max_tokens": 4}, **body))
  assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


def test_stop_token_ids_end_a_request_and_min_tokens_holds_them_back(client, reference):
  prompt = helpers.prompts([10], seed=24)[0]
  plain = reference(prompt, 10).tokens[0]
  stop = plain[3]
  out = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, extra_body={"stop_token_ids": [stop]})
  assert out.choices[0].token_ids == plain[: plain.index(stop) + 1] and out.choices[0].finish_reason == "stop"
  held = client.completions.create(
      model="tiny", prompt=prompt, max_tokens=10, extra_body={"stop_token_ids": [stop], "min_tokens": 6}
  )
  ids = held.choices[0].token_ids
  assert stop not in ids[:6] and ids[: plain.index(stop)] == plain[: plain.index(stop)]


def test_a_stream_with_include_usage_ends_with_a_usage_chunk(server):
  body = {"prompt": [4, 5, 6], "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
  with httpx.stream("POST", server[0] + "/v1/completions", json=body, timeout=TIMEOUT_S) as r:
    events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
  assert events[-1] == "[DONE]"
  last = json.loads(events[-2])
  usage = {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6, "prompt_tokens_details": {"cached_tokens": 0}}
  assert last["choices"] == [] and last["usage"] == usage
  assert all("usage" not in json.loads(e) for e in events[:-2])


def test_an_api_key_guards_every_endpoint_but_health_and_cors_answers_browsers():
  access = access_lib.Access(api_key="s3cret", cors_origins=("https://app.example",))
  with serve_helpers.running(helpers.engine(1), parallel=2, access=access) as (url, _):
    assert httpx.get(url + "/health", timeout=TIMEOUT_S).status_code == 200
    client = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0, timeout=TIMEOUT_S)
    with pytest.raises(openai.AuthenticationError, match="API key"):
      client.completions.create(model="tiny", prompt=[1], max_tokens=1)
    assert _post(url, {"prompt": [1], "max_tokens": 1}).status_code == 401  # No key.
    assert httpx.get(url + "/metrics", timeout=TIMEOUT_S).status_code == 401
    client = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0, timeout=TIMEOUT_S)
    assert len(client.completions.create(model="tiny", prompt=[1], max_tokens=2).choices[0].token_ids) == 2
    preflight = httpx.options(
        url + "/v1/completions",
        headers={"origin": "https://app.example", "access-control-request-method": "POST"},
        timeout=TIMEOUT_S,
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "https://app.example"
    other = httpx.options(
        url + "/v1/completions",
        headers={"origin": "https://evil.example", "access-control-request-method": "POST"},
        timeout=TIMEOUT_S,
    )
    assert "access-control-allow-origin" not in other.headers


def test_props_and_tokenize_without_a_tokenizer(server):
  url, model = server
  props = httpx.get(url + "/props", timeout=TIMEOUT_S).json()
  assert props["total_slots"] == 4 and props["default_generation_settings"]["n_ctx"] == model.capacity
  assert props["default_generation_settings"]["temperature"] == 0.0 and props["chat_template"] is None
  r = httpx.post(url + "/tokenize", json={"content": "hi"}, timeout=TIMEOUT_S)
  assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"]


def test_usage_counts_the_prompt_tokens_served_from_the_prefix_cache():
  prompt = helpers.prompts([40], seed=25)[0]
  with serve_helpers.running(helpers.engine(1), parallel=2, prefix_cache_bytes=2**24) as (url, _):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)
    cold, warm = (client.completions.create(model="tiny", prompt=prompt, max_tokens=2) for _ in range(2))
    follow = client.completions.create(
        model="tiny", prompt=prompt[:20] + [3] * 5, max_tokens=2, stream=True, stream_options={"include_usage": True}
    )
    last = list(follow)[-1]
  assert cold.usage.prompt_tokens_details.cached_tokens == 0
  assert warm.usage.prompt_tokens_details.cached_tokens == 32  # Its whole blocks (16 rows) before its last token.
  assert last.usage.prompt_tokens_details.cached_tokens == 16 and last.usage.prompt_tokens == 25
  assert warm.choices[0].token_ids == cold.choices[0].token_ids


def test_sampling_values_are_per_row_arguments_that_compile_nothing_new(server, client):
  loop = server[1].loop
  prompt = helpers.prompts([11], seed=31)[0]
  first = dict(temperature=0.7, top_p=0.9, presence_penalty=0.3, frequency_penalty=0.2, seed=1, logit_bias={"5": 2})
  first_extra = dict(top_k=20, min_p=0.05, repetition_penalty=1.1, min_tokens=2)
  later = [
      (
          dict(temperature=1.3, top_p=0.5, presence_penalty=-0.5, frequency_penalty=1.0, seed=99),
          dict(top_k=3, min_p=0.2, repetition_penalty=0.8, min_tokens=4),
      ),
      (dict(temperature=0.0, logit_bias={"7": -100, "9": 5}), {}),  # Greedy, another bias.
      ({}, {}),  # The config's sampling: greedy, no rule.
  ]

  def complete(fields, extra):
    # Each request in an epoch of its own: one that comes before the last one's epoch ends joins it in a freed slot,
    # whose window has other shapes (its insert, place and decode programs), whatever its sampling.
    t0 = time.monotonic()
    while loop.stats.epoch_running:
      assert time.monotonic() - t0 < TIMEOUT_S, "the last request's epoch did not end"
      time.sleep(0.01)
    client.completions.create(model="tiny", prompt=prompt, max_tokens=6, **fields, extra_body=extra)

  # Each kind once (sampled with every rule, greedy with a bias, the config's): this test's own warm-up, as the suite
  # may release the compiled programs between tests (tests/conftest.py).
  warm = [(first, first_extra), (dict(temperature=0.0, logit_bias={"3": 1}), {}), ({}, {})]
  for fields, extra in warm:
    complete(fields, extra)
  with compile_cache.CompileCounter() as counter:
    for fields, extra in later:
      complete(fields, extra)
  # Nothing compiled nor loaded.
  assert counter.counts() == dict(programs_compiled=0, programs_from_cache=0), counter.names()
