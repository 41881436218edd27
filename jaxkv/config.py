"""Frozen configs at the library boundary, and the one place where every setting's default and help live.

Each field carries its default and, in `metadata`, its help (and `choices` where it takes one of a few strings):
experiments/common.py derives the experiments' ConfigDict from these fields, jaxkv.apps.cli the `--kv_*`, `--capacity`
and `--split_mode` shorthand flags, and docs/reference.md's table of config fields is rendered from them
(tests/test_docs.py compares). Experiment files (experiments/*.py) return ml_collections ConfigDicts;
`from_config_dict` turns one into these dataclasses so that library code never sees a ConfigDict.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

PLACEMENTS = ("device", "host", "auto")
SPLIT_MODES = ("none", "layer", "tensor")
HOST_ATTENTION_WAITS = ("auto", "thread", "device")
PREFILL_ATTENTIONS = ("auto", "xla", "cudnn")  # engine.prefill_attention (jaxkv.model.prefill_attention_impl).
DECODE_ATTENTIONS = ("auto", "xla", "pallas", "legacy")  # engine.decode_attention (jaxkv.decode_attention.resolve).
# KV cache storage: "model" = the model dtype; two float dtypes; three quantized ones (see jaxkv.kv_quant).
KV_DTYPES = ("model", "bfloat16", "float32", "int8", "int4", "float8_e4m3fn")
INT8_BLOCK = 32  # int8 KV: values per scale along head_dim (llama.cpp q8_0).
INT4_BLOCK = 32  # int4 KV: values per scale along head_dim (llama.cpp q4_0).
KV_BLOCKS = {"int8": INT8_BLOCK, "int4": INT4_BLOCK}  # The KV dtypes with a scale per block of values along head_dim.


ROPE_TYPES = ("llama3", "yarn")
SPECULATE_MODES = ("off", "lookup", "self")  # speculate.mode (jaxkv.speculate's drafters, jaxkv.self_draft).
SELF_DRAFT_KV_DTYPE = "int4"  # speculate.mode self: the KV dtype of the draft's device-resident copy of the cache.


def field(default, text: str, choices: tuple[str, ...] | None = None):
  """A config field: its default and its help `text` (and for a string that takes one of a few values, `choices`)."""
  return dataclasses.field(default=default, metadata=dict(help=text, choices=choices))


def required(text: str):
  """A config field without a default (a model's geometry, which experiment files and checkpoints give)."""
  return dataclasses.field(metadata=dict(help=text, choices=None))


def help_of(cls, name: str) -> str:
  """The help of field `name` of the config dataclass `cls`."""
  return {f.name: f for f in dataclasses.fields(cls)}[name].metadata["help"]


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

  factor: float = field(8.0, "Context extension factor.")
  low_freq_factor: float = field(1.0, "llama3: wavelengths above original_max_position / this are scaled.")
  high_freq_factor: float = field(4.0, "llama3: wavelengths below original_max_position / this are kept.")
  original_max_position: int = field(8192, "The pretrained context length.")
  rope_type: str = field("llama3", "llama3 (Llama-3.1) or yarn (Qwen3's long-context setting).", ROPE_TYPES)
  beta_fast: float = field(32.0, "yarn: frequencies turning more than this many times are kept.")
  beta_slow: float = field(1.0, "yarn: frequencies turning fewer than this many times are scaled.")
  mscale: float | None = field(None, "yarn: with mscale_all_dim, the attention scale's numerator (none = unused).")
  mscale_all_dim: float | None = field(None, "yarn: the attention scale's denominator (none = unused).")
  attention_factor: float | None = field(None, "yarn: the factor on cos and sin (none = from factor and mscale).")
  truncate: bool = field(True, "yarn: round the ramp's bounds outwards.")

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

  vocab_size: int = required("Token ids in the vocabulary.")
  d_model: int = required("Hidden size.")
  num_layers: int = required("Decoder layers.")
  num_heads: int = required("Query heads.")
  num_kv_heads: int = required("Key/value heads (grouped-query attention); the tensor axis splits them.")
  head_dim: int = required("Values per head.")
  mlp_dim: int = required("Width of the gated MLP.")
  rms_eps: float = field(1e-5, "RMSNorm epsilon.")
  rope_theta: float = field(500_000.0, "RoPE base frequency.")
  rope_scaling: RopeScaling | None = field(None, "RoPE scaling for long contexts (none = off).")
  qk_norm: bool = field(False, "Qwen3: RMSNorm over head_dim on q and k before RoPE.")
  tie_embeddings: bool = field(False, "The LM head is the embedding table.")
  dtype: str = field("bfloat16", "Weights, activations and the KV cache.", ("bfloat16", "float32", "float16"))

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
  """Where the KV cache lives and how it reaches the devices (each field's help says what it does).

  The window a layer receives is a whole number of kv.block rows; the partly filled block (the open page) stays on
  the device. Decode runs consecutive layers as one call (a decode group, jaxkv.residency.decode_groups); the
  pipeline delivers group g + pipeline_depth before computing group g, from a ring of pipeline_depth + 2 groups'
  windows per device (jaxkv.transport). docs/design.md has the measurements behind the defaults.
  """

  placement: str = field(
      "device",
      "device (every row in device memory, the reference), host (pinned host memory, each decode group's windows "
      "delivered before its compute) or auto (the layers that fit stay on the device, the rest are streamed).",
      PLACEMENTS,
  )
  pipeline_depth: int = field(
      2,
      "0 = ordered; D >= 1 = deliver decode group g + D before computing group g (a ring of D + 2 groups' windows per "
      "device), capped at the streamed groups - 1 and lowered where the ring does not fit (fallback_reason).",
  )
  block: int = field(256, "Rows per KV page: the window a layer receives is whole blocks.")
  window_buckets: int = field(
      1,
      "Decode window sizes per doubling: n allocates m * 2^s blocks (n <= m < 2n, >= a leaf), padded at the start: "
      "O(n log capacity) shapes, <= (n + 1) / n of the rows, same bits; 0 = exact. Streamed caches stay exact.",
  )
  budget_mib: int = field(0, "Cap on the delivery ring per device, MiB (0 = none).")
  headroom_mib: int = field(512, "Device memory kept free when sizing the ring, MiB.")
  transport_debug: int = field(
      0,
      "Transport telemetry: 0 totals; 1 also per-step counters; 2 also per-layer issue/ready times (waiting for each "
      "delivery); 3 also a log line per step.",
  )
  dtype: str = field(
      "model",
      "How cache rows are stored and moved: model (the model dtype), bfloat16, float32, int8 (32-value blocks along "
      "head_dim, a float16 scale each; head_dim % 32 == 0) or float8_e4m3fn (a float16 scale per head row).",
      KV_DTYPES,
  )
  device_budget_gib: float | None = field(
      None,
      "With placement auto: device memory per device for the KV, GiB (none = the free device memory after weights, "
      "ring, workspace and headroom). With it, a generate's decode keeps the prefill's plan.",
  )
  host_attention: bool = field(
      False,
      "With placement host or auto: attend a share of each streamed window on the host CPU during decode and deliver "
      "only the rest (jaxkv.host.attention); deterministic, not bit-identical to the other modes.",
  )
  host_attention_fraction: float = field(
      0.0,
      "With host_attention: the host's share of each window, in (0, 1); 0 = chosen per window from the CPU's and the "
      "link's rates measured at start (jaxkv.host.split), off where it predicts under 3% gain.",
  )
  host_attention_threads: int = field(
      0,
      "With host_attention: the CPU kernel's threads; 0 = chosen at start among numba's pool minus two (at most 16), "
      "and two and four fewer.",
  )
  host_attention_wait: str = field(
      "auto",
      "With host_attention: what waits for the host's partial of a layer: thread (the dispatching thread) or device "
      "(the devices, in pinned host memory; C++ ops built at first use, jaxkv.host.wait); the same bits; auto = device "
      "on one GPU in one process where the ops build, else thread.",
      HOST_ATTENTION_WAITS,
  )
  group_layers: int = field(
      0,
      "Layers per decode call (a decode group), the same in every placement: 0 = automatic (up to 1 GiB of KV per "
      "device and 8 layers; one layer with host_attention); n = n layers per call.",
  )

  delivery_chunk_mib: float = field(
      512.0,
      "Decode takes a streamed window in chunks of this many MiB per device, each attended on arrival; 0 = whole.",
  )

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
    if self.window_buckets < 0:
      raise ValueError(f"kv.window_buckets must be >= 0 (0 = exact windows), got {self.window_buckets}")
    if self.delivery_chunk_mib < 0:
      raise ValueError(f"kv.delivery_chunk_mib must be >= 0 (0 = whole windows), got {self.delivery_chunk_mib}")
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
  """The cache's size and how a prompt is prefilled.

  The defaults fit a real model's chat on any machine jaxkv runs on: 4096 rows per sequence take 512 MiB of bf16 KV
  for Llama-3-8B (32 MiB for SmolLM2-135M), and 1024-row chunks keep a prefill's activations small. Experiment files
  set their own sizes (experiments/tiny.py's small ones, 32k for the large geometries)."""

  capacity: int = field(
      4096,
      "Cache rows per sequence: the longest prompt plus its new tokens - 1 must fit (e.g. 131328 for 128k).",
  )
  prefill_chunk: int = field(1024, "Prompt rows per prefill step, a multiple of kv.block.")
  prefill_attention: str = field(
      "auto",
      "The prefill's attention: xla (plain XLA, the reference), cudnn (cuDNN's flash attention: a CUDA GPU, bf16 or "
      "f16) or auto (cudnn where it runs and passes a check against xla, else xla). Every placement runs the same.",
      PREFILL_ATTENTIONS,
  )
  decode_attention: str = field(
      "auto",
      "The decode's attention: end-anchored leaves of 256 rows folded in a fixed tree, so that a sequence's bits do not "
      "depend on the batch around it, computed by xla (plain XLA, the reference) or pallas (a Pallas kernel: a CUDA "
      "GPU); auto = pallas where it runs and passes its check, else xla; legacy = the window reduced whole (the bits "
      "depend on the batch's window length; for A/B).",
      DECODE_ATTENTIONS,
  )

  def __post_init__(self):
    if self.capacity <= 0 or self.prefill_chunk <= 0:
      raise ValueError("engine.capacity and engine.prefill_chunk must be positive")
    if self.prefill_attention not in PREFILL_ATTENTIONS:
      raise ValueError(
          f"engine.prefill_attention must be one of {', '.join(PREFILL_ATTENTIONS)}, got {self.prefill_attention!r}"
      )
    if self.decode_attention not in DECODE_ATTENTIONS:
      raise ValueError(
          f"engine.decode_attention must be one of {', '.join(DECODE_ATTENTIONS)}, got {self.decode_attention!r}"
      )


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How each next token is drawn, and the ids that end a sequence."""

  temperature: float = field(0.0, "Sampling temperature; 0 = greedy.")
  top_k: int = field(0, "Sample among the k most likely tokens; 0 = off.")
  top_p: float = field(1.0, "Sample among the most likely tokens that hold this much probability; 1 = off.")
  min_p: float = field(0.0, "Sample among the tokens at least this fraction as likely as the most likely; 0 = off.")
  presence_penalty: float = field(0.0, "Subtracted from the logit of each token generated so far; 0 = off.")
  frequency_penalty: float = field(0.0, "Subtracted from each token's logit once per time it was generated; 0 = off.")
  repetition_penalty: float = field(
      1.0, "Divides the positive logits (multiplies the negative) of the prompt's and generated tokens; 1 = off."
  )
  eos_id: int = field(-1, "A token id that ends a sequence (it is kept as its last token); < 0 = none.")
  eos_ids: tuple[int, ...] = field(
      (),
      "More ids that end a sequence. A checkpoint or GGUF file adds its own: its eos_token_id (generation_config.json "
      "or config.json; tokenizer.ggml.eos_token_id) and its chat template's end-of-turn token.",
  )

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"sampling.temperature must be >= 0, got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"sampling.top_k must be >= 0, got {self.top_k}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
    if not 0.0 <= self.min_p <= 1.0:
      raise ValueError(f"sampling.min_p must be in [0, 1], got {self.min_p}")
    if self.repetition_penalty <= 0:
      raise ValueError(f"sampling.repetition_penalty must be > 0, got {self.repetition_penalty}")
    if any(not isinstance(i, int) or i < 0 for i in self.eos_ids):
      raise ValueError(f"sampling.eos_ids must be token ids >= 0, got {self.eos_ids!r}")

  @property
  def stop_ids(self) -> frozenset[int]:
    """Every id that ends a sequence: eos_id (when set) and eos_ids."""
    return frozenset(self.eos_ids) | ({self.eos_id} if self.eos_id >= 0 else set())


@dataclasses.dataclass(frozen=True)
class SplitConfig:
  """How layers map to the devices of the mesh (jaxkv.layout)."""

  mode: str = field(
      "tensor",
      "How layers map to the devices: tensor (heads split over the tensor axis), layer (contiguous layer ranges per "
      "device, llama.cpp's -sm layer) or none (one device).",
      SPLIT_MODES,
  )
  layer_split: str = field("", "With mode layer: proportions per device, e.g. 55,45; empty = even.")

  def __post_init__(self):
    if self.mode not in SPLIT_MODES:
      raise ValueError(f"split.mode must be one of {', '.join(SPLIT_MODES)}; got {self.mode!r}")


@dataclasses.dataclass(frozen=True)
class SpeculateConfig:
  """Speculative decoding (jaxkv.spec_decode): each pass verifies a drafted continuation of every sequence, k + 1
  query positions over the one pass through the cache."""

  mode: str = field(
      "off",
      "off; lookup: drafts from n-grams in the sequence's own text; self: from the model over an int4 KV copy.",
      SPECULATE_MODES,
  )
  k: int = field(8, "Draft tokens per sequence and pass: a verify pass scores k + 1 positions.")

  def __post_init__(self):
    if self.mode not in SPECULATE_MODES:
      raise ValueError(f"speculate.mode must be one of {', '.join(SPECULATE_MODES)}, got {self.mode!r}")
    if self.k < 1:
      raise ValueError(f"speculate.k must be >= 1, got {self.k}")


DEFAULT_MESH = (("tensor", -1),)  # One tensor axis over every device.


@dataclasses.dataclass(frozen=True)
class Config:
  """A run's settings: the model and each section above. mesh: ((axis_name, size), ...); size -1 = the remaining
  devices."""

  model: ModelConfig
  kv: KVConfig = KVConfig()
  engine: EngineConfig = EngineConfig()
  sampling: SamplingConfig = SamplingConfig()
  mesh: tuple[tuple[str, int], ...] = DEFAULT_MESH
  split: SplitConfig = SplitConfig()
  speculate: SpeculateConfig = SpeculateConfig()

  def __post_init__(self):
    check_kv_dtype(self.kv.dtype, self.model.head_dim)
    if self.engine.prefill_chunk % self.kv.block:
      raise ValueError(
          f"engine.prefill_chunk ({self.engine.prefill_chunk}) must be a multiple of kv.block ({self.kv.block})"
      )
    if self.kv.placement == "auto" and self.split.mode == "layer":
      raise ValueError("kv.placement auto plans one mesh for every layer; use split mode tensor or none with it")
    if self.speculate.mode != "off":
      check_speculate(self)


# The sections of a config that hold settings, by their name in the ConfigDict (the model and the mesh are apart).
SECTIONS = {
    "kv": KVConfig,
    "engine": EngineConfig,
    "sampling": SamplingConfig,
    "split": SplitConfig,
    "speculate": SpeculateConfig,
}


def check_speculate(config: Config) -> None:
  """Raises ValueError where speculative decoding cannot run with the config: it verifies drafts without penalties
  (the counts they read would change along a draft) with end-anchored leaves (not the legacy attention); mode self
  also needs a head_dim that its int4 copy of the KV quantizes."""
  s, mode = config.sampling, f"--speculate={config.speculate.mode}"
  if s.presence_penalty or s.frequency_penalty or s.repetition_penalty != 1.0:
    raise ValueError(
        f"{mode} verifies drafts without penalties: it needs no presence, frequency or repetition penalty; drop "
        "them or use --speculate=off"
    )
  if config.engine.decode_attention == "legacy":
    raise ValueError(f"{mode} needs engine.decode_attention auto, xla or pallas (not legacy), or --speculate=off")
  block = KV_BLOCKS[SELF_DRAFT_KV_DTYPE]
  if config.speculate.mode == "self" and config.model.head_dim % block:
    raise ValueError(
        f"{mode} drafts over a copy of the KV in {SELF_DRAFT_KV_DTYPE} ({block}-value blocks along head_dim): "
        f"model.head_dim must be a multiple of {block}, got {config.model.head_dim}; use --speculate=lookup"
    )


def _build(cls, d: dict[str, Any], where: str):
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(d) - names)
  if unknown:
    raise ValueError(f"unknown {where} field(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
  return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})  # A ConfigDict's tuples as lists.


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
      mesh=tuple((str(k), int(v)) for k, v in dict(d.get("mesh", DEFAULT_MESH)).items()),
      split=_build(SplitConfig, dict(d.get("split", {})), "split"),
      speculate=_build(SpeculateConfig, dict(d.get("speculate", {})), "speculate"),
  )
