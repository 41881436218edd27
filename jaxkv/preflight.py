"""The checks that run before any weights are built or read, against the model that will run.

`resolve` turns a config (and a checkpoint folder's config.json and weight-file headers, or a GGUF file's metadata,
when one is given) into a `Job`: the config with the model that will run and the checkpoint's end-of-sequence ids, its
mesh and layout. On the way it checks everything that depends on that model (the KV dtype against head_dim, the tensor
axis against the heads, KV heads, MLP width and vocabulary, the layer split against the layer count), the KV device
budget against the devices' memory, and the checkpoint's tensors. `check_prompts` checks the prompts against the
capacity and the model's positions, and on CPU devices the weights and the cache against the host's RAM. Each failure
is an `InputError`, a ValueError that the apps print as one line with an exit status (jaxkv.apps.cli).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxkv import cache as cache_lib
from jaxkv import checkpoint
from jaxkv import gguf_loader
from jaxkv import config as config_lib
from jaxkv import engine as engine_lib
from jaxkv import layout as layout_lib
from jaxkv import mesh as mesh_lib
from jaxkv import self_draft
from jaxkv import tokenizer as tokenizer_lib
from jaxkv.host import memory

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


def checkpoint_model(
    checkpoint_dir: str | None, dtype: str | None = None, gguf: str | None = None
) -> tuple[config_lib.ModelConfig, int | None]:
  """(the model, its max_position_embeddings or None) of a checkpoint folder's config.json (dtype overrides its
  torch_dtype) or of a GGUF file's metadata (dtype default bfloat16). Reads no weights and starts no JAX backend:
  the apps size the simulated CPU devices by it. InputError (exit status 1) for a file that cannot be read."""
  with input_errors(FAILURE):
    if gguf:
      hf = gguf_loader.hf_config(gguf_loader.open_reader(gguf))
      model = checkpoint.model_config(hf, dtype or "bfloat16")
    else:
      hf = checkpoint.read_config(checkpoint_dir)
      model = checkpoint.model_config(hf, dtype)
  positions = hf.get("max_position_embeddings")
  return model, int(positions) if positions else None


def checkpoint_eos_ids(checkpoint_dir: str | None, gguf: str | None = None) -> frozenset[int]:
  """The ids that end a checkpoint's sequences: its eos_token_id (generation_config.json or config.json; the GGUF's
  tokenizer.ggml.eos_token_id) and the end-of-turn token of its chat template (where it has a tokenizer)."""
  with input_errors(FAILURE):
    if gguf:
      return gguf_loader.eos_ids(gguf)
    ids = checkpoint.eos_ids(checkpoint_dir)
  try:
    turn = tokenizer_lib.Tokenizer.from_dir(checkpoint_dir).end_of_turn_id()
  except ValueError:  # No tokenizer.json (or none that loads), or a template that does not parse: the ids above.
    turn = None
  return frozenset(ids | ({turn} if turn is not None else set()))


def resolve(
    config_dict,
    checkpoint_dir: str | None = None,
    dtype: str | None = None,
    gguf: str | None = None,
    *,
    eos: bool = True,
) -> Job:
  """The checked Job of an experiment ConfigDict (or a Config; None: the library's defaults), with the model of
  `checkpoint_dir` (its config.json; dtype overrides its torch_dtype) or of the GGUF file `gguf` (its metadata; dtype
  default bfloat16) when given, and then, with `eos`, the checkpoint's end-of-sequence ids added to
  sampling.eos_ids. Reads no weights."""
  model, max_positions = None, None
  if checkpoint_dir or gguf:
    model, max_positions = checkpoint_model(checkpoint_dir, dtype, gguf)
  with input_errors():
    if config_dict is None:  # The library's defaults around the checkpoint's model.
      if model is None:
        raise ValueError("give a config, or a checkpoint whose model the library's defaults run")
      config = config_lib.Config(model=model)
    elif isinstance(config_dict, config_lib.Config):
      config = dataclasses.replace(config_dict, model=model or config_dict.model)
    else:
      config = config_lib.from_config_dict(config_dict, model)
    if model is not None and eos:
      ids = tuple(sorted(set(config.sampling.eos_ids) | checkpoint_eos_ids(checkpoint_dir, gguf)))
      config = dataclasses.replace(config, sampling=dataclasses.replace(config.sampling, eos_ids=ids))
    mesh = mesh_lib.make_mesh(config.mesh)
    lay = layout(config, mesh)
  cpu = jax.default_backend() == "cpu"
  n = cpu_devices(config.model, len(jax.devices()))
  with input_errors(hint=f"--cpu_devices={n} simulates {n} CPU devices, which divide it" if cpu else None):
    for m in lay.meshes:
      mesh_lib.check_divisible(config.model, m)
  with input_errors():
    check_device_budget(
        config.kv.device_budget_gib, [d for d in lay.devices() if d.process_index == jax.process_index()]
    )
  if checkpoint_dir:
    with input_errors(FAILURE):
      checkpoint.check(checkpoint_dir, config.model)
  job = Job(config, mesh, lay, max_positions)
  check_host_memory(job)
  return job


def cpu_devices(model: config_lib.ModelConfig, most: int) -> int:
  """The most devices, up to `most`, that split the model over a tensor axis (its KV heads, MLP width and
  vocabulary; the heads are a multiple of the KV heads)."""
  return max(
      n for n in range(1, max(most, 1) + 1) if not (model.num_kv_heads % n or model.mlp_dim % n or model.vocab_size % n)
  )


def check_host_memory(job: Job, batch: int = 0) -> None:
  """On CPU devices, which keep the weights and the cache in the host's RAM: this process's share of the weights,
  and of the cache of `batch` sequences at full capacity, must fit the RAM available (MemAvailable), else InputError
  with the bytes needed, before anything is allocated."""
  available = memory.available_host_bytes()
  if jax.default_backend() != "cpu" or available is None:
    return
  m, cfg = job.config.model, job.config
  weights = m.num_params() * jnp.dtype(m.dtype).itemsize
  rows = -(-cfg.engine.capacity // cfg.kv.block) * cfg.kv.block
  kv = batch * cache_lib.row_bytes(m, cfg.kv.dtype, 1) * rows * m.num_layers
  need = (weights + kv) // jax.process_count()
  if need > available:
    what = (
        f" and the KV cache of {batch} sequences at capacity {cfg.engine.capacity} ({kv / 1e9:.2f} GB)" if batch else ""
    )
    raise InputError(
        f"the model's weights ({weights / 1e9:.2f} GB: {m.num_params():,} parameters in {m.dtype}){what} need "
        f"{need / 2**30:.2f} GiB of host RAM on CPU devices, but this host has {available / 2**30:.2f} GiB available",
        "run on GPUs (--cpu_devices=0), or a smaller model, batch or --capacity",
    )


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
  """Prompts and max_new_tokens against the capacity, the vocabulary and the model's positions; with
  --speculate=self, its draft cache against the devices' free memory; on CPU devices the weights and their cache
  against the host's RAM."""
  with input_errors():
    engine_lib.check_input(job.config, prompts, max_new_tokens, zero_rows)
    if job.config.speculate.mode == "self":
      self_draft.check_fits(job.config, job.layout, len(prompts))
  last = max(len(p) for p in prompts) + max_new_tokens - 1
  if job.max_positions is not None and last > job.max_positions:
    raise InputError(
        f"the longest prompt plus max_new_tokens needs {last} positions, more than the model's "
        f"max_position_embeddings ({job.max_positions}: config.json's, a GGUF's context_length)",
        "shorten the prompts or lower --max_new_tokens",
    )
  check_host_memory(job, len(prompts))
