"""Hugging Face checkpoints of LlamaForCausalLM and Qwen3ForCausalLM, read straight into jaxkv's sharded layout.

A checkpoint folder holds config.json and the weights as model.safetensors, or as shards listed by
model.safetensors.index.json. `load` checks the whole checkpoint (architecture, options, tensor names, shapes,
dtypes, divisibility by the tensor axis) before it creates any array. Then, per parameter,
`jax.make_array_from_callback` builds the HF tensor sharded along the axis that becomes the parameter's sharded axis:
the callback of each device reads only that device's block of the memory-mapped file (safetensors `get_slice`), so
the model is never materialised whole, let alone once per device. A jitted reshape/transpose/cast then turns each
device's block into its shard of the jaxkv parameter, in place on that device (no data moves between devices).

HF tensor [shape]                                 -> jaxkv parameter [shape]
  model.embed_tokens.weight [V, D]                -> embed [V, D]
  model.layers.{l}.input_layernorm.weight [D]     -> attn_norm [D]
  ...self_attn.q_proj.weight [H * Dh, D]          -> wq [D, H, Dh]
  ...self_attn.k_proj.weight, v_proj [K * Dh, D]  -> wk, wv [D, K, Dh]
  ...self_attn.o_proj.weight [D, H * Dh]          -> wo [H, Dh, D]
  ...self_attn.q_norm.weight, k_norm [Dh]         -> q_norm, k_norm [Dh]  (Qwen3)
  ...post_attention_layernorm.weight [D]          -> mlp_norm [D]
  ...mlp.gate_proj.weight, up_proj [F, D]         -> w_gate, w_up [D, F]
  ...mlp.down_proj.weight [D, F]                  -> w_down [F, D]
  model.norm.weight [D]                           -> final_norm [D]
  lm_head.weight [V, D]                           -> lm_head [D, V]  (absent, and ignored, when tied)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from safetensors import safe_open

from jaxkv import mesh as mesh_lib
from jaxkv import model
from jaxkv.config import ModelConfig, RopeScaling

ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM")
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
DTYPES = ("bfloat16", "float16", "float32")
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype -> numpy dtype of the values on disk (bfloat16 is ml_dtypes', through jax.numpy).
_DISK_DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": np.dtype(jnp.bfloat16)}


def read_config(checkpoint_dir: str) -> dict:
  """The checkpoint's config.json as a dict."""
  if not os.path.isdir(checkpoint_dir):
    raise ValueError(f"checkpoint directory {checkpoint_dir!r} does not exist")
  path = os.path.join(checkpoint_dir, CONFIG_FILE)
  if not os.path.isfile(path):
    raise ValueError(f"checkpoint directory {checkpoint_dir!r} has no {CONFIG_FILE}")
  try:
    with open(path) as f:
      hf = json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path} is not valid JSON: {e}") from e
  if not isinstance(hf, dict):
    raise ValueError(f"{path} does not hold a JSON object")
  return hf


def eos_ids(checkpoint_dir: str) -> frozenset[int]:
  """A checkpoint's end of sequence ids: generation_config.json's eos_token_id (an id or a list, as Llama-3 Instruct
  lists <|end_of_text|> and <|eot_id|>), else config.json's."""
  for name in (GENERATION_CONFIG_FILE, CONFIG_FILE):
    path = os.path.join(checkpoint_dir, name)
    if os.path.isfile(path):
      with open(path) as f:
        ids = json.load(f).get("eos_token_id")
      if ids is not None:
        return frozenset([ids] if isinstance(ids, int) else ids)
  return frozenset()


def architecture(hf: dict) -> str:
  """The supported architecture that a config.json names, or ValueError."""
  archs = hf.get("architectures")
  if archs is None and hf.get("model_type") in _MODEL_TYPES:
    archs = [_MODEL_TYPES[hf["model_type"]]]
  if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in ARCHITECTURES:
    raise ValueError(
        f"unsupported architecture {archs!r} (model_type {hf.get('model_type')!r}) in {CONFIG_FILE}; "
        f"jaxkv reads {', '.join(ARCHITECTURES)}"
    )
  return archs[0]


