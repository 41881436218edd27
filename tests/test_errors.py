"""Every bad input raises its promised error, before any work."""

import dataclasses

import helpers
import jax
import pytest

from experiments import tiny
from jaxkv import config as config_lib
from jaxkv import engine as engine_lib
from jaxkv import mesh as mesh_lib
from jaxkv import model


@pytest.mark.parametrize(
    "prompts, new, match",
    [
        ([[1] * 129], 1, "prompt 0 has 129 tokens, longer than the cache capacity 128"),
        ([[1] * 100, [2] * 5], 30, r"longest prompt \(100 tokens\) plus max_new_tokens \(30\) needs 129 cache rows"),
        ([[1, 2], []], 4, "prompt 1 is empty"),
        ([[1, 256]], 4, r"token ids outside \[0, 256\): \[256\]"),
        ([[1, -1]], 4, "token ids outside"),
        ([], 4, "no prompts given"),
        ([[1]], 0, "max_new_tokens must be >= 1"),
    ],
)
def test_bad_generate_input(prompts, new, match):
  with pytest.raises(ValueError, match=match):
    helpers.engine(1, placement="host").generate(prompts, new)


def test_kv_heads_not_divisible_by_the_tensor_axis_names_both_numbers():
  cfg = dataclasses.replace(helpers.tiny_config().model, num_kv_heads=4, num_heads=8)
  with pytest.raises(ValueError, match="num_kv_heads = 4 is not divisible by the tensor axis size 8"):
    model.init_params(cfg, jax.random.key(0), helpers.mesh(8))


def test_prefill_chunk_must_be_a_multiple_of_the_block():
  with pytest.raises(ValueError, match=r"prefill_chunk \(12\) must be a multiple of kv.block \(8\)"):
    helpers.engine(1, chunk=12)


@pytest.mark.parametrize(
    "axes, match",
    [
        ((("data", 2),), "needs a 'tensor' axis"),
        ((("tensor", -1), ("data", -1)), "at most one mesh axis may be -1"),
        ((("tensor", 16),), "needs 16 devices, only 8 available"),
        ((("tensor", 0),), "positive or -1"),
    ],
)
def test_bad_mesh(axes, match):
  with pytest.raises(ValueError, match=match):
    mesh_lib.make_mesh(axes)


def test_mesh_minus_one_takes_the_remaining_devices():
  mesh = mesh_lib.make_mesh((("data", 2), ("tensor", -1)))
  assert dict(mesh.shape) == {"data": 2, "tensor": 4}
  assert mesh_lib.make_mesh((("tensor", 3),)).shape["tensor"] == 3  # A mesh may use a subset of the devices.


@pytest.mark.parametrize(
    "section, field, value, match",
    [
        ("model", "num_layers", 0, "model.num_layers must be positive"),
        ("model", "num_heads", 12, r"num_heads \(12\) must be a multiple of model.num_kv_heads \(8\)"),
        ("model", "dtype", "int4", "model.dtype must be"),
        ("kv", "placement", "disk", "kv.placement must be one of"),
        ("kv", "pipeline_depth", -1, "kv.pipeline_depth must be >= 0"),
        ("kv", "transport_debug", 7, "kv.transport_debug must be 0..3"),
        ("sampling", "top_p", 0.0, r"sampling.top_p must be in \(0, 1\]"),
        ("sampling", "temperature", -1.0, "sampling.temperature must be >= 0"),
    ],
)
def test_bad_config_values(section, field, value, match):
  cd = tiny.get_config()
  cd[section][field] = value
  with pytest.raises(ValueError, match=match):
    config_lib.from_config_dict(cd)


def test_unknown_config_field_is_named():
  cd = tiny.get_config().to_dict()
  cd["kv"]["pipline_depth"] = 2
  with pytest.raises(ValueError, match="unknown kv field.*pipline_depth"):
    config_lib.from_config_dict(cd)


@pytest.mark.parametrize("field, value", [("mlp_dim", 100), ("vocab_size", 260)])
def test_engine_rejects_a_mesh_that_does_not_split_the_model(field, value):
  cfg = helpers.tiny_config()
  params = helpers.params(1)
  mc = dataclasses.replace(cfg.model, **{field: value})
  with pytest.raises(ValueError, match=f"{field} = {value} is not divisible by the tensor axis size 8; choose"):
    engine_lib.Engine(dataclasses.replace(cfg, model=mc), helpers.mesh(8), params)
