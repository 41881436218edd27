"""Speculative decoding in the server (--speculate=lookup: jaxkv.serving.server's verify passes) on the tiny model:
three requests of different lengths in flight together over HTTP (one streamed, one joining mid-run) get the tokens
and log-probabilities of a server without it, in the device and host placements; Server.serve gives each request's
tokens and logits hash; the metrics count each request's drafts exactly (the drafter replayed over its tokens); a
stop token ends a request at it; a prompt from the prefix cache, or from a saved slot restored, gets the same tokens;
a client that goes away frees its slot; what a verify pass cannot apply is a 400 naming the field."""

import asyncio
import dataclasses
import json
import time

import helpers
import pytest

for _extra in ("fastapi", "uvicorn", "prometheus_client", "httpx"):
  pytest.importorskip(_extra, reason="the serve extra: pip install -e '.[serve]'")

# pylint: disable=g-import-not-at-top,g-bad-import-order
import httpx
import serve_helpers

from jaxkv import config as config_lib
from jaxkv import serving
from jaxkv import speculate
from jaxkv.serving.requests import Request

# pylint: enable=g-import-not-at-top,g-bad-import-order

K = 4  # Draft tokens per pass.
TIMEOUT_S = 300.0
LOOP = [7, 7, 8, 8] * 5  # The tiny model's greedy output falls into loops: lookup drafts are accepted.
# (prompt, max_tokens): the first streamed, the third arriving once it streams (it waits for a slot to free).
REQUESTS = ((LOOP, 40), (helpers.prompts([12], seed=5)[0], 44), ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3], 30))
DRAFTED, ACCEPTED = "jaxkv_spec_drafted_tokens_total", "jaxkv_spec_accepted_tokens_total"


def _speculating(eng):
  spec = config_lib.SpeculateConfig(mode="lookup", k=K)
  return type(eng)(dataclasses.replace(eng.config, speculate=spec), eng.mesh, eng.params, eng.layout)


async def _three(url: str) -> list[tuple[list[int], list]]:
  """REQUESTS in flight together, each asking for 2 top logprobs; returns each one's (token ids, logprobs)."""
  streaming = asyncio.Event()

  async def complete(http, prompt, n):
    await streaming.wait() if prompt is REQUESTS[2][0] else None
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 2}
    r = await http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["token_ids"], [choice["logprobs"]]

  async def stream(http, prompt, n):
    ids, logprobs = [], []
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 2, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as r:
      async for line in r.aiter_lines():
        if line.startswith("data: {"):
          choice = json.loads(line[6:])["choices"][0]
          # Each token its own event, as one-token steps send them; the last event ends it.
          assert len(choice["token_ids"]) == (choice["finish_reason"] is None), choice
          ids += choice["token_ids"]
          logprobs.append(choice["logprobs"])
          if len(ids) == 3:
            streaming.set()
    return ids, logprobs

  async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S) as http:
    calls = [stream(http, *REQUESTS[0])] + [complete(http, *r) for r in REQUESTS[1:]]
    return await asyncio.wait_for(asyncio.gather(*calls), TIMEOUT_S)


def _served(eng) -> tuple[list, tuple[float, float, float]]:
  """REQUESTS through a server of `eng` on 2 slots: _three's answers, then the drafted and accepted tokens and the
  slot insertions."""
  with serve_helpers.running(eng, parallel=2) as (url, _):
    got = asyncio.run(_three(url))
    m = serve_helpers.metrics(url)
  return got, (m[DRAFTED], m[ACCEPTED], m["jaxkv_slot_insertions_total"])


@pytest.fixture(scope="module")
def plain():
  """A server without speculation (the device placement: every placement gives the same bits)."""
  got, (drafted, accepted, insertions) = _served(helpers.engine(1))
  assert [len(ids) for ids, _ in got] == [n for _, n in REQUESTS]
  assert drafted == accepted == 0 and insertions >= 1  # The third (at least) joined a running batch.
  return got


@pytest.mark.parametrize("placement", ["device", "host"])
def test_concurrent_requests_get_the_tokens_and_logprobs_of_plain_decode(plain, placement):
  got, (drafted, accepted, insertions) = _served(_speculating(helpers.engine(1, placement=placement)))
  assert got == plain
  assert drafted >= accepted > 10 and insertions >= 1


