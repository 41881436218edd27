"""Slots serving a queue: slot reuse, request order, independence from the slot and the neighbours, and the
same transcript for every delivery mode."""

import dataclasses
import threading
import time

import helpers
import numpy as np
import pytest

from jaxkv.apps import generate as generate_app
from jaxkv import sampling
from jaxkv import serving
from jaxkv.config import SamplingConfig

# Lengths around the block (8) and the prefill chunk (16) of the tiny config, up to 40 rows.
LENGTHS = (9, 1, 8, 17, 30, 5, 12, 7, 40, 3, 16, 25, 2, 33, 11, 6)


def requests(seed=1):
  news = np.random.default_rng(seed).integers(2, 14, size=len(LENGTHS)).tolist()
  return [serving.Request(tuple(p), n, seed=i) for i, (p, n) in enumerate(zip(helpers.prompts(LENGTHS, seed=3), news))]


@pytest.fixture(scope="module")
def served():
  return serving.Server(helpers.engine(2, placement="host", depth=1), 4).serve(requests())


def test_results_come_back_in_request_order_with_slots_reused(served):
  reqs = requests()
  assert len(served.results) == len(reqs)
  for req, res in zip(reqs, served.results):
    assert len(res.tokens) == req.max_new_tokens  # No EOS: each runs to its own limit.
    assert 0 <= res.slot < 4
  places = [(r.epoch, r.slot) for r in served.results]
  assert served.transport["insertions"] >= 4 and len(set(places)) < len(places)  # Slots were reused.
  assert {r.slot for r in served.results} == {0, 1, 2, 3}
  assert served.timing["tokens"] == sum(r.max_new_tokens for r in reqs)
  # Each first token is timed from the serve's start: the first 4 took their slots at once, the rest later.
  ttft = [r.ttft_s for r in served.results]
  assert all(0 < t < served.timing["wall_s"] for t in ttft) and max(ttft[:4]) < min(ttft[4:])


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_request_among_others_decodes_as_alone(temperature, served):
  sampling = SamplingConfig(temperature=temperature, top_k=50)
  reqs = requests()
  among = served if temperature == 0.0 else None
  if among is None:
    among = serving.Server(helpers.engine(2, placement="host", depth=1, sampling=sampling), 4).serve(reqs)
  alone_engine = helpers.engine(2, placement="device", sampling=sampling)
  for i in (0, 4, 8, 13, 15):  # First epoch, reused slots, later epochs.
    alone = serving.Server(alone_engine, 1).serve([reqs[i]]).results[0]
    assert alone.first_row == 0 and among.results[i].tokens == alone.tokens, i
  if temperature == 0.0:  # Greedy also matches the batched generate.
    for i in (3, 9):
      assert alone_engine.generate([list(reqs[i].prompt)], reqs[i].max_new_tokens).tokens[0] == among.results[i].tokens


def test_a_seeded_request_samples_what_generate_samples_with_its_seed():
  """One key derivation for generate and the server: a request of seed s samples, token by token and logit by logit,
  what generate's sequence 0 samples with seed s (its stream 0)."""
  eng = helpers.engine(2, placement="device", sampling=SamplingConfig(temperature=0.8, top_k=50, top_p=0.95))
  reqs = requests()
  for i in (0, 8):
    served = serving.Server(eng, 2).serve([reqs[i]]).results[0]
    generated = eng.generate([list(reqs[i].prompt)], reqs[i].max_new_tokens, seed=reqs[i].seed)
    assert (generated.tokens[0], generated.logits_sha256) == (served.tokens, served.logits_sha256), i


# The tiny model's 8 KV heads all on one device, and one a device; tests/test_transport.py gates the delivery modes on
# every mesh.
@pytest.mark.parametrize("tensor", [1, 8])
def test_every_delivery_mode_gives_the_same_transcript(tensor):
  reqs = requests(seed=2)[:10]
  hashes = set()
  for placement, depth in (("device", 1), ("host", 0), ("host", 1), ("host", 4)):
    out = serving.Server(helpers.engine(tensor, placement=placement, depth=depth), 3).serve(reqs)
    assert out.transport["insertions"] >= 1
    hashes.add(out.transcript_sha256)
  assert len(hashes) == 1


