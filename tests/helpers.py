"""Shared, cached test fixtures: the tiny config, meshes and weights (compiled functions are shared through
jaxkv.engine's cache, keyed by model config and mesh)."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os

import jax
import pytest

from experiments import tiny
from jaxkv import cache as cache_lib
from jaxkv import config as config_lib
from jaxkv import engine as engine_lib
from jaxkv import host_wait
from jaxkv import mesh as mesh_lib
from jaxkv import model

MESH_SIZES = (1, 2, 4, 8)
# CI (.ci/run exports CI=true) installs everything that tests may need: the C++ compiler and every extra. There a test
# that would skip for a missing one runs instead, and fails.
IN_CI = os.environ.get("CI") == "true"


def unless_installed(missing: bool, reason: str):
  """A skipif marker for a test that needs something optional, which CI installs: never a skip in CI."""
  return pytest.mark.skipif(missing and not IN_CI, reason=reason)


def import_extra(module: str, extra: str):
  """The module, or a skip that names the extra installing it (in CI, which installs every extra: the import)."""
  if IN_CI:
    return importlib.import_module(module)
  return pytest.importorskip(module, reason=f"needs the {extra} extra: pip install -e '.[{extra}]'")


# jaxkv.host_wait's ops are C++ built at first use: their tests need the compiler that kv.host_attention_wait "device"
# needs (g++ or $CXX).
NEEDS_CXX = unless_installed(host_wait.compiler() is None, "no C++ compiler (g++ or $CXX) for jaxkv.host_wait")


@functools.lru_cache(maxsize=None)
def tiny_config(**model_overrides) -> config_lib.Config:
  cd = tiny.get_config()
  cd.model.update(model_overrides)
  return config_lib.from_config_dict(cd)


@functools.lru_cache(maxsize=None)
def mesh(tensor: int) -> jax.sharding.Mesh:
  return mesh_lib.make_mesh((("tensor", tensor),))


@functools.lru_cache(maxsize=None)
def params(tensor: int, seed: int = 0, cfg: config_lib.ModelConfig | None = None):
  cfg = cfg or tiny_config().model
  return model.init_params(cfg, jax.random.key(seed), mesh(tensor))


def engine(
    tensor: int = 1,
    *,
    placement="device",
    depth=1,
    block=None,
    capacity=None,
    chunk=None,
    sampling=None,
    budget_mib=0,
    debug=0,
    kv_dtype="model",
    host_attention=False,
    host_attention_fraction=0.0,
    cfg: config_lib.Config | None = None,
) -> engine_lib.Engine:
  """An engine on the tiny config (or `cfg`) with these kv/engine/sampling fields; weights cached per mesh and
  model config. int8 needs a head_dim that is a multiple of 32: cfg=tiny_config(head_dim=32)."""
  cfg = cfg or tiny_config()
  kv = dataclasses.replace(
      cfg.kv,
      placement=placement,
      pipeline_depth=depth,
      block=block or cfg.kv.block,
      budget_mib=budget_mib,
      transport_debug=debug,
      dtype=kv_dtype,
      host_attention=host_attention,
      host_attention_fraction=host_attention_fraction,
  )
  eng = dataclasses.replace(
      cfg.engine, capacity=capacity or cfg.engine.capacity, prefill_chunk=chunk or cfg.engine.prefill_chunk
  )
  c = dataclasses.replace(cfg, kv=kv, engine=eng, sampling=sampling or cfg.sampling)
  return engine_lib.Engine(c, mesh(tensor), params(tensor, 0, cfg.model))


def prompts(lengths, seed=0, vocab=256):
  import numpy as np  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(seed)
  return [rng.integers(0, vocab, size=n).tolist() for n in lengths]


def with_kv(eng, **fields):
  """The same engine (weights, mesh) with these kv fields replaced."""
  kv = dataclasses.replace(eng.config.kv, **fields)
  return type(eng)(dataclasses.replace(eng.config, kv=kv), eng.mesh, eng.params, eng.layout)


def device_memory(monkeypatch, free_bytes: int) -> None:
  """Every device reports memory stats with `free_bytes` free, as a GPU does (CPU devices report none), so that the
  residency planner and the ring's depth choice size themselves from free device memory."""
  stats = dict(bytes_limit=free_bytes + 2**20, bytes_in_use=2**20)
  monkeypatch.setattr(type(jax.devices()[0]), "memory_stats", lambda self: dict(stats))


def layer_bytes(eng, batch: int) -> int:
  """Bytes per device of one layer's KV at the engine's capacity for `batch` sequences (the planner's unit)."""
  kv = dataclasses.replace(eng.config.kv, placement="device", host_attention=False, host_attention_fraction=0.0)
  probe = cache_lib.KVCache(eng.config.model, kv, eng.mesh, batch, eng.config.engine.capacity)
  return probe.row_bytes(mesh_lib.tensor_size(eng.mesh)) * probe.rows_bound()
