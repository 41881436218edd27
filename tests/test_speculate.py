"""Speculative decoding (jaxkv.speculate, jaxkv.spec_decode): the drafters and their switch without a model; the
verify layer against one-token steps, bit for bit; greedy generation with speculation gives the tokens and logits of
generation without, over placements, depths, KV dtypes, batches and meshes; what it refuses."""

import dataclasses
import re

import helpers
import jax
from jax.extend import core as jax_core
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import config as config_lib
from jaxkv import decode_attention as da
from jaxkv import engine as engine_lib
from jaxkv import layout as layout_lib
from jaxkv import model
from jaxkv import sampling
from jaxkv import spec_decode
from jaxkv import speculate
from jaxkv.kv_quant import KVFormat

NEW = 30  # Tokens per sequence: over three of the tiny config's 8-row pages past the prompts.


def test_lookup_proposes_what_followed_the_longest_most_recent_match():
  d = speculate.PromptLookup()
  assert d.propose(0, [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3], 4) == [7, 8, 1, 2]  # 3-gram, its latest occurrence.
  assert d.propose(0, [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3], 9) == [7, 8, 1, 2, 3]  # Up to the history's end.
  assert d.propose(0, [5, 6, 7, 8, 6, 7, 1, 2, 7], 3) == [1, 2, 7]  # 1-gram: no 2-gram [2, 7] occurred before.
  assert d.propose(0, [4, 4, 4], 2) == [4]
  assert d.propose(0, [1, 2, 3], 4) == [] and d.propose(0, [1], 4) == [] and d.propose(0, [1, 1], 0) == []


def test_oracle_proposes_its_right_tokens_then_wrong_ones():
  d = speculate.Oracle([[10, 11, 12, 13, 14]], [2], right=2, vocab=14)
  assert d.propose(0, [7, 7, 10], 3) == [11, 12, 0]  # One generated: truth[1:], the third wrong ((13 + 1) % 14).
  assert d.propose(0, [7, 7, 10, 11, 12, 13], 4) == [14]


def test_switch_turns_a_failing_sequence_off_and_probes_again():
  s = speculate.Switch(window=4, min_accepted=0.5, off_passes=3)
  for accepted in (1, 0, 0, 0):  # Mean 0.25 < 0.5 over the window: off.
    assert s.on(0) and s.on(1)
    s.passed(0, drafted=5, accepted=accepted)
    s.passed(1, drafted=5, accepted=2)
  assert not s.on(0) and s.on(1) and s.switched_off == 1
  for _ in range(3):
    assert not s.on(0) and s.off_passes_left(0) > 0
    s.passed(0, drafted=None, accepted=0)
  assert s.on(0) and s.off_passes_left(0) == 0
  for _ in range(10):  # Passes with no room to look count for nothing.
    s.passed(0, drafted=None, accepted=0)
  assert s.on(0) and s.switched_off == 1
  s.passed(0, drafted=5, accepted=0)  # A failing probe: off again at once, for twice as long.
  assert not s.on(0) and s.switched_off == 2 and s.off_passes_left(0) == 6
  s.idle(0, 6)
  s.passed(0, drafted=5, accepted=4)  # A probe that succeeds: the mean (0 + 0 + 0 + 4) / 4 reaches 1.
  assert s.on(0) and s.switched_off == 2


def test_switch_turns_empty_lookups_off_and_probes_less_often():
  """Lookups in a row that find nothing turn a sequence off (a pass with no room to look does not count), each probe
  that fails doubles the wait up to max_off_passes, and a window that proposes by merit resets it."""
  s = speculate.Switch(window=2, min_accepted=0.5, off_passes=3, max_off_passes=8, empty_lookups=3)
  for drafted in (None, 0, 0, None):
    s.passed(0, drafted=drafted, accepted=0)
  assert s.on(0)
  s.passed(0, drafted=0, accepted=0)  # The third empty lookup in a row.
  assert not s.on(0) and s.off_passes_left(0) == 3 and s.switched_off == 1
  for wait in (6, 8, 8):  # Probes that find nothing: off again at once, for twice as long (at most 8 passes).
    s.idle(0, s.off_passes_left(0))
    s.passed(0, drafted=0, accepted=0)
    assert s.off_passes_left(0) == wait
  s.idle(0, 8)
  s.passed(0, drafted=4, accepted=2)  # A probe that finds a draft: one verify seen, the window not full.
  s.passed(0, drafted=4, accepted=0)  # Mean 1 over the window: on by merit.
  assert s.on(0)
  s.passed(0, drafted=4, accepted=0)  # Mean 0: off, for off_passes again.
  assert s.off_passes_left(0) == 3 and s.switched_off == 5
  s.forget(0)
  assert s.on(0)


