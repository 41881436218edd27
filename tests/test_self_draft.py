"""Self-speculation (jaxkv.self_draft, speculate.mode self): drafts from the model over an int4 copy of the KV on the
device, verified on the exact cache, give the tokens and logits of plain greedy decode (device and host placements,
batch 1 and 2); the copy is the int4 of the exact rows; over an exact cache that is itself int4 on the device every
draft is accepted (the draft cache holds the exact cache's rows after every rollback); how a batch drafter gets its
rows' drafts; what it refuses."""

import dataclasses

import helpers
import jax
import numpy as np
import pytest

from jaxkv import config as config_lib
from jaxkv import preflight
from jaxkv import self_draft
from jaxkv import spec_decode
from jaxkv import speculate
from jaxkv.kv_quant import KVFormat

NEW = 30  # Tokens per sequence: over three of the tiny config's 8-row pages past the prompts.
K = 4
CFG = helpers.tiny_config(head_dim=32)  # int4 quantizes 32-value blocks along head_dim.
LENGTHS = {1: [7], 2: [5, 12]}


def _self(eng, k=K):
  config = dataclasses.replace(eng.config, speculate=config_lib.SpeculateConfig(mode="self", k=k))
  return type(eng)(config, eng.mesh, eng.params, eng.layout)


@pytest.fixture(scope="module")
def plain():
  """batch -> the device placement's plain greedy run (the delivery modes give its bits)."""
  eng = helpers.engine(1, cfg=CFG)
  return {b: eng.generate(helpers.prompts(lengths), NEW, keep_logits=True) for b, lengths in LENGTHS.items()}


# Each case compiles programs of its own (a placement at a batch): each placement and each batch runs once, batch 2 (two
# rows of different lengths) with the streamed cache. The device placement at batch 2 drafts in
# test_drafts_over_an_exact_int4_copy_are_all_accepted.
@pytest.mark.parametrize("placement, depth, batch", [("device", 1, 1), ("host", 2, 2)])
def test_self_speculation_gives_the_tokens_and_logits_of_plain_greedy_decode(plain, placement, depth, batch):
  eng = _self(helpers.engine(1, cfg=CFG, placement=placement, depth=depth))
  res = eng.generate(helpers.prompts(LENGTHS[batch]), NEW, keep_logits=True)
  assert res.tokens == plain[batch].tokens
  np.testing.assert_array_equal(res.logits, plain[batch].logits)
  assert res.logits_sha256 == plain[batch].logits_sha256
  s = res.transport["speculate"]
  assert s["tokens"] == NEW - 1 and s["passes"] == res.transport["decode_passes"], s
  assert s["verify_passes"] > 0 and s["accepted"] > 0 and s["tokens_per_pass"] > 1.5, s
  d = s["draft"]
  assert d["kv_dtype"] == "int4" and d["bytes_per_device"] == self_draft.cache_bytes(eng.config, eng.layout, batch)
  assert d["steps"] >= s["drafted"] // batch and d["fill_s"] > 0, d


@pytest.mark.parametrize("host_attention", [False, True])
def test_the_draft_cache_holds_the_int4_of_the_exact_rows(host_attention):
  """After a prefill of two prompts into a streamed cache (its windows in pinned host memory, exact; with host
  attention, the rows below the split row apart), the draft cache holds each layer's rows packed as int4 (its windows
  at their bucketed allocation, zero rows in front), its open pages likewise, and the exact cache's rows, start and
  end."""
  fraction = 0.25 if host_attention else 0.0
  eng = helpers.engine(
      1, cfg=CFG, placement="host", depth=2, host_attention=host_attention, host_attention_fraction=fraction
  )
  gen = eng.start(2)
  try:
    eng.prefill_prompts(gen, helpers.prompts([46, 37]), next_pass=False)
    drafter = self_draft.SelfDraft(eng)
    drafter.begin(gen)
  finally:
    gen.close()
  draft, exact = drafter.gen.cache, gen.cache
  int4 = lambda stored: np.asarray(jax.jit(KVFormat.of(CFG.model, "int4").pack)(np.asarray(stored)))
  assert draft.rows == exact.rows == 40 and drafter.gen.end == gen.end == 46
  assert (exact.head_rows(0) == 8) == host_attention
  np.testing.assert_array_equal(drafter.gen.start, gen.start)
  a_rows = draft.window_rows(40, 0)
  assert a_rows > 40 and draft.kv.dtype == "int4" and not any(draft.streamed)
  for l in range(CFG.model.num_layers):
    rows = [a for a in (exact.heads[l], exact.windows[l]) if a is not None]
    window = np.asarray(draft.windows[l])
    np.testing.assert_array_equal(window[:, :, :, a_rows - 40 :], int4(np.concatenate(rows, axis=3)))
    assert not window[:, :, :, : a_rows - 40].any()
    np.testing.assert_array_equal(np.asarray(draft.opens[l]), int4(exact.opens[l]))
  drafter.close()