def test_eos_frees_the_slot_early():
  eng = helpers.engine(1, placement="host", depth=2)
  reqs = requests()[:8]
  first = serving.Server(eng, 2).serve(reqs)
  eos = first.results[1].tokens[1]  # Request 1's second token becomes the EOS.
  cfg = dataclasses.replace(eng.config, sampling=SamplingConfig(eos_id=eos))
  out = serving.Server(helpers.engine(1, placement="host", depth=2, cfg=cfg), 2).serve(reqs)
  assert out.results[1].tokens == first.results[1].tokens[:2]
  for a, b in zip(first.results, out.results):
    cut = a.tokens.index(eos) + 1 if eos in a.tokens else len(a.tokens)
    assert b.tokens == a.tokens[:cut]


def test_a_request_that_cannot_run_is_rejected_alone():
  eng = helpers.engine(1)
  reqs = [serving.Request((1, 2), 3), serving.Request((), 2), serving.Request((1,) * 120, 20), serving.Request((3,), 2)]
  out = serving.Server(eng, 2).serve(reqs)
  assert [r.error is None for r in out.results] == [True, False, False, True]
  assert out.results[1].error == "its prompt is empty" and out.results[1].tokens == [] and out.results[1].slot == -1
  assert out.results[1].ttft_s is None and out.results[0].ttft_s > 0
  assert "needs 139 cache rows, more than the capacity 128" in out.results[2].error
  alone = serving.Server(eng, 2).serve([reqs[0], reqs[3]]).results
  assert [r.tokens for r in alone] == [out.results[0].tokens, out.results[3].tokens]
  assert [len(r.tokens) for r in alone] == [3, 2]


def test_bad_requests_are_clear_errors():
  server = serving.Server(helpers.engine(1), 2)
  with pytest.raises(ValueError, match="no requests"):
    server.serve([])
  with pytest.raises(ValueError, match="every request was rejected; request 0: .*capacity"):
    server.serve([serving.Request((1,) * 120, 20)])
  with pytest.raises(ValueError, match="parallel must be >= 1"):
    serving.Server(helpers.engine(1), 0)


def test_every_serving_run_has_the_fields_its_report_prints(served):
  reqs = requests()
  runs = {
      "reuse": (served, None),
      "one on 8 slots": (serving.Server(helpers.engine(2), 8).serve(reqs[:1]), 0),
      "as many as slots": (serving.Server(helpers.engine(2, placement="host", depth=1), 4).serve(reqs[:4]), 0),
  }
  for name, (res, reuses) in runs.items():
    line = generate_app.served_summary(res.transport, res.timing)
    assert set(serving.TOTALS) <= res.transport.keys(), name
    if reuses is not None:
      assert res.transport["insertions"] == reuses and f"{reuses} slot reuses" in line, (name, line)


def test_rules_and_penalties_apply_per_request_and_a_shaped_request_among_others_decodes_as_alone(served):
  """Requests with a logit bias, held end ids, penalties and min-p, served among plain ones: each gets what it gets
  alone, the plain ones what they got unshaped, and the rules hold: a -100 bias on the first greedy token keeps it
  out, +100 on another makes it every token, a held id never comes before min_tokens."""
  reqs = requests()
  plain = [served.results[i].tokens for i in range(len(reqs))]
  banned = plain[0][0]
  shaped = {
      0: serving.Request(reqs[0].prompt, reqs[0].max_new_tokens, rules=sampling.Rules({banned: -100.0})),
      1: serving.Request(reqs[1].prompt, 6, rules=sampling.Rules({7: 100.0})),
      2: serving.Request(
          reqs[2].prompt, reqs[2].max_new_tokens, rules=sampling.Rules(min_tokens=8, held=tuple(plain[2][:3]))
      ),
      3: dataclasses.replace(reqs[3], sampling=SamplingConfig(frequency_penalty=2.0, presence_penalty=0.5)),
      6: dataclasses.replace(reqs[6], sampling=SamplingConfig(temperature=1.0, min_p=0.3, repetition_penalty=1.5)),
  }
  mixed = [shaped.get(i, r) for i, r in enumerate(reqs)]
  eng = helpers.engine(2, placement="host", depth=1)
  out = serving.Server(eng, 4).serve(mixed)
  alone = helpers.engine(2, placement="device")
  for i in shaped:
    assert out.results[i].tokens == serving.Server(alone, 1).serve([mixed[i]]).results[0].tokens, i
  for i in set(range(len(reqs))) - set(shaped):
    assert out.results[i].tokens == plain[i], i
  assert banned not in out.results[0].tokens and out.results[1].tokens == [7] * 6
  assert not set(out.results[2].tokens[:8]) & set(plain[2][:3])
  assert out.results[3].tokens != plain[3]  # Its plain tokens repeat one.


