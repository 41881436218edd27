"""Tiny random Hugging Face checkpoints (config.json and safetensors weights), written with safetensors.numpy alone
(no torch), for the checkpoint tests and the apps' tests."""

from __future__ import annotations

import json
import os

import numpy as np
from safetensors.numpy import save_file

from jaxkv import checkpoint

# Tiny geometry: the test meshes' tensor axis (1 and 4) divides 4 KV heads, 8 heads, 128 MLP columns and 256 ids.
GEOMETRY = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=3,  # Three layers, so that pipeline depth 2 runs uncapped (depth <= layers - 1).
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=16,
    intermediate_size=128,
    rms_norm_eps=1e-6,
)


def hf_config(arch: str = "LlamaForCausalLM", **overrides) -> dict:
  cfg = dict(GEOMETRY, architectures=[arch], model_type="llama" if arch == "LlamaForCausalLM" else "qwen3")
  cfg.update(rope_theta=10_000.0, tie_word_embeddings=False, torch_dtype="float32")
  cfg.update(overrides)
  return cfg


def hf_tensors(hf: dict, seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
  """Random tensors with HF names and layouts for a config.json dict."""
  rng = np.random.default_rng(seed)
  d, h, k = hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"]
  dh, f, v = hf["head_dim"], hf["intermediate_size"], hf["vocab_size"]

  def w(*shape):
    return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(dtype)

  def norm(n):
    return (1 + 0.1 * rng.standard_normal(n)).astype(dtype)

  t = {"model.embed_tokens.weight": rng.standard_normal((v, d)).astype(dtype), "model.norm.weight": norm(d)}
  if not hf.get("tie_word_embeddings"):
    t["lm_head.weight"] = w(v, d)
  for l in range(hf["num_hidden_layers"]):
    p = f"model.layers.{l}."
    t.update(
        {
            p + "input_layernorm.weight": norm(d),
            p + "self_attn.q_proj.weight": w(h * dh, d),
            p + "self_attn.k_proj.weight": w(k * dh, d),
            p + "self_attn.v_proj.weight": w(k * dh, d),
            p + "self_attn.o_proj.weight": w(d, h * dh),
            p + "post_attention_layernorm.weight": norm(d),
            p + "mlp.gate_proj.weight": w(f, d),
            p + "mlp.up_proj.weight": w(f, d),
            p + "mlp.down_proj.weight": w(d, f),
        }
    )
    if hf["architectures"] == ["Qwen3ForCausalLM"]:
      t[p + "self_attn.q_norm.weight"] = norm(dh)
      t[p + "self_attn.k_norm.weight"] = norm(dh)
  return t


def write_checkpoint(path, hf: dict, tensors: dict, shards: int = 1) -> str:
  """config.json and model.safetensors, or `shards` files listed by model.safetensors.index.json."""
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, checkpoint.CONFIG_FILE), "w") as f:
    json.dump(hf, f)
  if shards == 1:
    save_file(tensors, os.path.join(path, checkpoint.WEIGHTS_FILE), metadata={"format": "pt"})
    return str(path)
  names = sorted(tensors)
  weight_map = {}
  for i in range(shards):
    file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
    part = {n: tensors[n] for n in names[i::shards]}
    save_file(part, os.path.join(path, file), metadata={"format": "pt"})
    weight_map.update({n: file for n in part})
  with open(os.path.join(path, checkpoint.INDEX_FILE), "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)
  return str(path)