def _rope(hf: dict) -> tuple[float, RopeScaling | None]:
  """(rope_theta, scaling) from `rope_theta` + `rope_scaling` (transformers 4) or `rope_parameters` (5)."""
  params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
    raise ValueError(f"unsupported rope parameters {params!r}: jaxkv reads one set for every layer")
  theta = params.get("rope_theta", hf.get("rope_theta", 10_000.0))  # rope_parameters' own wins.
  factor = hf.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
  if factor != 1.0:
    raise ValueError(f"unsupported partial_rotary_factor {factor}: jaxkv rotates the whole head")
  kind = params.get("rope_type", params.get("type", "default"))
  if kind == "default":
    return float(theta), None
  if kind not in ("llama3", "yarn"):
    raise ValueError(
        f"unsupported rope scaling type {kind!r}: jaxkv reads 'default' (none), 'llama3' (Llama-3.1) and 'yarn' "
        "(Qwen3)"
    )
  original = params.get("original_max_position_embeddings")
  if original is None:
    raise ValueError(f"{kind} rope scaling without 'original_max_position_embeddings': {params!r}")
  factor = params.get("factor")
  if kind == "yarn" and factor is None and hf.get("max_position_embeddings"):  # As transformers.
    factor = hf["max_position_embeddings"] / original
  common = dict(rope_type=kind, original_max_position=int(original))
  try:
    if kind == "llama3":
      scaling = RopeScaling(
          factor=float(params["factor"]),
          low_freq_factor=float(params["low_freq_factor"]),
          high_freq_factor=float(params["high_freq_factor"]),
          **common,
      )
    else:
      if factor is None:
        raise KeyError("factor")
      optional = {
          k: float(params[k]) for k in ("mscale", "mscale_all_dim", "attention_factor") if params.get(k) is not None
      }
      scaling = RopeScaling(
          factor=float(factor),
          beta_fast=float(params.get("beta_fast") or 32.0),
          beta_slow=float(params.get("beta_slow") or 1.0),
          truncate=bool(params.get("truncate", True)),
          **optional,
          **common,
      )
  except KeyError as e:
    raise ValueError(f"{kind} rope scaling without {e.args[0]!r}: {params!r}") from e
  return float(theta), scaling


def _reject_unsupported(hf: dict) -> None:
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise ValueError(f"unsupported hidden_act {act!r}: jaxkv's MLP is SwiGLU (silu)")
  for flag in ("attention_bias", "mlp_bias"):
    if hf.get(flag):
      raise ValueError(f"unsupported {flag}=true: jaxkv's projections have no bias")
  if hf.get("use_sliding_window"):
    raise ValueError(
        f"unsupported use_sliding_window=true (sliding_window {hf.get('sliding_window')}): jaxkv attends to every "
        "row"
    )
  other = sorted(set(hf.get("layer_types") or ()) - {"full_attention"})
  if other:
    raise ValueError(f"unsupported layer_types {other}: jaxkv has full attention in every layer")
  if hf.get("quantization_config"):
    method = hf["quantization_config"].get("quant_method", "?")
    raise ValueError(f"unsupported quantized checkpoint (quant_method {method!r}): jaxkv reads bf16/f16/f32 weights")


def model_config(hf: dict, dtype: str | None = None) -> ModelConfig:
  """The ModelConfig of a config.json dict. dtype None = its torch_dtype (or dtype), else bfloat16."""
  architecture(hf)
  _reject_unsupported(hf)
  missing = [
      k
      for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
      if hf.get(k) is None
  ]
  if missing:
    raise ValueError(f"{CONFIG_FILE} lacks {', '.join(missing)}")
  d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
  head_dim = hf.get("head_dim")
  if head_dim is None:
    if d % heads:
      raise ValueError(f"{CONFIG_FILE} has no head_dim and hidden_size {d} is not a multiple of {heads} heads")
    head_dim = d // heads
  if dtype is None:
    dtype = hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"
    if dtype not in DTYPES:
      raise ValueError(f"{CONFIG_FILE} has dtype {dtype!r}; pass one of {DTYPES} as the dtype")
  else:
    dtype = jnp.dtype(dtype).name
    if dtype not in DTYPES:
      raise ValueError(f"dtype {dtype!r} is not one of {DTYPES}")
  theta, scaling = _rope(hf)
  return ModelConfig(
      vocab_size=int(hf["vocab_size"]),
      d_model=d,
      num_layers=int(hf["num_hidden_layers"]),
      num_heads=heads,
      num_kv_heads=int(hf.get("num_key_value_heads") or heads),
      head_dim=int(head_dim),
      mlp_dim=int(hf["intermediate_size"]),
      rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
      rope_theta=theta,
      rope_scaling=scaling,
      qk_norm=architecture(hf) == "Qwen3ForCausalLM",
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      dtype=dtype,
  )


