"""The decoder against its plain reference, across meshes, batches and prefill chunking."""

import dataclasses
from unittest import mock

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import config as config_lib
from jaxkv import model
from jaxkv import reference
from jaxkv import sampling

LENGTHS = (5, 12, 1, 9)
NEW = 12


@pytest.fixture(scope="module")
def one_device_run():
  return helpers.engine(1).generate(helpers.prompts(LENGTHS), NEW, keep_logits=True)


@pytest.mark.parametrize("tensor", helpers.MESH_SIZES[1:])
def test_sharded_logits_match_one_device(tensor, one_device_run):
  res = helpers.engine(tensor).generate(helpers.prompts(LENGTHS), NEW, keep_logits=True)
  np.testing.assert_allclose(res.logits, one_device_run.logits, rtol=1e-5, atol=1e-5)
  assert res.tokens == one_device_run.tokens


def test_params_are_sharded_by_heads_and_columns():
  p = helpers.params(4)["layers"][0]
  cfg = helpers.tiny_config().model
  shard = lambda a: a.addressable_shards[0].data.shape
  assert shard(p["wq"]) == (cfg.d_model, cfg.num_heads // 4, cfg.head_dim)
  assert shard(p["wk"]) == (cfg.d_model, cfg.num_kv_heads // 4, cfg.head_dim)
  assert shard(p["wo"]) == (cfg.num_heads // 4, cfg.head_dim, cfg.d_model)
  assert shard(p["w_gate"]) == (cfg.d_model, cfg.mlp_dim // 4)
  assert shard(p["w_down"]) == (cfg.mlp_dim // 4, cfg.d_model)


@pytest.mark.parametrize("placement", ["device", "host"])
def test_decode_logits_match_full_recompute(placement, one_device_run):
  """Every step's logits equal the no-cache reference over prompt + generated tokens."""
  res = helpers.engine(1, placement=placement).generate(helpers.prompts(LENGTHS), NEW, keep_logits=True)
  np.testing.assert_array_equal(res.logits, one_device_run.logits)
  cfg = helpers.tiny_config().model
  for b, prompt in enumerate(helpers.prompts(LENGTHS)):
    seq = np.array([prompt + res.tokens[b][:-1]], np.int32)
    ref = np.asarray(reference.forward(helpers.params(1), seq, cfg))[0, len(prompt) - 1 :]
    np.testing.assert_allclose(res.logits[:, b], ref, rtol=1e-5, atol=2e-5)


def test_each_sequence_of_a_batch_matches_it_alone(one_device_run):
  for b, prompt in enumerate(helpers.prompts(LENGTHS)):
    alone = helpers.engine(1).generate([prompt], NEW, keep_logits=True)
    assert alone.tokens[0] == one_device_run.tokens[b]
    np.testing.assert_allclose(alone.logits[:, 0], one_device_run.logits[:, b], rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("chunk", [8, 24])
def test_chunked_prefill_matches_one_shot(chunk, one_device_run):
  one_shot = helpers.engine(1, chunk=64).generate(helpers.prompts(LENGTHS), NEW, keep_logits=True)
  chunked = helpers.engine(1, chunk=chunk).generate(helpers.prompts(LENGTHS), NEW, keep_logits=True)
  assert chunked.tokens == one_shot.tokens
  np.testing.assert_allclose(chunked.logits, one_shot.logits, rtol=1e-5, atol=2e-5)


def test_qwen3_qk_norm_tied_embeddings_and_llama3_rope_scaling():
  """The family switches change the function and still match the reference."""
  base = helpers.tiny_config()
  mc = dataclasses.replace(
      base.model,
      qk_norm=True,
      tie_embeddings=True,
      rope_scaling=config_lib.RopeScaling(factor=8.0, original_max_position=16),
  )
  cfg = dataclasses.replace(base, model=mc)
  params = model.init_params(mc, jax.random.key(1), helpers.mesh(2))
  assert "lm_head" not in params and "q_norm" in params["layers"][0]
  from jaxkv import engine as engine_lib  # pylint: disable=g-import-not-at-top

  eng = engine_lib.Engine(cfg, helpers.mesh(2), params)
  prompt = helpers.prompts([20])[0]
  res = eng.generate([prompt], 8, keep_logits=True)
  ref = np.asarray(reference.forward(params, np.array([prompt + res.tokens[0][:-1]]), mc))[0, 19:]
  np.testing.assert_allclose(res.logits[:, 0], ref, rtol=1e-5, atol=2e-5)
  plain = helpers.engine(2).generate([prompt], 8, keep_logits=True)
  assert not np.allclose(plain.logits, res.logits)


def test_llama3_rope_scaling_frequencies():
  cfg = dataclasses.replace(
      helpers.tiny_config().model, head_dim=128, rope_theta=500_000.0, rope_scaling=config_lib.RopeScaling()
  )
  inv = model.rope_frequencies(cfg)
  base = 1.0 / (500_000.0 ** (np.arange(0, 128, 2) / 128))
  wavelen = 2 * np.pi / base
  np.testing.assert_allclose(inv[wavelen < 8192 / 4], base[wavelen < 8192 / 4], rtol=1e-6)  # High freq: kept.
  np.testing.assert_allclose(inv[wavelen > 8192], base[wavelen > 8192] / 8, rtol=1e-6)  # Low freq: / factor.


def test_seeded_sampling_is_reproducible_and_seed_dependent():
  s = config_lib.SamplingConfig(temperature=0.9, top_k=40, top_p=0.9)
  eng = helpers.engine(2, sampling=s)
  a = eng.generate(helpers.prompts(LENGTHS), NEW, seed=3)
  b = eng.generate(helpers.prompts(LENGTHS), NEW, seed=3)
  c = eng.generate(helpers.prompts(LENGTHS), NEW, seed=4)
  assert a.tokens == b.tokens and a.logits_sha256 == b.logits_sha256
  assert a.tokens != c.tokens


def test_top_k_one_is_greedy(one_device_run):
  s = config_lib.SamplingConfig(temperature=1.0, top_k=1)
  assert helpers.engine(1, sampling=s).generate(helpers.prompts(LENGTHS), NEW).tokens == one_device_run.tokens


def test_eos_stops_each_sequence(one_device_run):
  eos = one_device_run.tokens[0][3]
  s = config_lib.SamplingConfig(eos_id=eos)
  res = helpers.engine(1, sampling=s).generate(helpers.prompts(LENGTHS), NEW)
  for got, full in zip(res.tokens, one_device_run.tokens):
    want = full[: full.index(eos) + 1] if eos in full else full
    assert got == want


def test_all_sequences_ending_early_stop_the_run_and_its_records(one_device_run):
  """Once every sequence has hit EOS, later steps (already dispatched) are neither counted nor hashed."""
  prompt = helpers.prompts(LENGTHS)[:1]
  full = helpers.engine(1).generate(prompt, NEW, keep_logits=True)
  eos = full.tokens[0][4]
  stop = full.tokens[0].index(eos) + 1
  res = helpers.engine(1, sampling=config_lib.SamplingConfig(eos_id=eos)).generate(prompt, NEW, keep_logits=True)
  assert res.tokens[0] == full.tokens[0][:stop]
  assert res.logits.shape[0] == stop and res.timing["decode_steps"] == stop - 1
  np.testing.assert_array_equal(res.logits, full.logits[:stop])


def test_blocked_prefill_attention_matches_one_block():
  rng = np.random.default_rng(0)
  b, t, h, k, r, dh = 2, 16, 4, 2, 40, 8
  q = jnp.asarray(rng.standard_normal((b, t, h, dh)), jnp.float32)
  kv = jnp.asarray(rng.standard_normal((2, b, k, r, dh)), jnp.float32)
  mask = jnp.asarray(rng.random((b, t, r)) < 0.7).at[:, :, 0].set(True)
  assert model.query_block(b, h, t, r, budget_bytes=b * h * 4 * r * 4) == 4
  with mock.patch.object(model, "SCORE_BUDGET_BYTES", b * h * 4 * r * 4):
    blocked = jax.jit(model.blocked_attention)(q, kv, mask)
  np.testing.assert_allclose(blocked, model.attention(q, kv, mask), rtol=1e-6, atol=1e-6)


def test_penalties_shape_each_step_by_the_tokens_before_it(one_device_run):
  """Greedy with penalties: every step's token is the argmax of that step's model logits shaped by the prompt and
  the tokens generated before it (the head's counts, replayed on the host), and they change the tokens."""
  s = config_lib.SamplingConfig(presence_penalty=1.5, frequency_penalty=0.75, repetition_penalty=1.3)
  prompts = helpers.prompts(LENGTHS)
  res = helpers.engine(1, sampling=s).generate(prompts, NEW, keep_logits=True)
  for b, prompt in enumerate(prompts):
    counts = np.zeros(res.logits.shape[-1], np.float32)
    seen = np.zeros(res.logits.shape[-1], bool)
    seen[prompt] = True
    for t, token in enumerate(res.tokens[b]):
      x = reference.shaped_logits(res.logits[t, b], counts, seen, s, sampling.Rules(), t)
      assert token == np.argmax(x), (b, t)
      counts[token] += 1
  assert res.tokens != one_device_run.tokens
  np.testing.assert_array_equal(res.logits[0], one_device_run.logits[0])  # The model's logits, before shaping.
