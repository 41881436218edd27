"""Mesh creation, logical axis names and the rules that map them to mesh axes.

Tensor parallelism (Megatron style) over the mesh axis `tensor`: q/k/v and the attention output are split by
heads, the MLP gate/up by columns and down by rows, the LM head by vocabulary, and the KV cache by KV head,
so each device holds (and receives) only its own heads.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

P = jax.sharding.PartitionSpec
NamedSharding = jax.sharding.NamedSharding

TENSOR = "tensor"

# Logical axis names.
BATCH = "batch"
EMBED = "embed"
HEADS = "heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
MLP = "mlp"
VOCAB = "vocab"
CACHE_KV = "cache_kv"  # The K/V pair axis of a cache array.
CACHE_ROWS = "cache_rows"

# Logical axis -> mesh axis (None = replicated).
RULES: dict[str, str | None] = {
    BATCH: None,
    EMBED: None,
    HEADS: TENSOR,
    KV_HEADS: TENSOR,
    HEAD_DIM: None,
    MLP: TENSOR,
    VOCAB: TENSOR,
    CACHE_KV: None,
    CACHE_ROWS: None,
}

# The cache layout, written once: [2 (K, V), batch, kv_heads, rows, head_dim].
CACHE_AXES = (CACHE_KV, BATCH, KV_HEADS, CACHE_ROWS, HEAD_DIM)


def make_mesh(
    axes: Sequence[tuple[str, int]] = ((TENSOR, -1),), devices: Sequence[jax.Device] | None = None
) -> jax.sharding.Mesh:
  """Builds a mesh from ((name, size), ...); one size may be -1 (= the remaining devices).

  Axis types are Auto so that GSPMD propagates shardings (jax >= 0.10 defaults to Explicit).
  """
  devices = list(jax.devices() if devices is None else devices)
  names = [n for n, _ in axes]
  sizes = [int(s) for _, s in axes]
  if TENSOR not in names:
    raise ValueError(f"the mesh needs a {TENSOR!r} axis, got axes {names}")
  if len(set(names)) != len(names):
    raise ValueError(f"duplicate mesh axis names: {names}")
  if sizes.count(-1) > 1:
    raise ValueError(f"at most one mesh axis may be -1, got {dict(axes)}")
  if any(s == 0 or s < -1 for s in sizes):
    raise ValueError(f"mesh axis sizes must be positive or -1, got {dict(axes)}")
  fixed = int(np.prod([s for s in sizes if s != -1]))
  if -1 in sizes:
    if len(devices) % fixed:
      raise ValueError(f"{len(devices)} devices do not divide into mesh axes {dict(axes)}")
    sizes[sizes.index(-1)] = len(devices) // fixed
  total = int(np.prod(sizes))
  if total > len(devices):
    raise ValueError(f"mesh {dict(zip(names, sizes))} needs {total} devices, only {len(devices)} available")
  auto = (jax.sharding.AxisType.Auto,) * len(names)
  return jax.make_mesh(tuple(sizes), tuple(names), axis_types=auto, devices=devices[:total])


def spec(*logical: str | None) -> P:
  """PartitionSpec for a tuple of logical axis names."""
  return P(*(RULES.get(a) if a is not None else None for a in logical))


def sharding(mesh: jax.sharding.Mesh, logical: Sequence[str | None], memory_kind: str = "device") -> NamedSharding:
  """NamedSharding of a logical layout in a memory kind ("device" or "pinned_host")."""
  return NamedSharding(mesh, spec(*logical), memory_kind=memory_kind)


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
  return NamedSharding(mesh, P(), memory_kind="device")


def tensor_size(mesh: jax.sharding.Mesh) -> int:
  return mesh.shape[TENSOR]


def check_divisible(model, mesh: jax.sharding.Mesh) -> None:
  """Fails with a clear error when a sharded dimension does not split over the tensor axis. (num_heads, a multiple of
  num_kv_heads, splits wherever they do.)"""
  t = tensor_size(mesh)
  for what, n in (
      ("num_kv_heads", model.num_kv_heads),
      ("mlp_dim", model.mlp_dim),
      ("vocab_size", model.vocab_size),
  ):
    if n % t:
      raise ValueError(
          f"model.{what} = {n} is not divisible by the tensor axis size {t}; "
          f"choose a tensor axis size that divides {n}"
      )