def test_the_speculator_tells_its_switch_whether_it_looked():
  """Speculator: a pass whose draft it did not ask for (no room) is no lookup, one where the drafter found nothing
  is; a switched-off row drops its pending tokens, and plain steps drop them and count its wait."""
  s = spec_decode.Speculator(speculate.PromptLookup(), 4, speculate.Switch(off_passes=3, empty_lookups=2))
  s.verified(0, 0, 0, 1, np.array([5]), sampled=False)  # No draft asked.
  assert s.draft(0, [1, 2, 3], 4) == []
  s.verified(0, 0, 0, 1, np.array([5]), sampled=False)
  assert s.switch.on(0)
  assert s.draft(0, [1, 2, 3], 4) == []
  s.verified(0, 0, 0, 1, np.array([5]), sampled=False)
  assert not s.switch.on(0) and s.idle_passes(0) == 3
  assert s.draft(1, [7, 8, 9, 7, 8], 2) == [9, 7]
  s.verified(1, 2, 2, 1, np.array([9, 7, 8]), sampled=False)  # One recorded: the verified 7, 8 head its next draft.
  assert s.pending[1] == [7, 8] and s.idle_passes(1) == 0
  s.stepped(1, 1)
  s.stepped(0, 3)
  assert 1 not in s.pending and s.switch.on(0)


def test_a_rejected_draft_s_residual_and_its_acceptance_give_back_p():
  """The standard rule for a draft d proposed with certainty: accept with p(d), else draw from p without d; the
  mixture is p, exactly (float64 over the f32 values), for every d, with top-k and temperature filtering."""
  logits = jnp.log(jnp.array([0.1, 0.2, 0.3, 0.4, 1e-3], jnp.float32))
  for temperature, top_k in ((1.0, 0), (0.7, 3)):
    x = sampling.filtered(logits, temperature, top_k, 1.0, 0.0)[0]
    p = np.asarray(jax.nn.softmax(x), np.float64)
    for d in range(4):
      accept, residual = sampling.draft_split(x, d)
      mixture = float(accept) * np.eye(5)[d] + (1 - float(accept)) * np.asarray(jax.nn.softmax(residual), np.float64)
      np.testing.assert_allclose(mixture, p, rtol=1e-6, atol=1e-7)
      assert float(accept) == np.float32(p[d]) and float(jax.nn.softmax(residual)[d]) == 0.0


def test_a_sampled_verify_draws_each_position_from_p():
  """verify_row over 20,000 keys, drafts [3, 3] for a two-position pass of p = (.1, .2, .3, .4): position 0's token
  follows p (accepted 3 in 40% of draws), position 1's too where position 0 accepted; within 4 standard errors."""
  logits = jnp.log(jnp.array([[0.1, 0.2, 0.3, 0.4]] * 3, jnp.float32))
  n = 20_000
  run = jax.jit(
      jax.vmap(
          lambda seed: sampling.verify_row(
              logits, jnp.array([3, 3]), 2, jnp.float32(1.0), 0, jnp.float32(1.0), jnp.float32(0.0), seed, 0, 5
          )
      )
  )
  tokens, accepted = map(np.asarray, run(jnp.arange(n, dtype=jnp.int32)))
  p = np.array([0.1, 0.2, 0.3, 0.4])
  tol = 4 * np.sqrt(0.25 / n)
  np.testing.assert_allclose(np.bincount(tokens[:, 0], minlength=4) / n, p, atol=tol)
  np.testing.assert_allclose(np.mean(accepted >= 1), 0.4, atol=tol)
  second = tokens[accepted >= 1, 1]
  np.testing.assert_allclose(np.bincount(second, minlength=4) / len(second), p, atol=4 * np.sqrt(0.25 / len(second)))
  assert set(np.unique(tokens[accepted == 0, 0])) <= {0, 1, 2}  # A rejected 3 is never drawn again.


