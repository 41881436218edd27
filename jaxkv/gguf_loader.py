"""GGUF files (llama.cpp's format) of the `llama` and `qwen3` architectures, read into jaxkv's sharded layout.

The metadata becomes a config.json-style dict that jaxkv.checkpoint.model_config reads (with its refusals), and each
tensor is named by its Hugging Face counterpart, so that jaxkv.checkpoint.place builds the parameters exactly as for
a safetensors folder: per device, a callback reads that device's block of the HF-layout tensor. Here the callback
dequantizes (`gguf.quants.dequantize`) only the rows of the memory-mapped file that the block needs (and, for a block
of columns, only the quantization blocks that cover them), then casts to the model dtype: the host holds the
blocks of one tensor at a time (JAX sends them together), never the model.

GGUF tensor [numpy shape, = HF shape]       -> HF tensor
  token_embd.weight [V, D]                  -> model.embed_tokens.weight
  output_norm.weight [D]                    -> model.norm.weight
  output.weight [V, D]                      -> lm_head.weight  (absent when tied)
  blk.{l}.attn_norm.weight [D]              -> model.layers.{l}.input_layernorm.weight
  blk.{l}.attn_q.weight, attn_k [N * Dh, D] -> ...self_attn.q_proj.weight, k_proj  (llama: rows un-permuted, below)
  blk.{l}.attn_v.weight [K * Dh, D]         -> ...self_attn.v_proj.weight
  blk.{l}.attn_output.weight [D, H * Dh]    -> ...self_attn.o_proj.weight
  blk.{l}.attn_q_norm.weight, attn_k_norm   -> ...self_attn.q_norm.weight, k_norm  (qwen3)
  blk.{l}.ffn_norm.weight [D]               -> ...post_attention_layernorm.weight
  blk.{l}.ffn_gate.weight, ffn_up [F, D]    -> ...mlp.gate_proj.weight, up_proj
  blk.{l}.ffn_down.weight [D, F]            -> ...mlp.down_proj.weight
  rope_freqs.weight [Dh / 2]                -> rope_scaling of type llama3 (Llama-3.1, 3.2), when it is one

llama.cpp's converter stores a llama model's q/k rows of each head interleaved ([Dh/2, 2] -> [2, Dh/2] undoes it,
as transformers' GGUF loader does); qwen3 files keep the HF order.
"""

from __future__ import annotations

import functools
import math
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from jaxkv import chat_template as chat_template_lib
from jaxkv import checkpoint
from jaxkv import gguf_tokenizer
from jaxkv import mesh as mesh_lib
from jaxkv import tokenizer as tokenizer_lib
from jaxkv.config import ModelConfig

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Tensor types jaxkv reads (each dequantized by the gguf library).
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
ROPE_FREQS = "rope_freqs.weight"


def _gguf():
  try:
    import gguf  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ValueError("reading GGUF files needs the gguf library: pip install 'jaxkv[gguf]'") from e
  return gguf


