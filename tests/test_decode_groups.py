"""Decode in layer groups: which layers share a call, the same bits in groups of every size and split mode, and the
host's dispatches per step. (tests/test_transport.py runs every placement and depth with groups of 1, 2 and 6 on
meshes 1-8 and every KV dtype.)"""

import dataclasses

import helpers
import jax
import numpy as np
import pytest

from jaxkv import config as config_lib
from jaxkv import engine as engine_lib
from jaxkv import layout as layout_lib
from jaxkv import model
from jaxkv import residency
from jaxkv import serving
from jaxkv import transport as transport_lib
from jaxkv.residency import decode_groups

BLOCK = 8  # The tiny config's kv.block.
LENGTHS = (1, 9, 17)
NEW = 14  # Crosses a block boundary: the open pages fill and are folded into the windows by the group's call.
S, R = True, False  # Streamed, resident.
MIB = 2**20


def test_groups_are_runs_of_one_stage_cut_by_bytes_in_every_placement():
  per_group = lambda layer_bytes, **kw: residency.group_layers(
      kw.get("group_layers", 0), kw.get("ha", False), layer_bytes
  )
  assert per_group(300 * MIB) == 3  # Groups of at most 1 GiB per device, each layer over it alone,
  assert per_group(2048 * MIB) == 1 and per_group(20 * MIB) == 8  # and at most 8 layers.
  assert per_group(20 * MIB, group_layers=3) == 3 and per_group(MIB, ha=True) == 1
  assert decode_groups((0,) * 9, 4) == ((0, 1, 2, 3), (4, 5, 6, 7), (8,))
  assert decode_groups((0, 0, 0, 1, 1), 2) == ((0, 1), (2,), (3, 4))  # Never across a stage.


def test_the_planner_keeps_or_streams_whole_groups():
  groups = decode_groups((0,) * 9, 4)  # (0-3), (4-7), (8).
  streamed = lambda layers: residency.plan(groups, MIB, layers * MIB, "test").streamed
  assert streamed(9) == (R,) * 9
  assert streamed(8) == streamed(5) == (R,) * 4 + (S,) * 4 + (R,)  # Two of three groups, spread: the first and last.
  assert streamed(4) == (S,) * 4 + (R,) * 4 + (S,)  # One group: the middle one (spread).
  assert streamed(3) == (S,) * 9


def test_device_host_and_auto_run_the_same_groups():
  """Where the windows live does not change the partition: every placement compiles the same group programs."""
  eng = helpers.engine(2, placement="device", depth=1, group_layers=2)
  layer = helpers.layer_bytes(eng, 1)
  for kv in (dict(placement="host"), dict(placement="auto", device_budget_gib=3.5 * layer / 2**30)):
    cache = helpers.kv_cache(
        eng.config.model, dataclasses.replace(eng.config.kv, **kv), eng.mesh, 1, eng.config.engine.capacity
    )
    transport = transport_lib.Transport(cache, 1)
    try:
      assert transport.groups == ((0, 1), (2, 3), (4, 5))
    finally:
      transport.close()
  assert cache.streamed == (True, True, False, False, True, True)  # One group of two fits 3.5 layers.


@pytest.fixture(scope="module")
def layer_split():
  """Split mode layer on 2 devices (stages of layers 0-2 and 3-5) and split mode none, with their weights."""
  out = {}
  for mode in ("none", "layer"):
    mesh = helpers.mesh(2)
    layout = layout_lib.make_layout(mode, mesh, 6)
    out[mode] = mesh, layout, model.init_params(helpers.tiny_config().model, jax.random.key(0), mesh, layout)
  return out


def _engine(layer_split, mode, placement, depth, group_layers):
  mesh, layout, params = layer_split[mode]
  cfg = helpers.engine(1, placement=placement, depth=depth, group_layers=group_layers).config
  return engine_lib.Engine(cfg, mesh, params, layout)


def test_split_modes_none_and_layer_give_the_bits_of_one_call_per_layer(layer_split):
  prompts = helpers.prompts(LENGTHS)
  ref = _engine(layer_split, "none", "device", 1, 1).generate(prompts, NEW, keep_logits=True)
  for mode, placement, depth, group_layers, groups in (
      ("none", "device", 1, 0, 1),
      ("none", "host", 1, 2, 3),
      ("layer", "device", 1, 0, 2),
      ("layer", "host", 0, 0, 2),
      ("layer", "host", 2, 1, 6),
  ):
    res = _engine(layer_split, mode, placement, depth, group_layers).generate(prompts, NEW, keep_logits=True)
    np.testing.assert_array_equal(res.logits, ref.logits, err_msg=mode)
    assert (res.tokens_sha256, res.logits_sha256) == (ref.tokens_sha256, ref.logits_sha256)
    assert len(res.transport["decode_groups"]) == groups


@pytest.mark.parametrize("tensor", [1, 8])
def test_device_placement_dispatches_four_calls_a_step_on_any_mesh(tensor):
  """One call for all layers, the head, the copies of its logits and tokens: as many on 8 devices as on 1."""
  res = helpers.engine(tensor, placement="device").generate(helpers.prompts(LENGTHS), NEW)
  assert res.transport["decode_groups"] == [list(range(6))]
  assert res.transport["dispatches_per_step"] == 4
  one_per_layer = helpers.engine(tensor, placement="device", group_layers=1).generate(helpers.prompts(LENGTHS), NEW)
  assert one_per_layer.transport["dispatches_per_step"] == 6 + 3
  assert one_per_layer.logits_sha256 == res.logits_sha256


@pytest.mark.parametrize("group_layers, groups", [(1, 6), (2, 3), (0, 1)])
def test_host_placement_dispatches_what_its_groups_predict(group_layers, groups):
  res = helpers.engine(2, placement="host", depth=1, group_layers=group_layers).generate(helpers.prompts(LENGTHS), NEW)
  assert len(res.transport["decode_groups"]) == groups
  steps = NEW - 1
  # Step t writes row 17 + t - 1; where that row ends a block, each group's call also returns its grown windows and
  # one transfer stores them.
  full = sum((17 + t - 1) % BLOCK == BLOCK - 1 for t in range(1, NEW))
  # Per step: a delivery and a call per group, the head and the copies of its logits and tokens.
  assert res.transport["dispatches_per_step"] * steps == pytest.approx((2 * groups + 3) * steps + groups * full)


def test_slots_give_the_transcript_of_one_call_per_layer():
  reqs = [serving.Request(tuple(p), n) for p, n in zip(helpers.prompts((5, 12, 20, 3, 9, 30)), (6, 3, 9, 4, 7, 5))]
  ref = serving.Server(helpers.engine(2, placement="device", group_layers=1), 2).serve(reqs)
  for placement, depth, group_layers in (("device", 1, 0), ("host", 1, 2), ("host", 0, 0)):
    eng = helpers.engine(2, placement=placement, depth=depth, group_layers=group_layers)
    out = serving.Server(eng, 2).serve(reqs)
    assert out.transcript_sha256 == ref.transcript_sha256 and out.transport["insertions"] >= 1
