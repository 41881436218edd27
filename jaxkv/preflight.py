"""The checks that run before any weights are built or read, against the model that will run.

`resolve` turns a config (and a checkpoint folder's config.json and weight-file headers, when one is given) into a
`Job`: the config with the model that will run, its mesh and layout. On the way it checks everything that depends on
that model (the KV dtype against head_dim, the tensor axis against the heads, KV heads, MLP width and vocabulary, the
layer split against the layer count), the KV device budget against the devices' memory, and the checkpoint's
tensors. `check_prompts` checks the prompts against the capacity and the model's positions. Each failure is an
`InputError`, a ValueError that the apps print as one line with an exit status (jaxkv.cli).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Sequence

import jax

from jaxkv import checkpoint
from jaxkv import gguf_loader
from jaxkv import config as config_lib
from jaxkv import engine as engine_lib
from jaxkv import layout as layout_lib
from jaxkv import mesh as mesh_lib

USAGE = 2  # Exit status: the command (flags, config) must change.
FAILURE = 1  # Exit status: the run failed on its input (a broken checkpoint, processes that did not join).


class InputError(ValueError):
  """A problem with the user's input: the apps print `message` (and `hint`) without a traceback and exit with
  `status`."""

  def __init__(self, message: str, hint: str | None = None, status: int = USAGE):
    super().__init__(message)
    self.hint, self.status = hint, status


@contextlib.contextmanager
def input_errors(status: int = USAGE, hint: str | None = None):
  """The ValueErrors of the library's checks inside become InputErrors."""
  try:
    yield
  except InputError:
    raise
  except ValueError as e:
    raise InputError(str(e), hint, status) from e


@dataclasses.dataclass(frozen=True, eq=False)
class Job:
  """config: with the model that will run (the checkpoint's when one is given); mesh and layout: where it runs;
  max_positions: the checkpoint's max_position_embeddings (None = not known)."""

  config: config_lib.Config
  mesh: jax.sharding.Mesh
  layout: layout_lib.Layout
  max_positions: int | None = None


def layout(config: config_lib.Config, mesh: jax.sharding.Mesh) -> layout_lib.Layout:
  """The layout of config.split over the devices of `mesh` (ValueError when the split does not fit the layers)."""
  split = layout_lib.parse_layer_split(config.split.layer_split)
  return layout_lib.make_layout(config.split.mode, mesh, config.model.num_layers, split)


def resolve(config_dict, checkpoint_dir: str | None = None, dtype: str | None = None, gguf: str | None = None) -> Job:
  """The checked Job of an experiment ConfigDict (or a Config), with the model of `checkpoint_dir` (its
  config.json; dtype overrides its torch_dtype) or of the GGUF file `gguf` (its metadata; dtype default bfloat16)
  when given. Reads no weights."""
  model, max_positions = None, None
  if checkpoint_dir or gguf:
    with input_errors(FAILURE):
      if gguf:
        hf = gguf_loader.hf_config(gguf_loader.open_reader(gguf))
        model = checkpoint.model_config(hf, dtype or "bfloat16")
      else:
        hf = checkpoint.read_config(checkpoint_dir)
        model = checkpoint.model_config(hf, dtype)
    max_positions = hf.get("max_position_embeddings")
  with input_errors():
    if isinstance(config_dict, config_lib.Config):
      config = dataclasses.replace(config_dict, model=model or config_dict.model)
    else:
      config = config_lib.from_config_dict(config_dict, model)
    mesh = mesh_lib.make_mesh(config.mesh)
    lay = layout(config, mesh)
    for m in lay.meshes:
      mesh_lib.check_divisible(config.model, m)
    check_device_budget(
        config.kv.device_budget_gib, [d for d in lay.devices() if d.process_index == jax.process_index()]
    )
  if checkpoint_dir:
    with input_errors(FAILURE):
      checkpoint.check(checkpoint_dir, config.model)
  return Job(config, mesh, lay, int(max_positions) if max_positions else None)


def device_memory(devices: Sequence[jax.Device]) -> tuple[int, str]:
  """(bytes, what they are): the memory of the smallest device, or for CPU devices, which share the host's memory,
  the host's memory over their number."""
  limits = [(d.memory_stats() or {}).get("bytes_limit") for d in devices]
  if limits and None not in limits:
    return min(limits), "the memory of the smallest device"
  host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  return host // max(len(devices), 1), f"the host's memory over its {len(devices)} devices"


def check_device_budget(budget_gib: float | None, devices: Sequence[jax.Device]) -> None:
  """kv.device_budget_gib must fit the memory of the devices (this process's)."""
  if budget_gib is None:
    return
  memory, what = device_memory(devices)
  if budget_gib * 2**30 > memory:
    raise ValueError(
        f"kv.device_budget_gib={budget_gib:g} is more than {what} ({memory / 2**30:.1f} GiB); lower it, or leave it "
        "unset for the free device memory"
    )


def check_prompts(job: Job, prompts: Sequence[Sequence[int]], max_new_tokens: int, zero_rows: int = 0) -> None:
  """Prompts and max_new_tokens against the capacity, the vocabulary and the model's positions."""
  with input_errors():
    engine_lib.check_input(job.config, prompts, max_new_tokens, zero_rows)
  last = max(len(p) for p in prompts) + max_new_tokens - 1
  if job.max_positions is not None and last > job.max_positions:
    raise InputError(
        f"the longest prompt plus max_new_tokens needs {last} positions, more than the model's "
        f"max_position_embeddings ({job.max_positions}, {checkpoint.CONFIG_FILE})",
        "shorten the prompts or lower --max_new_tokens",
    )