def test_drafts_over_an_exact_int4_copy_are_all_accepted():
  """The exact cache int4 on the device too: the draft cache holds its bits, so every draft is the model's greedy
  continuation and every verify accepts all of it (batch 2, across pages; the pass's last accepted token, which no
  draft step wrote, is caught up by the next pass's first step)."""
  eng = helpers.engine(1, cfg=CFG, kv_dtype="int4")
  prompts = helpers.prompts(LENGTHS[2])
  reference = eng.generate(prompts, NEW, keep_logits=True)
  res = _self(eng).generate(prompts, NEW, keep_logits=True)
  assert res.tokens == reference.tokens
  np.testing.assert_array_equal(res.logits, reference.logits)
  s = res.transport["speculate"]
  assert s["accepted"] == s["drafted"] > 0 and s["switched_off"] == 0, s
  assert s["accepted_histogram"][K] > 0 and s["draft"]["caught_up"] > 0, s


class _Continues:
  """A batch drafter that proposes, for each row, its last token + 1, + 2, ...; records its calls."""

  def __init__(self):
    self.calls = []

  def propose_batch(self, histories, wants, end):
    self.calls.append((histories, wants, end))
    return {b: [h[-1] + 1 + i for i in range(wants[b])] for b, h in histories.items()}


def test_a_batch_drafter_gets_each_row_s_history_with_its_pending_tokens():
  """Speculator.drafts: a row's pending tokens head its draft and its history; a switched-off row wants none; no call
  where no row wants any."""
  d = _Continues()
  switch = speculate.Switch(window=1, min_accepted=1.0, off_passes=2)
  s = spec_decode.Speculator(d, 4, switch)
  s.passed(1, drafted=3, accepted=0, pending=[])  # Row 1 switched off.
  s.pending[0] = [7, 8]
  assert s.drafts({0: [1, 2], 1: [3]}, 4, end=10) == {0: [7, 8, 9, 10], 1: []}
  assert d.calls == [({0: [1, 2, 7, 8], 1: [3]}, {0: 2, 1: 0}, 10)]
  s.pending[0] = [7, 8, 9, 10, 11]
  assert s.drafts({0: [1, 2], 1: [3]}, 4, end=11) == {0: [7, 8, 9, 10], 1: []} and len(d.calls) == 1


def test_self_speculation_refuses_what_it_cannot_run(monkeypatch):
  """A head_dim that int4 does not quantize (the config); a draft cache larger than the free device memory less the
  headroom (the prompts' check before the weights are built, and the run before it fills the draft cache)."""
  with pytest.raises(ValueError, match="model.head_dim must be a multiple of 32, got 16; use --speculate=lookup"):
    dataclasses.replace(helpers.tiny_config(), speculate=config_lib.SpeculateConfig(mode="self"))
  eng = _self(helpers.engine(1, cfg=CFG))
  need = self_draft.cache_bytes(eng.config, eng.layout, 1)
  helpers.device_memory(monkeypatch, need)  # Free: the cache's bytes, not the headroom beside them.
  job = preflight.Job(eng.config, eng.mesh, eng.layout)
  with pytest.raises(preflight.InputError, match=r"--speculate=self: the int4 draft cache takes .* MiB per device"):
    preflight.check_prompts(job, [[1, 2, 3]], 4)
  with pytest.raises(ValueError, match="lower engine.capacity or the batch, or use --speculate=lookup"):
    eng.generate([[1, 2, 3]], 4)