@dataclasses.dataclass(frozen=True)
class _Spec:
  """How one jaxkv parameter comes from one HF tensor: the HF tensor of shape `hf_shape` is reshaped to `view`
  (at most one axis split in two: heads * head_dim) and transposed by `perm`: param = view.transpose(perm)."""

  name: str
  hf_shape: tuple[int, ...]
  view: tuple[int, ...]
  perm: tuple[int, ...]

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.view[p] for p in self.perm)

  @property
  def split(self) -> int | None:
    """The HF axis split into view axes (split, split + 1), or None."""
    if len(self.view) == len(self.hf_shape):
      return None
    return next(i for i, (n, m) in enumerate(zip(self.hf_shape, self.view)) if n != m)


def hf_specs(cfg: ModelConfig) -> dict:
  """{jaxkv parameter path: _Spec}, paths like ("embed",) and ("layers", 0, "wq"), in param_axes' structure."""
  d, h, k, dh, f, v = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim, cfg.vocab_size

  def same(name, shape):
    return _Spec(name, shape, shape, tuple(range(len(shape))))

  specs = {("embed",): same("model.embed_tokens.weight", (v, d)), ("final_norm",): same("model.norm.weight", (d,))}
  if not cfg.tie_embeddings:
    specs[("lm_head",)] = _Spec("lm_head.weight", (v, d), (v, d), (1, 0))
  for l in range(cfg.num_layers):
    p = f"model.layers.{l}."
    layer = {
        "attn_norm": same(p + "input_layernorm.weight", (d,)),
        "wq": _Spec(p + "self_attn.q_proj.weight", (h * dh, d), (h, dh, d), (2, 0, 1)),
        "wk": _Spec(p + "self_attn.k_proj.weight", (k * dh, d), (k, dh, d), (2, 0, 1)),
        "wv": _Spec(p + "self_attn.v_proj.weight", (k * dh, d), (k, dh, d), (2, 0, 1)),
        "wo": _Spec(p + "self_attn.o_proj.weight", (d, h * dh), (d, h, dh), (1, 2, 0)),
        "mlp_norm": same(p + "post_attention_layernorm.weight", (d,)),
        "w_gate": _Spec(p + "mlp.gate_proj.weight", (f, d), (f, d), (1, 0)),
        "w_up": _Spec(p + "mlp.up_proj.weight", (f, d), (f, d), (1, 0)),
        "w_down": _Spec(p + "mlp.down_proj.weight", (d, f), (d, f), (1, 0)),
    }
    if cfg.qk_norm:
      layer["q_norm"] = same(p + "self_attn.q_norm.weight", (dh,))
      layer["k_norm"] = same(p + "self_attn.k_norm.weight", (dh,))
    specs.update({("layers", l, name): s for name, s in layer.items()})
  return specs


def hf_sharding(spec: _Spec, target: jax.sharding.NamedSharding) -> jax.sharding.NamedSharding:
  """The sharding of the HF-layout tensor whose relayout gives `target` without moving data between devices:
  the HF axis that becomes the parameter's sharded axis is split the same way (q_proj's rows by heads, o_proj's
  columns by heads, gate/up's rows, down's and lm_head's columns...)."""
  target_axes = tuple(target.spec) + (None,) * (len(spec.perm) - len(target.spec))
  view_axes = [None] * len(spec.view)
  for i, mesh_axis in enumerate(target_axes):
    view_axes[spec.perm[i]] = mesh_axis
  a = spec.split
  if a is not None:
    if view_axes[a + 1] is not None:
      raise ValueError(f"{spec.name}: the sharding rules split head_dim, which a local relayout cannot follow")
    view_axes = view_axes[: a + 1] + view_axes[a + 2 :]
  return jax.sharding.NamedSharding(target.mesh, mesh_lib.P(*view_axes), memory_kind=target.memory_kind)


@functools.lru_cache(maxsize=None)
def _relayout(view: tuple, perm: tuple, dtype: np.dtype, out_sharding: jax.sharding.NamedSharding):
  """Jitted HF layout -> jaxkv layout on the devices: reshape, transpose, cast. Each device keeps its own rows."""
  return jax.jit(lambda x: x.reshape(view).transpose(perm).astype(dtype), out_shardings=out_sharding)


