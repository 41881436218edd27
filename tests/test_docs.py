"""One source of truth for every default: jaxkv.config's fields. The experiments' ConfigDict, the shorthand flags and
docs/reference.md's table of config fields are derived from them; these tests compare."""

import dataclasses
import pathlib
import typing

from absl import flags

from experiments import common
from experiments import tiny
from jaxkv import config as config_lib
from jaxkv.apps import cli

REFERENCE = (pathlib.Path(__file__).parent.parent / "docs" / "reference.md").read_text()


def test_the_reference_holds_the_config_fields_table_as_rendered_from_the_fields():
  table = cli.config_table()
  assert table in REFERENCE, f"docs/reference.md's table of config fields must read:\n{table}"
  for section, cls in config_lib.SECTIONS.items():
    for f in dataclasses.fields(cls):
      assert f"| `--config.{section}.{f.name}` |" in table and f.metadata["help"], (section, f.name)


def test_the_experiments_base_config_holds_each_field_s_default():
  base = common.base_config()
  config = config_lib.from_config_dict(tiny.get_config())
  for section, cls in config_lib.SECTIONS.items():
    assert set(base[section]) == {f.name for f in dataclasses.fields(cls)}, section
    for f in dataclasses.fields(cls):
      assert base[section][f.name] == f.default, (section, f.name)
  model = {f.name for f in dataclasses.fields(config_lib.ModelConfig)} - {"rope_scaling"}
  assert set(base.model) == model | {"use_rope_scaling", "rope_scaling"}
  assert dict(base.model.rope_scaling) == dataclasses.asdict(config_lib.RopeScaling())
  # A config of the base sections and a model is the library's defaults: the CLI and the library build one engine.
  cd = common.base_config()
  cd.model.update({k: v for k, v in dataclasses.asdict(config.model).items() if k != "rope_scaling"})
  assert config_lib.from_config_dict(cd) == config_lib.Config(model=config.model)


def test_each_shorthand_flag_is_its_field():
  for name, (section, field) in cli.SHORTHANDS.items():
    f = next(f for f in dataclasses.fields(config_lib.SECTIONS[section]) if f.name == field)
    flag = flags.FLAGS[name]
    assert flag.default is None and f.metadata["help"] in flag.help, name  # Unset: the config's value applies.
    kind = typing.get_type_hints(config_lib.SECTIONS[section])[field]
    if f.metadata["choices"]:
      assert flag.parser.enum_values == list(f.metadata["choices"]), name
    else:
      assert {bool: "bool", int: "int", str: "string"}.get(kind, "float") == flag.flag_type(), name
  kv_fields = {field for section, field in cli.SHORTHANDS.values() if section == "kv"}
  assert kv_fields == {f.name for f in dataclasses.fields(config_lib.KVConfig)} - {"group_layers", "window_buckets"}


def test_the_pipeline_depth_counts_decode_groups():
  text = config_lib.help_of(config_lib.KVConfig, "pipeline_depth")
  assert "decode group g + D before computing group g" in text and "layer" not in text