def open_reader(path: str):
  """A gguf.GGUFReader over the memory-mapped file, or ValueError naming the problem. One reader per file and
  version (opening parses every metadata field: seconds for a large vocabulary)."""
  if not os.path.isfile(path):
    raise ValueError(f"GGUF file {path!r} does not exist")
  stat = os.stat(path)
  return _reader(os.path.abspath(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _reader(path: str, mtime_ns: int, size: int):
  del mtime_ns, size  # The cache's key: a rewritten file is read again.
  gguf = _gguf()
  try:
    return gguf.GGUFReader(path, "r")
  except Exception as e:  # The reader raises ValueError, struct.error, IndexError... on a bad file.
    raise ValueError(f"cannot read {path!r} as a GGUF file: {e}") from e


_TOKENIZER_ARRAYS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.scores",
)
_END_IDS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def metadata(reader, tokenizer: bool = False) -> dict:  # pylint: disable=redefined-outer-name
  """The file's key/value metadata, values as Python objects (the large tokenizer arrays only with `tokenizer`)."""
  skip = () if tokenizer else _TOKENIZER_ARRAYS
  return {k: f.contents() for k, f in reader.fields.items() if k not in skip and not k.startswith("GGUF.")}


def hf_name(name: str) -> str | None:
  """The HF tensor name of a GGUF tensor name (None for one jaxkv has no use for)."""
  if name in _GLOBAL:
    return _GLOBAL[name]
  m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
  if m and m.group(2) in _LAYER:
    return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"
  return None


def _llama3_factors(scaling: dict, theta: float, head_dim: int) -> np.ndarray:
  """llama.cpp's rope_freqs for Llama-3 scaling: the divisor of each of the head_dim / 2 RoPE frequencies."""
  low_wavelen = scaling["original_max_position_embeddings"] / scaling["low_freq_factor"]
  high_wavelen = scaling["original_max_position_embeddings"] / scaling["high_freq_factor"]
  out = []
  for freq in 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim):
    wavelen = 2 * math.pi / freq
    if wavelen < high_wavelen:
      out.append(1.0)
    elif wavelen > low_wavelen:
      out.append(scaling["factor"])
    else:
      smooth = (scaling["original_max_position_embeddings"] / wavelen - scaling["low_freq_factor"]) / (
          scaling["high_freq_factor"] - scaling["low_freq_factor"]
      )
      out.append(1 / ((1 - smooth) / scaling["factor"] + smooth))
  return np.array(out)


