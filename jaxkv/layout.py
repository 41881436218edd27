"""Where each layer runs: the split modes `none`, `tensor` and `layer`.

  none:   one device; every layer on a mesh of that device.
  tensor: every layer on the whole mesh, its heads split over the `tensor` axis (jaxkv.mesh).
  layer:  contiguous layer ranges on the devices of the mesh (llama.cpp's `-sm layer`), evenly or in given
          proportions; each range is a stage with a one-device mesh. A layer's weights and KV live only on its
          stage's device; the hidden state moves to the next stage at a range boundary (an explicit transfer).

A Layout is shared by the weights (jaxkv.model.init_params), the cache (its per-layer shardings) and the engine
(one set of compiled functions per stage mesh). Every layer runs the same per-layer function in every mode, so
split mode layer gives the bits of split mode none.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxkv import mesh as mesh_lib
from jaxkv.config import SPLIT_MODES


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
  """meshes: one per stage; stage_of[l]: the stage of layer l; mode: a SPLIT_MODES entry."""

  meshes: tuple[jax.sharding.Mesh, ...]
  stage_of: tuple[int, ...]
  mode: str

  def mesh(self, layer: int) -> jax.sharding.Mesh:
    return self.meshes[self.stage_of[layer]]

  @property
  def first(self) -> jax.sharding.Mesh:
    """The stage of layer 0 (and of the embedding)."""
    return self.meshes[self.stage_of[0]]

  @property
  def last(self) -> jax.sharding.Mesh:
    """The stage of the last layer (and of the head)."""
    return self.meshes[self.stage_of[-1]]

  def devices(self) -> list[jax.Device]:
    return [d for m in self.meshes for d in m.devices.flat]

  def summary(self) -> dict:
    return dict(
        split_mode=self.mode,
        stages=[[str(d) for d in m.devices.flat] for m in self.meshes],
        layers_per_stage=[self.stage_of.count(s) for s in range(len(self.meshes))],
    )


def parse_layer_split(text: str) -> tuple[float, ...]:
  """ "55,45" -> (55.0, 45.0); "" -> () (even). ValueError for values that do not parse or are not positive."""
  if not text.strip():
    return ()
  try:
    values = tuple(float(v) for v in text.split(","))
  except ValueError as e:
    raise ValueError(f"layer_split must be comma-separated numbers like 55,45; got {text!r}") from e
  if any(not np.isfinite(v) or v <= 0 for v in values):
    raise ValueError(f"layer_split values must be positive, got {text!r}")
  return values


def layer_stages(num_layers: int, stages: int, proportions: tuple[float, ...] = ()) -> tuple[int, ...]:
  """Stage of each layer: contiguous ranges whose sizes follow `proportions` (default even), rounded at the
  cumulative boundaries. ValueError when the proportions do not match the stages or leave a stage empty."""
  p = np.asarray(proportions or (1.0,) * stages, np.float64)
  if len(p) != stages:
    raise ValueError(f"layer_split has {len(p)} values for {stages} devices; give one per device")
  bounds = np.rint(np.cumsum(p) / p.sum() * num_layers).astype(int)
  sizes = np.diff(np.concatenate([[0], bounds]))
  if (sizes < 1).any():
    raise ValueError(
        f"layer_split {tuple(p.tolist())} gives {num_layers} layers as {sizes.tolist()} over {stages} devices: "
        "every device needs at least one layer"
    )
  return tuple(int(s) for s, n in enumerate(sizes) for _ in range(n))


def one_device_mesh(device: jax.Device) -> jax.sharding.Mesh:
  return jax.sharding.Mesh(np.array([device]), (mesh_lib.TENSOR,), axis_types=(jax.sharding.AxisType.Auto,))


def make_layout(mode: str, mesh: jax.sharding.Mesh, num_layers: int, proportions: tuple[float, ...] = ()) -> Layout:
  """The layout of a split mode over the devices of `mesh` (the experiment's mesh)."""
  if mode not in SPLIT_MODES:
    raise ValueError(f"split mode must be one of {', '.join(SPLIT_MODES)}; got {mode!r}")
  if proportions and mode != "layer":
    raise ValueError(f"layer_split applies to split mode layer only (split mode is {mode!r})")
  if mode == "tensor":
    return Layout((mesh,), (0,) * num_layers, mode)
  devices = list(mesh.devices.flat)
  if mode == "none":
    return Layout((one_device_mesh(devices[0]),), (0,) * num_layers, mode)
  stages = layer_stages(num_layers, len(devices), proportions)
  return Layout(tuple(one_device_mesh(d) for d in devices), stages, mode)
