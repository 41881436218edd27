"""Every experiment config builds its model abstractly (jax.eval_shape: shapes and shardings, nothing allocated)."""

import importlib
import math
import pathlib

import helpers
import ml_collections
import jax
import pytest
from absl import flags
from ml_collections import config_flags

from jaxkv import config as config_lib
from jaxkv import mesh as mesh_lib
from jaxkv import model

EXPERIMENTS = sorted(
    p.stem
    for p in (pathlib.Path(__file__).parent.parent / "experiments").glob("*.py")
    if p.stem not in ("__init__", "common")
)
# Published parameter counts of the models whose geometry the configs copy.
PARAMETERS = {
    "llama3_8b": 8_030_261_248,
    "llama3_70b": 70_553_706_496,
    "qwen3_32b": 32_762_123_264,
}


def test_every_experiment_file_is_listed():
  assert {"tiny", *PARAMETERS} == set(EXPERIMENTS)


@pytest.mark.parametrize("name, arg", [(n, None) for n in EXPERIMENTS] + [("llama3_8b", "3.1")])
def test_the_abstract_model_of_each_experiment(name, arg):
  config = config_lib.from_config_dict(importlib.import_module(f"experiments.{name}").get_config(arg))
  mesh = mesh_lib.make_mesh(config.mesh)
  live = len(jax.live_arrays())
  params = jax.eval_shape(lambda: model.init_params(config.model, jax.random.key(0), mesh))
  assert len(jax.live_arrays()) == live
  leaves = jax.tree.leaves(params)
  assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves)
  assert {leaf.dtype for leaf in leaves} == {jax.numpy.dtype(config.model.dtype)}
  axes = jax.tree.leaves(model.param_axes(config.model), is_leaf=lambda x: isinstance(x, tuple))
  # Each parameter splits over the tensor axis as its logical axes say (shard_shape fails where it does not divide).
  for leaf, ax in zip(leaves, axes, strict=True):
    mesh_lib.sharding(mesh, ax).shard_shape(leaf.shape)
  m, t = config.model, mesh_lib.tensor_size(mesh)
  wk = mesh_lib.sharding(mesh, model.LAYER_AXES["wk"]).shard_shape(params["layers"][0]["wk"].shape)
  assert wk == (m.d_model, m.num_kv_heads // t, m.head_dim)  # Each device: its own KV heads.
  count = sum(math.prod(leaf.shape) for leaf in leaves)
  assert count == PARAMETERS.get(name, count)
  assert (config.model.rope_scaling is not None) == (arg == "3.1")
  if name == "tiny":
    assert config == helpers.tiny_config()


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_config_field_can_be_overridden_on_the_command_line(name):
  """No leaf of a config is a bare None (ml_collections cannot override those): `--config.kv.device_budget_gib=8`."""
  fv = flags.FlagValues()
  argv = ["prog", f"--config=experiments/{name}.py", "--config.kv.device_budget_gib=8"]
  config_flags.DEFINE_config_file("config", flag_values=fv, sys_argv=argv)
  fv(argv)
  assert fv.config.kv.device_budget_gib == 8.0

  def leaves(cd, prefix):
    for key in cd:
      if isinstance(cd[key], ml_collections.ConfigDict):
        yield from leaves(cd[key], f"{prefix}{key}.")
      else:
        yield f"{prefix}{key}", cd.get_type(key)

  assert [k for k, t in leaves(fv.config, "") if t is type(None)] == []


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_a_variant_that_does_not_exist_is_refused(name):
  with pytest.raises(ValueError, match=rf"experiments/{name}.py has no variant 'bogus': it takes no variant"):
    importlib.import_module(f"experiments.{name}").get_config("bogus")


def test_the_tiny_model_forms_three_decode_groups():
  """The default demo pipelines: depth 2 needs 3 streamed groups (the depth is capped at the groups - 1)."""
  config = helpers.tiny_config()
  assert config.kv.group_layers == 2 and config.model.num_layers // config.kv.group_layers == 3