@pytest.mark.parametrize("kv_dtype", ["model", "int8"])
def test_the_verify_layer_is_one_token_steps_bit_for_bit(kv_dtype):
  """decode_layer over T tokens at rows end .. end + T - 1 gives each token the output of a one-token step at its row,
  and the open page the same rows, bit for bit (CPU); rows past the page are not written."""
  cfg = helpers.tiny_config(head_dim=32).model
  fmt = KVFormat.of(cfg, kv_dtype)
  p = model.init_params(cfg, jax.random.key(0), helpers.mesh(1))["layers"][0]
  b, page_rows, a_rows, t = 2, 8, 16, 5
  rng = np.random.default_rng(0)
  xs = jnp.asarray(rng.standard_normal((b, t, cfg.d_model)), jnp.float32)
  window = fmt.pack(jnp.asarray(rng.standard_normal((2, b, cfg.num_kv_heads, a_rows, cfg.head_dim)), jnp.float32))
  page = jnp.zeros((2, b, cfg.num_kv_heads, page_rows, fmt.width), fmt.storage_dtype)
  start = jnp.array([0, 11], jnp.int32)
  layer = jax.jit(lambda x, pg, end: model.decode_layer(p, x, window, pg, start, end, cfg=cfg, kv_format=fmt))
  for end in (16, 21):  # All T rows in the page; the last two past it.
    verified, verified_page = layer(xs, page, jnp.int32(end))
    steps, step_page = [], page
    for i in range(min(t, a_rows + page_rows - end)):
      out, step_page = layer(xs[:, i], step_page, jnp.int32(end + i))
      steps.append(out)
    np.testing.assert_array_equal(np.asarray(verified[:, : len(steps)]), np.stack(steps, axis=1))
    np.testing.assert_array_equal(np.asarray(verified_page), np.asarray(step_page))


def _row_matmuls(fn, *args) -> set:
  """The lhs shapes of fn's matmuls without batch dimensions (projections, MLP, head), sub-jaxprs included."""
  shapes = set()

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "dot_general" and not eqn.params["dimension_numbers"][1][0]:
        shapes.add(tuple(eqn.invars[0].aval.shape))
      for v in eqn.params.values():
        for sub in v if isinstance(v, (tuple, list)) else (v,):
          if isinstance(sub, (jax_core.ClosedJaxpr, jax_core.Jaxpr)):
            walk(getattr(sub, "jaxpr", sub))

  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return shapes


def _fenced_row_matmuls(fn, *args) -> set[str]:
  """The code between two optimization barriers of fn's StableHLO wherever it holds a matmul without batch
  dimensions (projections, MLP, head), value names dropped: what each such call compiles from."""
  regions, lines = set(), []
  for line in jax.jit(fn).lower(*args).as_text().splitlines():
    if "optimization_barrier" not in line:
      lines.append(re.sub(r"%[\w#:.]+", "%", re.sub(r"loc\(.*\)$", "", line)).strip())
      continue
    if any("dot_general" in l and "batching_dims" not in l for l in lines):
      regions.add("\n".join(lines))
    lines = []
  return regions