class _EvenThenFive:
  """A grammar (jaxkv.serving.grammar.Grammar's interface) of the tests: even tokens, then from the fourth on only 5;
  it allows the next tokens from the ones it consumed, so a mask a step late would let an even fourth token through."""

  def __init__(self, vocab: int):
    self.vocab, self.seen = vocab, []

  def allowed(self) -> np.ndarray:
    allowed = np.zeros(self.vocab, bool)
    if len(self.seen) < 3:
      allowed[::2] = True
    else:
      allowed[5] = True
    return allowed

  def consume(self, token: int) -> None:
    self.seen.append(token)


def test_a_grammar_masks_its_row_only_and_takes_every_token_before_the_next_step(served):
  """Requests under a grammar among plain ones (greedy and sampled): their tokens follow it, as they do alone, every
  token consumed; the plain ones keep their tokens and logits hashes bit for bit."""
  reqs, vocab = requests(), helpers.tiny_config().model.vocab_size
  under = {
      1: lambda: dataclasses.replace(reqs[1], max_new_tokens=6, grammar=_EvenThenFive(vocab)),
      5: lambda: dataclasses.replace(
          reqs[5], max_new_tokens=7, sampling=SamplingConfig(temperature=1.0), grammar=_EvenThenFive(vocab)
      ),
  }
  mixed = [under[i]() if i in under else r for i, r in enumerate(reqs)]
  out = serving.Server(helpers.engine(2, placement="host", depth=1), 4).serve(mixed)
  alone = helpers.engine(2, placement="device")
  for i in under:
    tokens = out.results[i].tokens
    assert all(t % 2 == 0 for t in tokens[:3]) and tokens[3:] == [5] * (len(tokens) - 3), (i, tokens)
    assert mixed[i].grammar.seen == tokens
    assert serving.Server(alone, 1).serve([under[i]()]).results[0].tokens == tokens, i
  for i in set(range(len(reqs))) - set(under):
    assert (out.results[i].tokens, out.results[i].logits_sha256) == (
        served.results[i].tokens,
        served.results[i].logits_sha256,
    ), i


def test_requests_without_max_new_tokens_share_an_epoch_and_end_at_the_capacity():
  """Without max_new_tokens a request reserves no rows: the first four take the four slots at once (with the capacity
  reserved, each would fit only at an end equal to its own prompt length), and each decodes to the capacity, its
  tokens those of a generate of as many."""
  eng = helpers.engine(2, placement="host", depth=1, capacity=64)
  capacity = eng.config.engine.capacity
  prompts = helpers.prompts([9, 30, 17, 5], seed=4)
  res = serving.Server(eng, 4).serve([serving.Request(tuple(p), None, seed=i) for i, p in enumerate(prompts)])
  assert [r.epoch for r in res.results] == [0] * 4 and sorted(r.slot for r in res.results) == [0, 1, 2, 3]
  end = max(len(p) for p in prompts)  # The epoch's first requests enter at its longest prompt.
  want = helpers.engine(2, placement="device").generate(prompts, capacity - end + 1).tokens
  assert [r.tokens for r in res.results] == want and all(len(t) == capacity - end + 1 for t in want)


def test_a_loop_stopped_while_its_epoch_runs_ends_with_the_epoch():
  """stop() while a request decodes: the request runs to its end, then the loop's thread ends (stop's wake-up is
  taken inside the epoch; the loop must not then wait for another). The request's first token holds the engine
  thread until stop() has woken the loop."""
  loop = serving.ServingLoop(serving.Server(helpers.engine(1), 1), 4).start()
  first, release, done, out = threading.Event(), threading.Event(), threading.Event(), []

  def on_token(token, _):
    out.append(token)
    if len(out) == 1:
      first.set()
      assert release.wait(60)

  loop.submit(serving.Request(tuple(helpers.prompts([5], seed=2)[0]), 20), on_token, lambda *_: done.set())
  assert first.wait(120)
  ended = []
  stopper = threading.Thread(target=lambda: ended.append(loop.stop(60)))
  stopper.start()
  while loop.alive:  # stop() has set closing; its wake-up follows at once.
    time.sleep(0.01)
  time.sleep(0.1)
  release.set()
  stopper.join(120)
  assert ended == [True] and done.is_set() and len(out) == 20
