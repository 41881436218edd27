"""Frozen configs at the library boundary.

Experiment files (experiments/*.py) return ml_collections ConfigDicts; `from_config_dict` turns one into
these dataclasses so that library code never sees a ConfigDict.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

PLACEMENTS = ("device", "host", "auto")
SPLIT_MODES = ("none", "layer", "tensor")
HOST_ATTENTION_WAITS = ("auto", "thread", "device")
PREFILL_ATTENTIONS = ("auto", "xla", "cudnn")  # engine.prefill_attention (jaxkv.model.prefill_attention_impl).
# KV cache storage: "model" = the model dtype; two float dtypes; three quantized ones (see jaxkv.kv_quant).
KV_DTYPES = ("model", "bfloat16", "float32", "int8", "int4", "float8_e4m3fn")
INT8_BLOCK = 32  # int8 KV: values per scale along head_dim (llama.cpp q8_0).
INT4_BLOCK = 32  # int4 KV: values per scale along head_dim (llama.cpp q4_0).
KV_BLOCKS = {"int8": INT8_BLOCK, "int4": INT4_BLOCK}  # The KV dtypes with a scale per block of values along head_dim.


ROPE_TYPES = ("llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE frequency scaling for contexts past the pretrained one (HF `rope_scaling`), as transformers computes it.

  rope_type "llama3" (Llama-3.1): frequencies with wavelengths above original_max_position / low_freq_factor are
    divided by factor, those below original_max_position / high_freq_factor kept, the band between smoothed.
  rope_type "yarn" (Qwen3's long-context setting): frequencies that turn more than beta_fast times over
    original_max_position are kept, fewer than beta_slow times divided by factor, a linear ramp over the dimensions
    between (the bounds rounded outwards when truncate); cos and sin are multiplied by `attention_scale` (the HF
    attention_factor, or from factor, mscale and mscale_all_dim when it is None).
  """

  factor: float = 8.0
  low_freq_factor: float = 1.0  # llama3 only.
  high_freq_factor: float = 4.0  # llama3 only.
  original_max_position: int = 8192
  rope_type: str = "llama3"
  beta_fast: float = 32.0  # yarn only, and the rest.
  beta_slow: float = 1.0
  mscale: float | None = None
  mscale_all_dim: float | None = None
  attention_factor: float | None = None
  truncate: bool = True

  def __post_init__(self):
    if self.rope_type not in ROPE_TYPES:
      raise ValueError(f"model.rope_scaling.rope_type must be one of {ROPE_TYPES}, got {self.rope_type!r}")
    if self.factor <= 0 or self.original_max_position <= 0:
      raise ValueError(
          f"model.rope_scaling needs factor > 0 and original_max_position > 0, got {self.factor} and "
          f"{self.original_max_position}"
      )

  @property
  def attention_scale(self) -> float:
    """The factor on cos and sin: 1 for llama3; for yarn as transformers' _compute_yarn_parameters."""
    if self.rope_type != "yarn":
      return 1.0
    if self.attention_factor is not None:
      return float(self.attention_factor)

    def get_mscale(scale, m=1.0):
      return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if self.mscale and self.mscale_all_dim:
      return float(get_mscale(self.factor, self.mscale) / get_mscale(self.factor, self.mscale_all_dim))
    return get_mscale(self.factor)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Geometry of a Llama-3 / Qwen3 style decoder."""

  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  rms_eps: float = 1e-5
  rope_theta: float = 500_000.0
  rope_scaling: RopeScaling | None = None
  qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE.
  tie_embeddings: bool = False
  dtype: str = "bfloat16"  # Weights, activations and the KV cache.

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim"):
      if getattr(self, name) <= 0:
        raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"model.num_heads ({self.num_heads}) must be a multiple of model.num_kv_heads ({self.num_kv_heads})"
      )
    if self.head_dim % 2:
      raise ValueError(f"model.head_dim must be even for RoPE, got {self.head_dim}")
    if self.dtype not in ("bfloat16", "float32", "float16"):
      raise ValueError(f"model.dtype must be bfloat16, float16 or float32, got {self.dtype!r}")

  def num_params(self) -> int:
    attn = self.d_model * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
    mlp = 3 * self.d_model * self.mlp_dim
    heads = self.vocab_size * self.d_model * (1 if self.tie_embeddings else 2)
    return self.num_layers * (attn + mlp + 2 * self.d_model) + heads + self.d_model


@dataclasses.dataclass(frozen=True)
class KVConfig:
  """Where the KV cache lives and how it reaches the devices.

  placement: "device" keeps every row in device memory (the reference); "host" keeps the full pages in
    pinned host memory and delivers each layer's window before its compute; "auto" keeps the layers that fit
    in device memory there and streams the others (jaxkv.residency).
  pipeline_depth: 0 = ordered (deliver layer l, then compute it); D >= 1 = issue the delivery of layer
    l + D before dispatching layer l.
  block: rows per page. The window a layer receives is a whole number of blocks; the partly filled block
    (the open page) stays on the device. Also the granularity of compiled shapes.
  budget_mib: cap on the ring of deliveries per device (0 = no cap).
  headroom_mib: device memory kept free when sizing the ring.
  transport_debug: 0 = totals, 1 = plus per-step bytes and ring, 2 = plus per-layer issue/ready times (it waits
    for each delivery to time it), 3 = plus a log line per step.
  dtype: how cache rows are stored and delivered, one of KV_DTYPES: "model" (the model dtype), "bfloat16",
    "float32", or quantized "int8" and "int4" (blocks of INT8_BLOCK / INT4_BLOCK values along head_dim, one scale
    each) and "float8_e4m3fn" (one scale per head row); jaxkv.kv_quant has the packed layouts.
  device_budget_gib: with placement "auto", the device memory per device the KV may take (None = from the free
    device memory; jaxkv.residency).
  host_attention: with placement "host" or "auto", each streamed layer's window of W rows is split at
    r1 = floor(f W / block) block: rows [0, r1) are attended on the host CPU during decode, in place, and only the
    rest is delivered (jaxkv.host_attention, docs/design.md). Not bit-identical to the other modes.
  host_attention_fraction: the host's share f: 0 = chosen for each window by a model of the CPU's and the link's
    rates and a split layer's fixed cost, measured at start, and off where it predicts under 3% gain
    (jaxkv.host_split); f in (0, 1) overrides it.
  host_attention_threads: with host_attention, the CPU kernel's threads: 0 = chosen at start by the same model among
    numba's pool (by default the cores) minus two, at most 16 (jaxkv.host_attention.ENGINE_THREADS), and two and four
    fewer; ignored without it (in a bench it affects only the host attention arms).
  host_attention_wait: with host_attention, what waits for the host's partial of a layer before the device merges
    it: "thread" (the dispatching thread waits, then dispatches the merge) or "device" (the merge is dispatched at once
    and the devices wait in pinned host memory for the host's signal, q reaches the host the same way, and a
    generate's passes run ahead of their host kernels; jaxkv.host_wait, which builds a small C++ op at first use).
    The same bits either way; on the H200 "device" took 10-28% less time a step at 32k batch 1
    (docs/design.md). "auto" (the default): "device" where it was measured, one GPU in one
    process, when its op builds; "thread" elsewhere (jaxkv.host_decode.devices_wait).
  group_layers: layers per decode call (jaxkv.residency.decode_groups), the same groups in every placement: 0 =
    automatic (groups of up to jaxkv.residency.GROUP_TARGET_BYTES per device and GROUP_MAX_LAYERS layers, one layer
    each with host_attention); n >= 1 = n layers per call (1: one call per layer).
  """

  placement: str = "device"
  pipeline_depth: int = 2
  block: int = 256
  budget_mib: int = 0
  headroom_mib: int = 512
  transport_debug: int = 0
  dtype: str = "model"
  device_budget_gib: float | None = None
  host_attention: bool = False
  host_attention_fraction: float = 0.0
  host_attention_threads: int = 0
  host_attention_wait: str = "auto"
  group_layers: int = 0

  def __post_init__(self):
    if self.placement not in PLACEMENTS:
      raise ValueError(f"kv.placement must be one of {PLACEMENTS}, got {self.placement!r}")
    if self.pipeline_depth < 0:
      raise ValueError(f"kv.pipeline_depth must be >= 0, got {self.pipeline_depth}")
    if self.block <= 0:
      raise ValueError(f"kv.block must be positive, got {self.block}")
    if self.budget_mib < 0 or self.headroom_mib < 0:
      raise ValueError("kv.budget_mib and kv.headroom_mib must be >= 0")
    if self.transport_debug not in (0, 1, 2, 3):
      raise ValueError(f"kv.transport_debug must be 0..3, got {self.transport_debug}")
    check_kv_dtype(self.dtype)
    if self.device_budget_gib is not None and self.device_budget_gib < 0:
      raise ValueError(f"kv.device_budget_gib must be >= 0 (or unset for automatic), got {self.device_budget_gib}")
    if not 0.0 <= self.host_attention_fraction < 1.0:
      raise ValueError(f"kv.host_attention_fraction must be in [0, 1), got {self.host_attention_fraction}")
    if self.host_attention_fraction and not self.host_attention:
      raise ValueError(
          f"kv.host_attention_fraction {self.host_attention_fraction} is the host's share with kv.host_attention; "
          "set kv.host_attention too"
      )
    if self.host_attention_threads < 0:
      raise ValueError(f"kv.host_attention_threads must be >= 0 (0 = automatic), got {self.host_attention_threads}")
    if self.host_attention_wait not in HOST_ATTENTION_WAITS:
      raise ValueError(
          f"kv.host_attention_wait must be one of {HOST_ATTENTION_WAITS}, got {self.host_attention_wait!r}"
      )
    if self.group_layers < 0:
      raise ValueError(f"kv.group_layers must be >= 0 (0 = automatic), got {self.group_layers}")
    if self.host_attention and self.placement == "device":
      raise ValueError("kv.host_attention needs kv.placement host or auto (the host attends rows it holds)")


def check_kv_dtype(kv_dtype: str, head_dim: int | None = None) -> None:
  """Raises ValueError for an unknown KV dtype, or for int8 / int4 with a head_dim that is not a multiple of their
  block (KV_BLOCKS)."""
  if kv_dtype not in KV_DTYPES:
    raise ValueError(f"kv.dtype must be one of {', '.join(KV_DTYPES)}; got {kv_dtype!r}")
  block = KV_BLOCKS.get(kv_dtype)
  if block and head_dim is not None and head_dim % block:
    raise ValueError(
        f"kv.dtype {kv_dtype} quantizes blocks of {block} values along head_dim, so model.head_dim must be a "
        f"multiple of {block}; got head_dim {head_dim}. Use another kv.dtype (e.g. float8_e4m3fn)."
    )


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """capacity: cache rows per sequence (longest prompt + new tokens must fit).
  prefill_chunk: prompt rows per prefill step, a multiple of kv.block.
  prefill_attention: the prefill's attention, one of PREFILL_ATTENTIONS: "xla" (plain XLA, the reference),
    "cudnn" (cuDNN's flash attention: GPU, bfloat16 or float16) or "auto" (cudnn where it can run, else xla;
    jaxkv.model.prefill_attention_impl)."""

  capacity: int = 256
  prefill_chunk: int = 256
  prefill_attention: str = "auto"

  def __post_init__(self):
    if self.capacity <= 0 or self.prefill_chunk <= 0:
      raise ValueError("engine.capacity and engine.prefill_chunk must be positive")
    if self.prefill_attention not in PREFILL_ATTENTIONS:
      raise ValueError(
          f"engine.prefill_attention must be one of {', '.join(PREFILL_ATTENTIONS)}, got {self.prefill_attention!r}"
      )


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """temperature 0 = greedy. top_k 0 = off. top_p 1.0 = off. eos_id < 0 = none."""

  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  eos_id: int = -1

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"sampling.temperature must be >= 0, got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"sampling.top_k must be >= 0, got {self.top_k}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")


@dataclasses.dataclass(frozen=True)
class SplitConfig:
  """How layers map to the devices of the mesh (jaxkv.layout): mode "tensor" (heads split over the tensor axis),
  "layer" (contiguous layer ranges per device) or "none" (one device). layer_split: proportions per device for
  mode "layer", e.g. "55,45"; "" = even."""

  mode: str = "tensor"
  layer_split: str = ""

  def __post_init__(self):
    if self.mode not in SPLIT_MODES:
      raise ValueError(f"split.mode must be one of {', '.join(SPLIT_MODES)}; got {self.mode!r}")


@dataclasses.dataclass(frozen=True)
class Config:
  model: ModelConfig
  kv: KVConfig
  engine: EngineConfig
  sampling: SamplingConfig
  mesh: tuple[tuple[str, int], ...]  # ((axis_name, size), ...); size -1 = the remaining devices.
  split: SplitConfig = SplitConfig()

  def __post_init__(self):
    check_kv_dtype(self.kv.dtype, self.model.head_dim)
    if self.engine.prefill_chunk % self.kv.block:
      raise ValueError(
          f"engine.prefill_chunk ({self.engine.prefill_chunk}) must be a multiple of kv.block ({self.kv.block})"
      )
    if self.kv.placement == "auto" and self.split.mode == "layer":
      raise ValueError("kv.placement auto plans one mesh for every layer; use split mode tensor or none with it")


def _build(cls, d: dict[str, Any], where: str):
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(d) - names)
  if unknown:
    raise ValueError(f"unknown {where} field(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
  return cls(**d)


def from_config_dict(cd, model: ModelConfig | None = None) -> Config:
  """Converts an experiment ConfigDict (or plain nested dict) into a `Config`; `model` (e.g. a checkpoint's)
  replaces its model section, so that the checks that depend on the model see the one that will run."""
  d = cd.to_dict() if hasattr(cd, "to_dict") else dict(cd)
  if model is None:
    fields = dict(d["model"])
    scaling = fields.pop("rope_scaling", None)
    # Experiment files keep the scaling fields overridable and switch them on with use_rope_scaling.
    use = fields.pop("use_rope_scaling", scaling is not None)
    fields["rope_scaling"] = _build(RopeScaling, dict(scaling), "model.rope_scaling") if use and scaling else None
    model = _build(ModelConfig, fields, "model")
  return Config(
      model=model,
      kv=_build(KVConfig, dict(d.get("kv", {})), "kv"),
      engine=_build(EngineConfig, dict(d.get("engine", {})), "engine"),
      sampling=_build(SamplingConfig, dict(d.get("sampling", {})), "sampling"),
      mesh=tuple((str(k), int(v)) for k, v in dict(d.get("mesh", {"tensor": -1})).items()),
      split=_build(SplitConfig, dict(d.get("split", {})), "split"),
  )