@pytest.mark.parametrize("b, t", [(2, 9), (20, 2)])
def test_a_verify_pass_runs_its_rows_as_a_one_token_step_s_fenced_matmuls(b, t):
  """A verify pass of B sequences x T tokens past MIN_ROWS rows computes its projections, MLP and head in blocks of a
  one-token step's rows (max(B, MIN_ROWS)), each block the code of the step's call of them, fenced alike
  (model.on_min_rows): the same matmul shapes, so each row rounds as the step's, and the same fusions, so the GPU's
  autotuner, which picks kernels per fusion, gives both the same kernels. XLA:CPU rounds alike either way; the GPU
  did not (unblocked: other tokens on the H200; unfenced, a block's slice or a step's padding joined the fusion:
  other tokens on the H100; tools/check_serve_speculate.py)."""
  cfg = helpers.tiny_config().model
  params = model.init_params(cfg, jax.random.key(0), helpers.mesh(1))
  page = jnp.zeros((2, b, cfg.num_kv_heads, 8, cfg.head_dim), cfg.dtype)
  start, end = jnp.zeros((b,), jnp.int32), jnp.int32(3)
  layer = lambda x: model.decode_layer(params["layers"][0], x, None, page, start, end, cfg=cfg)
  step_head = lambda y: model.logits(params, y, cfg)
  verify_head = lambda y: model.logits(params, y, cfg, batch=b)
  x = jnp.ones((b, t, cfg.d_model), cfg.dtype)
  step, verify = {}, {}
  for collect in (_row_matmuls, _fenced_row_matmuls):
    step[collect] = collect(layer, x[:, 0]) | collect(step_head, x[:, 0])
    verify[collect] = collect(layer, x) | collect(verify_head, x)
  assert {s[0] for s in step[_row_matmuls]} == {max(b, model.MIN_ROWS)}
  assert verify[_row_matmuls] == step[_row_matmuls]
  assert len(step[_fenced_row_matmuls]) == 3 and verify[_fenced_row_matmuls] == step[_fenced_row_matmuls]


def _speculating(eng, mode="lookup", k=8):
  return type(eng)(
      dataclasses.replace(eng.config, speculate=config_lib.SpeculateConfig(mode=mode, k=k)),
      eng.mesh,
      eng.params,
      eng.layout,
  )