def hf_config(reader) -> dict:
  """A config.json-style dict from the GGUF metadata (jaxkv.checkpoint.model_config reads it), or ValueError."""
  meta = metadata(reader)
  if meta.get("split.count", 1) > 1:
    raise ValueError(
        f"GGUF file split into {meta['split.count']} parts: jaxkv reads one file (merge them with llama.cpp's "
        "llama-gguf-split --merge)"
    )
  arch = meta.get("general.architecture")
  if arch not in ARCHITECTURES:
    raise ValueError(
        f"unsupported GGUF architecture {arch!r}: jaxkv reads {', '.join(ARCHITECTURES)} (the Llama and Qwen3 "
        "families)"
    )

  def get(key, default=None):
    return meta.get(f"{arch}.{key}", default)

  missing = [
      k for k in ("block_count", "embedding_length", "feed_forward_length", "attention.head_count") if get(k) is None
  ]
  if missing:
    raise ValueError(f"GGUF metadata lacks {', '.join(f'{arch}.{k}' for k in missing)}")
  d, heads = int(get("embedding_length")), int(get("attention.head_count"))
  head_dim = int(get("attention.key_length", d // heads))
  if get("attention.value_length", head_dim) != head_dim:
    raise ValueError(f"unsupported value head size {get('attention.value_length')} != key head size {head_dim}")
  rope_dim = get("rope.dimension_count", head_dim)
  tensors = {t.name: t for t in reader.tensors}
  embed = tensors.get("token_embd.weight")
  vocab = get("vocab_size") or (int(embed.shape[1]) if embed is not None else None)
  hf = dict(
      architectures=[ARCHITECTURES[arch]],
      vocab_size=vocab,
      hidden_size=d,
      num_hidden_layers=int(get("block_count")),
      num_attention_heads=heads,
      num_key_value_heads=int(get("attention.head_count_kv", heads)),
      head_dim=head_dim,
      intermediate_size=int(get("feed_forward_length")),
      rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
      rope_theta=float(get("rope.freq_base", 10_000.0)),
      partial_rotary_factor=rope_dim / head_dim,
      tie_word_embeddings="output.weight" not in tensors,
  )
  if get("context_length"):  # The positions the model was trained for, checked as a checkpoint's.
    hf["max_position_embeddings"] = int(get("context_length"))
  kind = get("rope.scaling.type", "none")
  if kind not in ("none", "linear") or (kind == "linear" and get("rope.scaling.factor", 1.0) != 1.0):
    raise ValueError(
        f"unsupported GGUF rope scaling {kind!r} (factor {get('rope.scaling.factor')}): jaxkv reads "
        "none, and Llama-3's as rope_freqs.weight"
    )
  if ROPE_FREQS in tensors:
    freqs = _dequantize(tensors[ROPE_FREQS], (slice(None),)).astype(np.float64)
    scaling = dict(
        rope_type="llama3",
        factor=float(freqs.max()),
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )
    if freqs.shape != (head_dim // 2,) or not np.allclose(
        freqs, _llama3_factors(scaling, hf["rope_theta"], head_dim), rtol=1e-3
    ):
      raise ValueError(
          f"unsupported {ROPE_FREQS}: not Llama-3 rope scaling (factor {freqs.max():g}, low/high frequency factors "
          "1 and 4, original context 8192)"
      )
    hf["rope_scaling"] = scaling
  return hf


def _dequantize(tensor, index: tuple[slice, ...]) -> np.ndarray:
  """float32 block `index` of a GGUF tensor in its numpy (= HF) shape, dequantizing only the rows it covers and,
  along the last axis, only the quantization blocks that cover its columns."""
  gguf = _gguf()
  index = tuple(index) + (slice(None),) * (tensor.data.ndim - len(index))
  rows, cols = index[:-1], index[-1]
  n = int(tensor.shape[0])  # Elements per row (GGUF's ne[0]): the last numpy axis.
  c0, c1, _ = cols.indices(n)
  block, type_bytes = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
  b0, b1 = c0 // block, -(-c1 // block)
  unit = type_bytes if tensor.data.dtype == np.uint8 else 1  # The last axis counts bytes of quantized types.
  raw = tensor.data[rows + (slice(b0 * unit, b1 * unit),)]
  values = gguf.quants.dequantize(np.ascontiguousarray(raw), tensor.tensor_type)
  return values[..., c0 - b0 * block : c1 - b0 * block].astype(np.float32, copy=False)


class _Weights:
  """The tensors of a GGUF file under their HF names, read block by block."""

  def __init__(self, reader, hf: dict, path: str):
    self.path = path
    self.unpermute = hf["architectures"] == ["LlamaForCausalLM"]
    self.head_dim = hf["head_dim"]
    self.tensors = {}
    for t in reader.tensors:
      name = hf_name(t.name)
      if name is None and t.name != ROPE_FREQS:
        raise ValueError(f"unsupported GGUF tensor {t.name} in {path!r}: jaxkv reads the Llama/Qwen3 tensors only")
      if name is not None:
        self.tensors[name] = t

  def check(self, specs: dict, cfg: ModelConfig, dtype: str) -> None:
    """Every tensor present with its shape and a type jaxkv reads; no tensor the metadata does not account for."""
    self.dtype = np.dtype(jnp.dtype(dtype))
    for spec in specs.values():
      t = self.tensors.get(spec.name)
      if t is None:
        raise ValueError(f"GGUF file {self.path!r} has no tensor for {spec.name} (expected shape {spec.hf_shape})")
      shape = tuple(int(n) for n in reversed(t.shape.tolist()))
      if shape != spec.hf_shape:
        raise ValueError(
            f"GGUF tensor {t.name} has shape {shape}, expected {spec.hf_shape} from the metadata (hidden "
            f"{cfg.d_model}, heads {cfg.num_heads}, kv heads {cfg.num_kv_heads}, head_dim {cfg.head_dim}, "
            f"feed-forward {cfg.mlp_dim}, vocab {cfg.vocab_size})"
        )
      if t.tensor_type.name not in TENSOR_TYPES:
        raise ValueError(
            f"unsupported GGUF tensor type {t.tensor_type.name} of {t.name}: jaxkv reads {', '.join(TENSOR_TYPES)}"
        )
    for name, t in self.tensors.items():
      m = re.match(r"model\.layers\.(\d+)\.", name)
      if m and int(m.group(1)) >= cfg.num_layers:
        raise ValueError(f"GGUF tensor {t.name} is beyond the block_count of {cfg.num_layers}")
      if name.endswith(".bias"):
        raise ValueError(f"unsupported GGUF tensor {t.name}: jaxkv's projections have no bias")
      if not any(s.name == name for s in specs.values()):
        raise ValueError(f"unsupported GGUF tensor {t.name} for this configuration")

  def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
    """Block `index` of the HF tensor `name`, in the model dtype."""
    block = _dequantize(self.tensors[name], index)
    if self.unpermute and name.endswith(("q_proj.weight", "k_proj.weight")):
      rows, cols = block.shape  # Whole heads: the tensor axis splits these rows by head.
      block = block.reshape(rows // self.head_dim, self.head_dim // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)
    return block.astype(self.dtype)


def load(path: str, mesh: jax.sharding.Mesh, dtype: str | None = None, layout=None) -> tuple[ModelConfig, dict]:
  """Reads a GGUF file of the llama or qwen3 architecture onto `mesh` (jaxkv.checkpoint.load's GGUF twin).

  Args:
    path: the .gguf file.
    mesh: the mesh with a `tensor` axis that the parameters are sharded over (jaxkv.mesh rules).
    dtype: "bfloat16", "float16" or "float32", what the weights are dequantized to; None = bfloat16.
    layout: a jaxkv.layout.Layout (split mode layer), as for jaxkv.checkpoint.load; None = every parameter on `mesh`.

  Returns:
    (ModelConfig, params) with params in jaxkv.model's structure and sharded layout.

  Raises:
    ValueError, naming what is wrong, before any array is created: a missing or unreadable file, an unsupported
    architecture, option, tensor or tensor type, a missing tensor, a shape mismatch, a dimension that the tensor
    axis does not divide.
  """
  t0 = time.perf_counter()
  reader = open_reader(path)
  hf = hf_config(reader)
  cfg = checkpoint.model_config(hf, dtype or "bfloat16")
  for m in [mesh] if layout is None else layout.meshes:
    mesh_lib.check_divisible(cfg, m)
  weights = _Weights(reader, hf, path)
  specs = checkpoint.hf_specs(cfg)
  weights.check(specs, cfg, cfg.dtype)
  params = checkpoint.place(cfg, mesh, specs, weights.read, layout)
  logging.info(
      "loaded %s (%s parameters, %d layers, %s) from %s in %.1f s",
      hf["architectures"][0],
      f"{cfg.num_params():,}",
      cfg.num_layers,
      cfg.dtype,
      path,
      time.perf_counter() - t0,
  )
  return cfg, params


def tokenizer(path: str) -> tokenizer_lib.Tokenizer:
  """The tokenizer that a GGUF file's metadata describes (jaxkv.gguf_tokenizer), with its chat template."""
  meta = metadata(open_reader(path), tokenizer=True)
  special = {f"{k}_token": gguf_tokenizer.special_token(meta, f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos")}
  template = meta.get("tokenizer.chat_template")
  template = chat_template_lib.ChatTemplate(template, {k: v for k, v in special.items() if v}) if template else None
  return tokenizer_lib.Tokenizer(path, backend=gguf_tokenizer.build(meta), chat_template=template)


def eos_ids(path: str) -> frozenset[int]:
  """The ids that end a sequence of the GGUF file's model: tokenizer.ggml.eos_token_id (and eot_token_id, eom_token_id
  where llama.cpp's converter wrote them) and its chat template's end-of-turn token."""
  meta = metadata(open_reader(path))
  ids = {int(meta[k]) for k in _END_IDS if k in meta}
  try:
    turn = tokenizer(path).end_of_turn_id()
  except ValueError:  # No vocabulary jaxkv builds, or a template that does not parse: the ids above only.
    turn = None
  return frozenset(ids | ({turn} if turn is not None else set()))
