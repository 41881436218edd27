"""Split modes: layer ranges over devices give the bits of one device, with each layer's weights, KV and
deliveries on its own device."""

import dataclasses
import functools

import helpers
import jax
import numpy as np
import pytest

from jaxkv import engine as engine_lib
from jaxkv import layout as layout_lib
from jaxkv import model
from jaxkv import serving

LENGTHS = (9, 17, 1, 30)
NEW = 14  # Crosses block boundaries (block 8): windows grow and are stored back on their device.


@functools.lru_cache(maxsize=None)
def _layout_and_params(mode, devices, split=""):
  mesh = helpers.mesh(devices)
  layout = layout_lib.make_layout(mode, mesh, 6, layout_lib.parse_layer_split(split))
  return mesh, layout, model.init_params(helpers.tiny_config().model, jax.random.key(0), mesh, layout)


def _engine(mode, devices, split="", placement="host", depth=2):
  mesh, layout, params = _layout_and_params(mode, devices, split)
  cfg = helpers.engine(1, placement=placement, depth=depth).config
  return engine_lib.Engine(cfg, mesh, params, layout)


def test_layer_stages_even_and_in_proportion():
  assert layout_lib.layer_stages(6, 2) == (0, 0, 0, 1, 1, 1)
  assert layout_lib.layer_stages(6, 2, (55, 45)) == (0, 0, 0, 1, 1, 1)
  assert layout_lib.layer_stages(6, 2, (1, 2)) == (0, 0, 1, 1, 1, 1)
  assert layout_lib.layer_stages(32, 4, (1, 1, 3, 1)) == (0,) * 5 + (1,) * 6 + (2,) * 16 + (3,) * 5


@pytest.mark.parametrize(
    "text, stages, match",
    [
        ("55,x", 2, "comma-separated numbers"),
        ("1,-1", 2, "must be positive"),
        ("1,1,1", 2, "3 values for 2 devices"),
        ("100,1", 2, "every device needs at least one layer"),
    ],
)
def test_bad_layer_splits_are_clear_errors(text, stages, match):
  with pytest.raises(ValueError, match=match):
    layout_lib.layer_stages(6, stages, layout_lib.parse_layer_split(text))


def test_layer_split_needs_split_mode_layer_and_auto_needs_one_mesh():
  with pytest.raises(ValueError, match="split mode layer only"):
    layout_lib.make_layout("tensor", helpers.mesh(2), 6, (1.0, 1.0))
  with pytest.raises(ValueError, match="plans one mesh"):
    _engine("layer", 2, placement="auto").generate(helpers.prompts(LENGTHS), 2)


@pytest.mark.parametrize("devices, split", [(2, ""), (2, "1,2"), (4, "1,1,3,1")])
def test_split_mode_layer_is_bit_identical_to_none(devices, split):
  prompts = helpers.prompts(LENGTHS)
  ref = _engine("none", devices, placement="device").generate(prompts, NEW, keep_logits=True)
  for placement, depth in (("device", 1), ("host", 0), ("host", 1), ("host", 2)):
    res = _engine("layer", devices, split, placement, depth).generate(prompts, NEW, keep_logits=True)
    np.testing.assert_array_equal(res.logits, ref.logits)
    assert res.tokens == ref.tokens


@pytest.mark.parametrize("devices, split", [(2, "1,2"), (4, "")])
def test_each_device_holds_and_receives_only_its_layers(devices, split):
  eng = _engine("layer", devices, split)
  stages = eng.layout.stage_of
  devs = [d for m in eng.layout.meshes for d in m.devices.flat]
  for l, p in enumerate(eng.params["layers"]):
    assert p["wq"].devices() == {devs[stages[l]]}
  caches = []
  res = eng.generate(helpers.prompts(LENGTHS), NEW, on_step=lambda step, cache: caches.append(cache))
  cache = caches[-1]
  for l, w in enumerate(cache.windows):
    assert w.devices() == {devs[stages[l]]} and w.sharding.memory_kind == "pinned_host"
  by_device = res.transport["h2d_bytes_by_device"]
  assert sum(by_device.values()) == res.transport["h2d_bytes"]
  layers_per_device = [stages.count(s) for s in range(devices)]
  totals = [by_device[str(d)] for d in devs]
  np.testing.assert_allclose(np.array(totals) / sum(totals), np.array(layers_per_device) / 6)
  largest = max(w.nbytes for w in cache.windows)
  hw = res.transport["ring_high_water_bytes_by_device"]
  group = max(len(g) for g in res.transport["decode_groups"])  # Layers a delivery carries (never across stages).
  assert all(len({stages[l] for l in g}) == 1 for g in res.transport["decode_groups"])
  assert all(0 < hw[str(d)] <= (eng.config.kv.pipeline_depth + 2) * group * largest for d in devs)


def test_slots_in_split_mode_layer_match_one_device():
  reqs = [serving.Request(tuple(p), n) for p, n in zip(helpers.prompts((5, 12, 20, 3, 9, 30)), (6, 3, 9, 4, 7, 5))]
  ref = serving.Server(_engine("none", 2, placement="device"), 2).serve(reqs)
  out = serving.Server(_engine("layer", 2, "1,2", "host", 1), 2).serve(reqs)
  assert out.transcript_sha256 == ref.transcript_sha256 and out.transport["insertions"] >= 1


def test_config_rejects_an_unknown_split_mode():
  cfg = helpers.tiny_config()
  with pytest.raises(ValueError, match="split.mode must be one of"):
    dataclasses.replace(cfg, split=dataclasses.replace(cfg.split, mode="pipeline"))


@pytest.mark.parametrize("devices, split", [(2, "1,2"), (4, "")])
def test_host_attention_across_layer_stages_matches_one_device(devices, split):
  """Each stage's split layers hand their merge to the next split layer's query on the same stage; at a stage
  boundary the merge runs on its own stage first."""
  prompts = helpers.prompts((40, 33, 17, 1))  # Windows of 40..56 rows: head rows at f = 0.5.
  ref = _engine("none", devices, placement="device").generate(prompts, NEW, keep_logits=True)
  eng = _engine("layer", devices, split)
  kv = dataclasses.replace(eng.config.kv, host_attention=True, host_attention_fraction=0.5)
  eng = engine_lib.Engine(dataclasses.replace(eng.config, kv=kv), eng.mesh, eng.params, eng.layout)
  res = eng.generate(prompts, NEW, keep_logits=True)
  assert res.tokens == ref.tokens
  np.testing.assert_allclose(res.logits, ref.logits, rtol=0, atol=1e-5)  # As in test_host_attention_engine.