CASES = {
    # name: (tensor, engine fields, prompt lengths, oracle's right tokens)
    "device_b3": (1, dict(placement="device"), [5, 12, 1], (0, 3, 8)),
    "host_d2_t2": (2, dict(placement="host", depth=2), [7], (2,)),
    "auto_b3_t2": (2, dict(placement="auto", depth=1, group_layers=1), [5, 12, 1], (8,)),
    "host_d1_int8_b3": (1, dict(placement="host", depth=1, kv_dtype="int8"), [5, 12, 1], (3,)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_speculation_gives_the_tokens_and_logits_of_plain_greedy_decode(case):
  """With an oracle drafter of r right tokens (every verify accepts min(r, the rows left)) and the lookup drafter: the
  tokens and every step's logits of the plain run, bit for bit; drafts cross pages (8 rows: the page's last row is a
  one-token step's) and a batch advances by its smallest acceptance."""
  tensor, fields, lengths, rights = CASES[case]
  cfg = helpers.tiny_config(head_dim=32) if fields.get("kv_dtype") == "int8" else None
  eng = helpers.engine(tensor, cfg=cfg, **fields)
  if fields["placement"] == "auto":  # Two of the six layers resident, four streamed.
    eng = helpers.with_kv(eng, device_budget_gib=2.5 * helpers.layer_bytes(eng, len(lengths)) / 2**30)
  prompts = helpers.prompts(lengths)
  plain = eng.generate(prompts, NEW, keep_logits=True)
  assert "speculate" not in plain.transport
  for right in rights:
    drafter = speculate.Oracle(plain.tokens, lengths, right, eng.config.model.vocab_size)
    res = eng.generate(prompts, NEW, keep_logits=True, drafter=drafter)
    assert res.tokens == plain.tokens, right
    np.testing.assert_array_equal(res.logits, plain.logits)
    assert res.logits_sha256 == plain.logits_sha256
    s = res.transport["speculate"]
    assert s["tokens"] == NEW - 1 and s["passes"] == res.transport["decode_passes"], s
    assert s["verify_passes"] > 0 and sum(s["accepted_histogram"][min(right, 6) + 1 :]) == 0, s
    if right == 0:
      assert s["accepted"] == 0 and s["passes"] == NEW - 1
    else:
      assert s["accepted"] > 0 and s["tokens_per_pass"] > 1.5, s
  if fields["placement"] == "auto":
    assert res.transport["residency"]["resident_layers"] == 2
  res = _speculating(eng).generate(prompts, NEW, keep_logits=True)
  assert res.tokens == plain.tokens
  np.testing.assert_array_equal(res.logits, plain.logits)
  assert res.transport["speculate"]["passes"] == res.transport["decode_passes"]


class _NoDrafts:

  def propose(self, b, history, k):
    del b, history, k
    return []


def test_sampled_speculation_keys_each_token_by_its_index():
  """Sampling (temperature 0.8, top-k 50): without drafts each pass samples the plain run's tokens with the plain
  run's keys, bit for bit; at temperature 1e-4 (p one-hot in f32) the plain run's tokens as drafts are all accepted
  and give its tokens and logits, through the sampled verify."""
  lengths = [5, 12, 1]
  prompts = helpers.prompts(lengths)
  eng = helpers.engine(1, sampling=config_lib.SamplingConfig(temperature=0.8, top_k=50))
  plain = eng.generate(prompts, NEW, keep_logits=True, seed=3)
  res = eng.generate(prompts, NEW, keep_logits=True, seed=3, drafter=_NoDrafts())
  assert res.tokens == plain.tokens
  np.testing.assert_array_equal(res.logits, plain.logits)
  eng = helpers.engine(1, sampling=config_lib.SamplingConfig(temperature=1e-4))
  plain = eng.generate(prompts, NEW, keep_logits=True, seed=3)
  res = eng.generate(prompts, NEW, keep_logits=True, seed=3, drafter=speculate.Oracle(plain.tokens, lengths, 8, 256))
  assert res.tokens == plain.tokens
  np.testing.assert_array_equal(res.logits, plain.logits)
  assert res.transport["speculate"]["tokens_per_pass"] > 2.5, res.transport["speculate"]


def test_speculation_in_split_mode_layer():
  """Two stages (layers 0-2 and 3-5 on a device each): the embedding on the first stage, the verify head on the last,
  the hidden state crossing between them; the plain run's tokens and logits."""
  mesh = helpers.mesh(2)
  layout = layout_lib.make_layout("layer", mesh, 6)
  params = model.init_params(helpers.tiny_config().model, jax.random.key(0), mesh, layout)
  eng = engine_lib.Engine(helpers.engine(1).config, mesh, params, layout)
  lengths = [5, 12, 1]
  prompts = helpers.prompts(lengths)
  plain = eng.generate(prompts, NEW, keep_logits=True)
  res = eng.generate(prompts, NEW, keep_logits=True, drafter=speculate.Oracle(plain.tokens, lengths, 3, 256))
  assert res.tokens == plain.tokens
  np.testing.assert_array_equal(res.logits, plain.logits)
  assert res.transport["speculate"]["accepted_histogram"][3] > 0


def test_a_model_that_repeats_itself_gets_drafts_accepted_by_lookup():
  """The tiny random model's greedy output falls into a loop: the lookup drafter's drafts are accepted there, and
  the tokens stay the plain run's."""
  eng = helpers.engine(1, capacity=128)
  prompts = [[3, 1, 4, 1, 5, 9, 2, 6] * 4]
  plain = eng.generate(prompts, 80)
  res = _speculating(eng, k=4).generate(prompts, 80)
  assert res.tokens == plain.tokens and res.logits_sha256 == plain.logits_sha256
  s = res.transport["speculate"]
  assert s["accepted"] > 0 and s["passes"] < 79, s


def test_drafts_that_fail_switch_themselves_off_into_plain_steps():
  """A drafter that is always wrong, its switch off after 2 verifies for 5 passes: the off passes run as the plain
  loop's steps (read back behind), each probe verifies once and waits twice as long, and the tokens and logits stay
  the plain run's."""
  eng = helpers.engine(1)
  prompts = helpers.prompts([5, 12, 1])
  plain = eng.generate(prompts, NEW, keep_logits=True)
  wrong = speculate.Oracle(plain.tokens, [len(p) for p in prompts], 0, eng.config.model.vocab_size)
  switch = speculate.Switch(window=2, min_accepted=0.5, off_passes=5)
  res = eng.generate(prompts, NEW, keep_logits=True, drafter=spec_decode.Speculator(wrong, 8, switch))
  assert res.tokens == plain.tokens
  np.testing.assert_array_equal(res.logits, plain.logits)
  s = res.transport["speculate"]
  # The three sequences switch together: 2 verifies, 5 plain steps; a probe, 10 plain steps; a probe, the last 10.
  assert s["switched_off"] == 3 * 3 and s["verify_passes"] == 4 and s["passes"] == NEW - 1, s
  assert s["accepted"] == 0 and s["accepted_histogram"][0] == 3 * 4, s


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(sampling=config_lib.SamplingConfig(presence_penalty=0.5)), "--speculate=lookup verifies drafts without"),
        (dict(sampling=config_lib.SamplingConfig(repetition_penalty=1.1)), "no presence, frequency or repetition"),
        (dict(engine=config_lib.EngineConfig(decode_attention="legacy")), "not legacy"),
    ],
)
def test_speculation_refuses_what_it_cannot_verify(fields, match):
  with pytest.raises(ValueError, match=match):
    dataclasses.replace(helpers.tiny_config(), speculate=config_lib.SpeculateConfig(mode="lookup"), **fields)