def test_serve_gives_each_request_s_tokens_and_logits_hash():
  """Server.serve (hashed records): every request's tokens and logits hash, a sampled one (temperature 1e-4: p
  one-hot, its drafts verified by the rejection rule) among them; the third request enters a running batch."""
  eng = helpers.engine(1)
  cold = config_lib.SamplingConfig(temperature=1e-4)
  requests = [Request(tuple(p), n, seed=1, sampling=cold if i == 1 else None) for i, (p, n) in enumerate(REQUESTS)]
  plain = serving.Server(eng, 2).serve(requests)
  spec = serving.Server(_speculating(eng), 2).serve(requests)
  assert [r.tokens for r in spec.results] == [r.tokens for r in plain.results]
  assert [r.logits_sha256 for r in spec.results] == [r.logits_sha256 for r in plain.results]
  assert spec.transcript_sha256 == plain.transcript_sha256 and spec.transport["insertions"] == 1
  assert spec.transport["speculate"]["accepted"] > 10 and "speculate" not in plain.transport, spec.transport


def _replay(prompt: list[int], tokens: list[int], block: int) -> tuple[int, int, str]:
  """What a request alone in a fresh epoch drafts and accepts, replayed on the host: its greedy tokens against the
  lookup drafter and its switch (alone, every acceptance is the batch's: nothing is left pending); and its
  passes, "v" a verify pass (its switch on), "p" a plain step (off)."""
  lookup, switch = speculate.PromptLookup(), speculate.Switch()
  drafted = accepted = 0
  passes = ""
  got, end = 1, len(prompt)  # The prefill gives its first token, which the first pass writes at row len(prompt).
  while got < len(tokens):
    cap = min(K, block - 2 - end % block, len(tokens) - got - 1)
    looks = cap > 0 and switch.on(0)
    passes += "v" if switch.on(0) else "p"
    draft = lookup.propose(0, prompt + tokens[:got], cap) if looks else []
    a = 0
    while a < len(draft) and draft[a] == tokens[got + a]:
      a += 1
    drafted, accepted = drafted + len(draft), accepted + a
    switch.passed(0, len(draft) if looks else None, a)
    got, end = got + a + 1, end + a + 1
  return drafted, accepted, passes


def test_drafts_that_fail_turn_into_plain_steps_with_the_tokens_of_plain_decode():
  """Random prompts: lookups that find nothing (or drafts that fail) switch the slots off into the plain loop's steps,
  run ahead as without speculation, and a slot that probes again goes back to verify passes mid-request; the tokens
  and logits hashes are plain decode's, and a request alone passes exactly as its replayed switch says."""
  eng = helpers.engine(1)
  prompts = helpers.prompts([9, 17, 13], seed=15)  # The first one's drafts all fail.
  requests = [Request(tuple(p), 100, seed=i) for i, p in enumerate(prompts)]
  plain = serving.Server(eng, 2).serve(requests)
  spec_eng = _speculating(eng)
  spec = serving.Server(spec_eng, 2).serve(requests)
  assert [r.tokens for r in spec.results] == [r.tokens for r in plain.results]
  assert [r.logits_sha256 for r in spec.results] == [r.logits_sha256 for r in plain.results]
  s = spec.transport["speculate"]
  assert s["plain_steps"] > 0 and s["verify_passes"] > 0, s
  alone = serving.Server(spec_eng, 1).serve(requests[:1])
  assert alone.results[0].tokens == plain.results[0].tokens
  drafted, accepted, passes = _replay(list(prompts[0]), plain.results[0].tokens, eng.config.kv.block)
  a = alone.transport["speculate"]
  assert (a["drafted"], a["accepted"], a["verify_passes"], a["plain_steps"]) == (
      drafted,
      accepted,
      passes.count("v"),
      passes.count("p"),
  ), passes
  assert a["accepted"] == 0 and "pv" in passes, passes  # A probe: plain steps, then a verify pass again.


@pytest.fixture(scope="module")
def speculating(tmp_path_factory):
  eng = _speculating(helpers.engine(1))
  slots = str(tmp_path_factory.mktemp("slots"))
  with serve_helpers.running(eng, parallel=2, prefix_cache_bytes=2**24, slot_save_path=slots) as (url, _):
    yield url, eng