class _Weights:
  """The checkpoint's safetensors files, opened (memory-mapped) for the duration of a load."""

  def __init__(self, checkpoint_dir: str, stack: contextlib.ExitStack):
    self.dir = checkpoint_dir
    self.tensors: dict[str, tuple[str, tuple[int, ...], str]] = {}  # name -> (file, shape, safetensors dtype)
    self._files: dict[str, object] = {}
    index_path = os.path.join(checkpoint_dir, INDEX_FILE)
    if os.path.isfile(index_path):
      try:
        with open(index_path) as f:
          weight_map = json.load(f)["weight_map"]
      except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{index_path} has no readable weight_map: {e!r}") from e
    elif os.path.isfile(os.path.join(checkpoint_dir, WEIGHTS_FILE)):
      weight_map = None
    else:
      others = sorted(n for n in os.listdir(checkpoint_dir) if n.endswith((".bin", ".pt", ".pth", ".gguf")))
      hint = f" (found {', '.join(others)}: convert them to safetensors)" if others else ""
      raise ValueError(f"checkpoint directory {checkpoint_dir!r} has no {WEIGHTS_FILE} or {INDEX_FILE}{hint}")
    files = sorted(set(weight_map.values())) if weight_map is not None else [WEIGHTS_FILE]
    absent = [n for n in files if not os.path.isfile(os.path.join(checkpoint_dir, n))]
    if absent:
      raise ValueError(f"{INDEX_FILE} in {checkpoint_dir!r} lists weight files that are missing: {', '.join(absent)}")
    for file in files:
      try:
        handle = stack.enter_context(safe_open(os.path.join(checkpoint_dir, file), framework="numpy"))
      except Exception as e:  # safetensors raises its own error types for a bad header.
        raise ValueError(f"cannot read {os.path.join(checkpoint_dir, file)} as safetensors: {e}") from e
      self._files[file] = handle
      for name in handle.keys():
        if weight_map is None or weight_map.get(name) == file:
          sl = handle.get_slice(name)
          self.tensors[name] = (file, tuple(sl.get_shape()), sl.get_dtype())
    if weight_map is not None:
      lost = sorted(n for n in weight_map if n not in self.tensors)
      if lost:
        raise ValueError(f"{INDEX_FILE} lists tensors that are not in their files: {', '.join(lost[:5])}")

  def check(self, specs: dict, cfg: ModelConfig) -> None:
    """Every tensor present with its shape and a float dtype; no tensor the config does not account for."""
    for spec in specs.values():
      if spec.name not in self.tensors:
        raise ValueError(f"checkpoint {self.dir!r} has no tensor {spec.name} (expected shape {spec.hf_shape})")
      _, shape, dt = self.tensors[spec.name]
      if shape != spec.hf_shape:
        raise ValueError(
            f"tensor {spec.name} has shape {shape}, expected {spec.hf_shape} from {CONFIG_FILE} "
            f"(hidden {cfg.d_model}, heads {cfg.num_heads}, kv heads {cfg.num_kv_heads}, head_dim {cfg.head_dim}, "
            f"intermediate {cfg.mlp_dim}, vocab {cfg.vocab_size})"
        )
      if dt not in _DISK_DTYPES:
        raise ValueError(f"tensor {spec.name} has dtype {dt}; jaxkv reads {', '.join(_DISK_DTYPES)}")
    for name in self.tensors:
      m = re.match(r"model\.layers\.(\d+)\.", name)
      if m and int(m.group(1)) >= cfg.num_layers:
        raise ValueError(f"tensor {name} is beyond num_hidden_layers = {cfg.num_layers} in {CONFIG_FILE}")
      if m and name.endswith(".bias"):
        raise ValueError(f"unsupported tensor {name}: jaxkv's projections have no bias")

  def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
    file, _, dt = self.tensors[name]
    sl = self._files[file].get_slice(name)
    try:
      return sl[index]
    except TypeError:  # A safetensors without numpy bfloat16: read the raw bytes instead.
      if dt != "BF16":
        raise
      return np.ascontiguousarray(read_raw(os.path.join(self.dir, file), name)[index])


def read_raw(path: str, name: str) -> np.ndarray:
  """A memory-mapped view of one tensor of a safetensors file (8-byte header size, JSON header, data)."""
  with open(path, "rb") as f:
    n = int.from_bytes(f.read(8), "little")
    entry = json.loads(f.read(n))[name]
  begin, _ = entry["data_offsets"]
  return np.memmap(path, _DISK_DTYPES[entry["dtype"]], "r", offset=8 + n + begin, shape=tuple(entry["shape"]))