CHUNKED_LENGTHS = (800, 790)
CHUNKED_ZERO_ROWS = 768  # A synthetic context (tests/test_chunked.py): windows of 784-832 rows, 4 chunks of S rows.


def test_speculation_through_chunked_delivery_gives_the_device_placements_bits():
  """Windows delivered in chunks of S = 256 rows (jaxkv.chunked), each token of a verify pass with its own leaves in
  each chunk: the tokens and logits of plain decode with chunks and of the device placement, bit for bit."""
  kw = dict(capacity=832, chunk=256, group_layers=1)
  device = helpers.engine(1, placement="device", **kw)
  eng = helpers.engine(1, placement="host", depth=2, **kw)
  row = helpers.layer_bytes(eng, len(CHUNKED_LENGTHS)) // (832 + 8)  # Rows bound: capacity plus a block.
  eng = helpers.with_kv(eng, delivery_chunk_mib=da.LEAF_ROWS * row / 2**20)
  prompts = helpers.prompts(CHUNKED_LENGTHS)
  run = lambda e, **d: e.generate(prompts, NEW, keep_logits=True, zero_rows=CHUNKED_ZERO_ROWS, **d)
  reference, plain = run(device), run(eng)
  assert plain.transport["delivery_chunk_rows"] == da.LEAF_ROWS
  np.testing.assert_array_equal(plain.logits, reference.logits)
  res = run(eng, drafter=speculate.Oracle(reference.tokens, CHUNKED_LENGTHS, 3, eng.config.model.vocab_size))
  assert res.tokens == reference.tokens
  np.testing.assert_array_equal(res.logits, reference.logits)
  assert res.logits_sha256 == reference.logits_sha256
  s = res.transport["speculate"]
  assert s["accepted_histogram"][3] > 0 and s["tokens_per_pass"] > 1.5, s


def test_speculation_with_host_attention_gives_the_tokens_of_plain_decode():
  """Host attention on a quarter of each window (the kernel attends a verify pass's T tokens as T * G query heads),
  the tail delivered whole and in chunks of S rows: the tokens of plain decode with host attention."""
  eng = helpers.engine(
      1, placement="host", depth=2, capacity=832, chunk=256, host_attention=True, host_attention_fraction=0.25
  )
  row = helpers.layer_bytes(eng, len(CHUNKED_LENGTHS)) // (832 + 8)
  prompts = helpers.prompts(CHUNKED_LENGTHS)
  run = lambda e, **d: e.generate(prompts, NEW, keep_logits=True, zero_rows=CHUNKED_ZERO_ROWS, **d)
  plain = run(eng)
  assert plain.transport["host_attention"]["wait"] == "thread"
  for mib in (0.0, da.LEAF_ROWS * row / 2**20):
    e = helpers.with_kv(eng, delivery_chunk_mib=mib)
    res = run(e, drafter=speculate.Oracle(plain.tokens, CHUNKED_LENGTHS, 3, eng.config.model.vocab_size))
    assert res.tokens == plain.tokens, mib
    np.testing.assert_array_equal(res.logits, plain.logits)  # XLA:CPU, the tiny model: bit for bit (design.md).
    s = res.transport["speculate"]
    assert s["accepted_histogram"][3] > 0 and s["tokens_per_pass"] > 1.5, s
    assert res.transport["delivery_chunk_rows"] == (0 if mib == 0 else da.LEAF_ROWS)