def test_the_metrics_count_each_request_s_drafts(speculating):
  url, eng = speculating
  accepted = []
  for prompt, n in REQUESTS:
    before = serve_helpers.metrics(url)
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": n}, timeout=TIMEOUT_S)
    tokens = r.json()["choices"][0]["token_ids"]
    after = serve_helpers.metrics(url)
    delta = after[DRAFTED] - before[DRAFTED], after[ACCEPTED] - before[ACCEPTED]
    assert delta == _replay(prompt, tokens, eng.config.kv.block)[:2], (prompt, tokens)
    accepted.append(delta[1])
  assert accepted[0] > 10, accepted  # The loop's drafts are accepted.


def test_a_stop_token_ends_a_request_at_it(speculating):
  url, _ = speculating
  ask = lambda **kw: httpx.post(url + "/v1/completions", json=dict(prompt=LOOP, max_tokens=40, **kw), timeout=TIMEOUT_S)
  tokens = ask().json()["choices"][0]["token_ids"]
  stop = tokens[20]
  choice = ask(stop_token_ids=[stop]).json()["choices"][0]
  assert choice["token_ids"] == tokens[: tokens.index(stop) + 1] and choice["finish_reason"] == "stop"


def test_what_a_verify_pass_cannot_apply_is_a_400_naming_the_field(speculating):
  url, _ = speculating
  for field, value in (
      ("presence_penalty", 0.5),
      ("frequency_penalty", 0.5),
      ("repetition_penalty", 1.1),
      ("logit_bias", {"5": 2.0}),
      ("guided_regex", "a+"),
  ):
    r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2], field: value}, timeout=TIMEOUT_S)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.startswith(f"{field}: --speculate=lookup verifies drafts without"), message
    assert "--speculate=off" in message
  r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 3}, timeout=TIMEOUT_S)
  assert len(r.json()["choices"][0]["token_ids"]) == 3


def test_a_prompt_from_the_prefix_cache_gets_the_same_tokens(speculating):
  url, _ = speculating
  body = {"prompt": LOOP + [5], "max_tokens": 20}
  first, again = (httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT_S).json() for _ in range(2))
  assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 16  # Its first prefill chunk.
  assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]


def test_a_client_that_disconnects_mid_stream_frees_its_slot(speculating):
  url, _ = speculating
  ended = serve_helpers.finished(url)[0]
  body = {"prompt": LOOP, "max_tokens": 100, "stream": True}
  with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT_S) as r:
    events, lines = 0, r.iter_lines()  # Held: a dropped iterator closes the connection.
    for line in lines:
      events += line.startswith("data:")
      if events == 3:
        break
  t0 = time.monotonic()
  while serve_helpers.finished(url)[0]["cancelled"] == ended["cancelled"]:
    assert time.monotonic() - t0 < TIMEOUT_S, "the cancellation"
    time.sleep(0.05)
  assert serve_helpers.one_more(ended, serve_helpers.finished(url)[0], "cancelled")
  assert serve_helpers.metrics(url)["jaxkv_slots_busy"] == 0


def test_a_restored_slot_s_next_turn_gets_the_tokens_of_a_cold_one(speculating):
  url, _ = speculating
  post = lambda path, **kw: httpx.post(url + path, timeout=TIMEOUT_S, **kw).json()
  ask = lambda prompt: post("/v1/completions", json={"prompt": prompt, "max_tokens": 12})
  prompt = [9, 9, 4, 4] * 6
  conversation = prompt + ask(prompt)["choices"][0]["token_ids"]  # Alone: slot 0.
  assert post("/slots/0?action=save", json={"filename": "s.bin"})["n_saved"] == len(conversation)
  post("/slots/0?action=erase")
  cold = ask(conversation + [5])
  assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
  post("/slots/0?action=erase")
  assert post("/slots/0?action=restore", json={"filename": "s.bin"})["n_restored"] == len(conversation)
  warm = ask(conversation + [5])
  assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 32  # Its whole blocks (engine.prefill_chunk).
  assert warm["choices"][0]["token_ids"] == cold["choices"][0]["token_ids"]
