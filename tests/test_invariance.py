"""Batch invariance from the prompt on: every prompt is prefilled alone from row 0 (its chunks its own length's) and its
rows placed at its slot's, so a sequence's tokens and logits are bitwise those it gets alone, among longer and
shorter prompts, in generate (every split mode) and through the server (prefix cache off and on). A prefill whose
chunks follow the batch (left padding to the longest prompt, or a request prefilled at its slot's rows) fails these
checks, and so does a leaf sum whose order follows the batch's size (jaxkv.decode_attention.pairwise_sum)."""

import helpers
import jax
import numpy as np
import pytest

from jaxkv import engine as engine_lib
from jaxkv import layout as layout_lib
from jaxkv import model
from jaxkv import serving

NEW_TOKENS = 8


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("placement", ["device", "host"])
def test_a_prompt_gets_its_bits_alone_among_longer_and_shorter_ones_in_generate(placement, kv_dtype):
  """Per-sequence logits (keep_logits) of a 20-token prompt, alone and at three places in batches whose prompts
  reach 7 to 45 tokens (prefill chunks of 16 rows, blocks of 8: its rows start at 25, 13 or 0 of the batch's)."""
  eng = helpers.engine(2, placement=placement, depth=1, kv_dtype=kv_dtype, cfg=helpers.tiny_config(head_dim=32))
  short, target, long1, long2 = helpers.prompts([7, 20, 45, 33], seed=6)
  alone = eng.generate([target], NEW_TOKENS, keep_logits=True)
  for batch, b in (([short, target, long1], 1), ([long1, long2, target, short], 2), ([target, short], 0)):
    res = eng.generate(batch, NEW_TOKENS, keep_logits=True)
    assert res.tokens[b] == alone.tokens[0], (len(batch), b)
    np.testing.assert_array_equal(res.logits[:, b], alone.logits[:, 0], err_msg=f"{len(batch)} prompts, row {b}")


@pytest.mark.parametrize("mode", ["layer", "none"])
def test_a_prompt_gets_its_bits_alone_in_a_batch_in_the_other_split_modes(mode):
  """The same in split modes layer (a stage per device) and none (one device), host placement."""
  mesh = helpers.mesh(2)
  layout = layout_lib.make_layout(mode, mesh, helpers.tiny_config().model.num_layers)
  params = model.init_params(helpers.tiny_config().model, jax.random.key(0), mesh, layout)
  eng = engine_lib.Engine(helpers.engine(1, placement="host", depth=1).config, mesh, params, layout)
  short, target, long1 = helpers.prompts([7, 20, 45], seed=6)
  alone = eng.generate([target], NEW_TOKENS, keep_logits=True)
  res = eng.generate([short, target, long1], NEW_TOKENS, keep_logits=True)
  np.testing.assert_array_equal(res.logits[:, 1], alone.logits[:, 0])


def _requests():
  rng = np.random.default_rng(5)
  target = serving.Request(tuple(rng.integers(2, 250, 20).tolist()), 12, seed=0)
  longer = [
      serving.Request(tuple(rng.integers(2, 250, n).tolist()), m, seed=i + 1)
      for i, (n, m) in enumerate(((60, 3), (50, 12), (70, 12)))
  ]
  return target, longer


@pytest.mark.parametrize("prefix_cache_bytes", [0, 1, 2**30], ids=["off", "stores_nothing", "on"])
@pytest.mark.parametrize("placement", ["device", "host"])
def test_a_request_among_longer_ones_gets_its_bits_alone_through_the_server(placement, prefix_cache_bytes):
  """The target alone (rows [0, 20)), in an epoch's first batch beside longer prompts (its rows at [50, 70)) and
  entering a slot freed mid-decode (after rows the others wrote): the same tokens and logits hash."""
  eng = helpers.engine(2, placement=placement, depth=1)
  target, longer = _requests()
  alone = serving.Server(eng, 1, prefix_cache_bytes).serve([target]).results[0]
  first = serving.Server(eng, 4, prefix_cache_bytes).serve(longer[:2] + [target] + longer[2:]).results[2]
  later = serving.Server(eng, 2, prefix_cache_bytes).serve(longer[:2] + [target]).results[2]
  assert (alone.first_row, first.first_row) == (0, 50) and (later.epoch, later.slot) == (0, 0) and later.first_row > 40
  for name, among in (("first", first), ("later", later)):
    assert (among.tokens, among.logits_sha256) == (alone.tokens, alone.logits_sha256), name