def check(checkpoint_dir: str, cfg: ModelConfig) -> None:
  """Checks the weight files against `cfg` (tensor names, shapes, dtypes) from their headers, reading no weights."""
  with contextlib.ExitStack() as stack:
    _Weights(checkpoint_dir, stack).check(hf_specs(cfg), cfg)


def load(
    checkpoint_dir: str, mesh: jax.sharding.Mesh, dtype: str | None = None, layout=None
) -> tuple[ModelConfig, dict]:
  """Reads a Hugging Face LlamaForCausalLM / Qwen3ForCausalLM checkpoint onto `mesh`.

  Args:
    checkpoint_dir: a folder with config.json and model.safetensors or model.safetensors.index.json + shards.
    mesh: the mesh with a `tensor` axis that the parameters are sharded over (jaxkv.mesh rules).
    dtype: "bfloat16", "float16" or "float32"; None = config.json's torch_dtype, else bfloat16.
    layout: a jaxkv.layout.Layout: each layer on its stage's mesh, the top (embedding, final norm, head) on the first
      stage's, as jaxkv.model.init_params places them; None = every parameter on `mesh`.

  Returns:
    (ModelConfig, params) with params in jaxkv.model's structure and sharded layout.

  Raises:
    ValueError, naming what is wrong, before any array is created: a missing folder, config.json or weight file,
    an unsupported architecture or option, a missing tensor, a shape mismatch, a dimension that the tensor axis
    does not divide. An error while reading deletes the arrays made so far.
  """
  t0 = time.perf_counter()
  hf = read_config(checkpoint_dir)
  cfg = model_config(hf, dtype)
  for m in [mesh] if layout is None else layout.meshes:
    mesh_lib.check_divisible(cfg, m)
  with contextlib.ExitStack() as stack:
    weights = _Weights(checkpoint_dir, stack)
    specs = hf_specs(cfg)
    weights.check(specs, cfg)
    params = place(cfg, mesh, specs, weights.read, layout)
  logging.info(
      "loaded %s (%s, %d layers, %s) from %s in %.1f s",
      architecture(hf),
      f"{cfg.num_params():,} parameters",
      cfg.num_layers,
      cfg.dtype,
      checkpoint_dir,
      time.perf_counter() - t0,
  )
  return cfg, params


def place(cfg: ModelConfig, mesh: jax.sharding.Mesh, specs: dict, read, layout=None) -> dict:
  """The parameters of `specs` (hf_specs) on `mesh` in jaxkv's layout and `cfg.dtype`; with a jaxkv.layout.Layout,
  each layer on its stage's mesh and the top on the first stage's (as jaxkv.model.init_params places them).

  `read(name, index)` returns the block `index` (a tuple of slices) of the HF tensor `name`, in the HF layout, in
  any float dtype: each device's callback reads only its own block. An error deletes the arrays made so far.
  """
  layer_mesh = (lambda l: mesh) if layout is None else layout.mesh
  top_mesh = mesh if layout is None else layout.first
  axes = model.param_axes(cfg)
  np_dtype = np.dtype(jnp.dtype(cfg.dtype))
  made: list[jax.Array] = []
  try:
    flat = {}
    for path, spec in specs.items():
      if path[0] == "layers":
        target = mesh_lib.sharding(layer_mesh(path[1]), axes["layers"][path[1]][path[2]])
      else:
        target = mesh_lib.sharding(top_mesh, axes[path[0]])
      # Each device's callback reads its own block of the HF tensor, in the HF layout.
      arr = jax.make_array_from_callback(
          spec.hf_shape, hf_sharding(spec, target), lambda index, name=spec.name: read(name, index)
      )
      if spec.view != spec.hf_shape or spec.perm != tuple(range(len(spec.perm))) or arr.dtype != np_dtype:
        # The transpose runs on the devices: numpy's strided transpose on the host is several times slower than
        # reading the checkpoint. The HF-layout blocks are freed when `arr` is rebound.
        arr = _relayout(spec.view, spec.perm, np_dtype, target)(arr)
      made.append(arr)
      flat[path] = arr
  except BaseException:
    for arr in made:
      arr.delete()
    raise
  params = {path[0]: arr for path, arr in flat.items() if path[0] != "layers"}
  params["layers"] = [{} for _ in range(cfg.num_layers)]
  for path, arr in flat.items():
    if path[0] == "layers":
      params["layers"][path[1]][path[2]] = arr
  return params
