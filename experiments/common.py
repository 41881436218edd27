"""The fields every experiment shares, derived from jaxkv.config's dataclasses (their defaults live there only); each
experiment file sets the model and the sizes that differ."""

import dataclasses
import typing

import ml_collections

from jaxkv import config as config_lib


def _value(cls, f: dataclasses.Field):
  """A field's default as a ConfigDict leaf: a typed placeholder where it is None (ml_collections overrides those
  only with a type: `--config.kv.device_budget_gib=8`), 0 for a required field."""
  kind = typing.get_type_hints(cls)[f.name]
  if f.default is dataclasses.MISSING:
    return kind()
  if f.default is None:
    inner = [t for t in typing.get_args(kind) if t is not type(None)]
    return ml_collections.FieldReference(None, field_type=inner[0])
  return f.default


def section(cls, skip: tuple[str, ...] = ()) -> ml_collections.ConfigDict:
  """The ConfigDict of a config dataclass: each field (but `skip`) with its default."""
  return ml_collections.ConfigDict({f.name: _value(cls, f) for f in dataclasses.fields(cls) if f.name not in skip})


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.model = section(config_lib.ModelConfig, skip=("rope_scaling",))
  # Experiment files keep the scaling fields overridable and switch them on with use_rope_scaling.
  c.model.rope_scaling = section(config_lib.RopeScaling)
  c.model.use_rope_scaling = False
  for name, cls in config_lib.SECTIONS.items():
    c[name] = section(cls)
  c.mesh = ml_collections.ConfigDict(dict(config_lib.DEFAULT_MESH))
  return c


def check_variant(name: str, arg, variants: tuple[str, ...] = ()) -> None:
  """An experiment's `get_config(arg)` takes no arg or one of `variants` (`--config=experiments/NAME.py:VARIANT`)."""
  if arg not in (None, "", *variants):
    takes = f"no variant or one of: {', '.join(variants)}" if variants else "no variant"
    raise ValueError(f"experiments/{name}.py has no variant {arg!r}: it takes {takes}")
