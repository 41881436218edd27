"""jaxkv.checkpoint and jaxkv.tokenizer: Hugging Face checkpoints in, the same logits and tokens out.

The parity tests write tiny random LlamaForCausalLM and Qwen3ForCausalLM checkpoints with transformers and
compare jaxkv (host KV cache, pipeline depth 2, 1 and 4 devices) with transformers on the same prompts; they
need the `parity` extra (torch, transformers). The other tests write checkpoints with safetensors.numpy alone.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
from safetensors import safe_open

import helpers
from experiments import llama3_8b
from experiments import qwen3_32b
from experiments import tiny
from helpers import GEOMETRY, WORDS, hf_config, hf_tensors, write_checkpoint, write_tokenizer
from jaxkv import checkpoint
from jaxkv import config as config_lib
from jaxkv import engine as engine_lib
from jaxkv import mesh as mesh_lib
from jaxkv import model
from jaxkv import preflight
from jaxkv import run
from jaxkv.apps import runs
from jaxkv import tokenizer as tokenizer_lib

# Llama-3 scaling with a short original context, so that the tiny head_dim has frequencies in all three bands
# (wavelengths below 8 kept, 8..32 smoothed, above 32 divided by the factor).
LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
LLAMA3_ORIGINAL = 32
# YaRN with a short original context and narrow betas, so that the tiny head_dim's 8 frequencies (rope_theta 1e4,
# wavelengths 6, 20, 63, ...) fall in all three parts: dimension 0 kept, 1-2 on the ramp, 3-7 divided by the factor.
# The prompts and tokens run to position 51, past the original 16.
YARN_ROPE = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=2.0, beta_slow=0.1)
PROMPT_LENS = (11, 20)  # Two prefill chunks of 16 for the longer one; left padding for the shorter.
NEW_TOKENS = 32
# Relative error of the logits: max |jaxkv - transformers| / max |transformers| over every step and sequence.
# Both run in float32; what differs is the order of the float32 sums (XLA vs torch) and RoPE's inverse
# frequencies (jaxkv computes them in float64 before rounding, torch in float32): measured ~5e-7.
LOGITS_RTOL = 1e-5


def expected_params(hf: dict, tensors: dict) -> dict:
  """jaxkv parameters from HF tensors, written out by hand (the reference for the sliced, sharded read)."""
  d, h, k, dh = hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
  out = {"embed": tensors["model.embed_tokens.weight"], "final_norm": tensors["model.norm.weight"]}
  if not hf.get("tie_word_embeddings"):
    out["lm_head"] = tensors["lm_head.weight"].T
  out["layers"] = []
  for l in range(hf["num_hidden_layers"]):
    t = {n.removeprefix(f"model.layers.{l}."): a for n, a in tensors.items() if n.startswith(f"model.layers.{l}.")}
    layer = {
        "attn_norm": t["input_layernorm.weight"],
        "wq": t["self_attn.q_proj.weight"].T.reshape(d, h, dh),
        "wk": t["self_attn.k_proj.weight"].T.reshape(d, k, dh),
        "wv": t["self_attn.v_proj.weight"].T.reshape(d, k, dh),
        "wo": t["self_attn.o_proj.weight"].T.reshape(h, dh, d),
        "mlp_norm": t["post_attention_layernorm.weight"],
        "w_gate": t["mlp.gate_proj.weight"].T,
        "w_up": t["mlp.up_proj.weight"].T,
        "w_down": t["mlp.down_proj.weight"].T,
    }
    if "self_attn.q_norm.weight" in t:
      layer.update(q_norm=t["self_attn.q_norm.weight"], k_norm=t["self_attn.k_norm.weight"])
    out["layers"].append(layer)
  return out


@pytest.mark.parametrize("tensor", [1, 4])
@pytest.mark.parametrize(
    "arch, tied, shards", [("LlamaForCausalLM", False, 1), ("Qwen3ForCausalLM", True, 3)], ids=["llama", "qwen3"]
)
def test_weights_land_transposed_and_sharded(tmp_path, arch, tied, shards, tensor):
  hf = hf_config(arch, tie_word_embeddings=tied)
  tensors = hf_tensors(hf)
  cfg, params = checkpoint.load(write_checkpoint(tmp_path, hf, tensors, shards), helpers.mesh(tensor))
  assert cfg.qk_norm == (arch == "Qwen3ForCausalLM") and cfg.tie_embeddings == tied and cfg.dtype == "float32"
  want = expected_params(hf, tensors)
  mesh = helpers.mesh(tensor)
  axes = model.param_axes(cfg)
  assert jax.tree.structure(params) == jax.tree.structure(want) == jax.tree.structure(axes, is_leaf=_is_axes)
  for (path, got), w, ax in zip(
      jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(want), jax.tree.leaves(axes, is_leaf=_is_axes)
  ):
    assert got.sharding == mesh_lib.sharding(mesh, ax), path
    np.testing.assert_array_equal(np.asarray(got), w, err_msg=str(path))


def _is_axes(x):
  return isinstance(x, tuple)


@pytest.mark.parametrize("disk", ["bfloat16", "float16"])
def test_disk_dtypes_cast_to_the_configured_dtype(tmp_path, disk):
  disk_dtype = np.dtype(jax.numpy.dtype(disk))
  hf = hf_config(torch_dtype=disk)
  tensors = hf_tensors(hf, dtype=disk_dtype)
  path = write_checkpoint(tmp_path, hf, tensors)
  mesh = helpers.mesh(4)
  cfg, params = checkpoint.load(path, mesh)  # Default: config.json's torch_dtype.
  assert cfg.dtype == disk and params["layers"][0]["wq"].dtype == disk_dtype
  cfg32, params32 = checkpoint.load(path, mesh, dtype="float32")
  assert cfg32.dtype == "float32"
  want = expected_params(hf, tensors)
  for got, got32, w in zip(jax.tree.leaves(params), jax.tree.leaves(params32), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(got), w)
    np.testing.assert_array_equal(np.asarray(got32), w.astype(np.float32))


def test_raw_reader_matches_safetensors(tmp_path):
  """The fallback for a safetensors without numpy bfloat16 reads the same values."""
  hf = hf_config()
  tensors = hf_tensors(hf, dtype=np.dtype(jax.numpy.bfloat16))
  path = os.path.join(write_checkpoint(tmp_path, hf, tensors), checkpoint.WEIGHTS_FILE)
  with safe_open(path, framework="numpy") as f:
    for name in ("model.layers.1.self_attn.o_proj.weight", "model.norm.weight"):
      np.testing.assert_array_equal(checkpoint.read_raw(path, name), f.get_tensor(name))
      np.testing.assert_array_equal(checkpoint.read_raw(path, name), tensors[name])


# As the Qwen3 model cards set it for 128k contexts.
QWEN3_YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768)


@pytest.mark.parametrize(
    "arch,theta,rope",
    [
        ("LlamaForCausalLM", 500_000.0, dict(LLAMA3_ROPE, original_max_position_embeddings=8192)),  # Llama-3.1.
        ("Qwen3ForCausalLM", 1_000_000.0, QWEN3_YARN),
        ("Qwen3ForCausalLM", 1_000_000.0, dict(QWEN3_YARN, beta_fast=16.0, mscale=0.8, mscale_all_dim=0.5)),
        ("Qwen3ForCausalLM", 1_000_000.0, dict(QWEN3_YARN, attention_factor=1.5, truncate=False)),
    ],
)
def test_rope_scaling_matches_transformers(arch, theta, rope):
  """Frequencies and the cos/sin factor of an 8B/32B head (128, real rope_theta) against transformers' own."""
  transformers = pytest.importorskip("transformers", reason="needs the parity extra: pip install -e '.[parity]'")
  from transformers import modeling_rope_utils  # pylint: disable=g-import-not-at-top

  geometry = dict(GEOMETRY, hidden_size=1024, num_attention_heads=8, head_dim=128, max_position_embeddings=131072)
  hf_cfg = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**geometry, rope_theta=theta, rope_scaling=rope)
  want_inv, want_scale = modeling_rope_utils.ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_cfg, "cpu")
  cfg = checkpoint.model_config(hf_config(arch, **geometry, rope_theta=theta, rope_scaling=rope))
  np.testing.assert_allclose(model.rope_frequencies(cfg), want_inv.numpy(), rtol=1e-6)  # torch: float32 powers.
  assert model.rope_attention_scale(cfg) == pytest.approx(want_scale, rel=1e-12)
  assert rope["rope_type"] == "llama3" or model.rope_attention_scale(cfg) != 1.0


def test_long_context_experiments_match_the_checkpoints_scaling():
  """experiments/llama3_8b.py:3.1 and qwen3_32b.py:yarn scale RoPE as the released checkpoints' config.json do."""
  llama = hf_config(rope_theta=500_000.0, rope_scaling=dict(LLAMA3_ROPE, original_max_position_embeddings=8192))
  qwen3 = hf_config("Qwen3ForCausalLM", rope_theta=1_000_000.0, rope_scaling=QWEN3_YARN)
  for experiment, arg, hf in ((llama3_8b, "3.1", llama), (qwen3_32b, "yarn", qwen3)):
    want = checkpoint.model_config(hf)
    got = config_lib.from_config_dict(experiment.get_config(arg)).model
    assert (got.rope_scaling, got.rope_theta) == (want.rope_scaling, want.rope_theta), experiment.__name__
    assert config_lib.from_config_dict(experiment.get_config()).model.rope_scaling is None


def test_config_fields_of_transformers_4_and_5():
  geometry = dict(hf_config(), rope_theta=500_000.0)
  llama3 = dict(LLAMA3_ROPE, original_max_position_embeddings=8192)
  v4 = dict(geometry, rope_scaling=llama3)
  v4_type = dict(geometry, rope_scaling={k: v for k, v in llama3.items() if k != "rope_type"} | {"type": "llama3"})
  v5 = {k: v for k, v in geometry.items() if k != "rope_theta"} | dict(rope_parameters=dict(llama3, rope_theta=5e5))
  cfgs = [checkpoint.model_config(c) for c in (v4, v4_type, v5)]
  assert cfgs[0] == cfgs[1] == cfgs[2]
  assert cfgs[0].rope_theta == 500_000.0 and cfgs[0].rope_scaling == config_lib.RopeScaling(8.0, 1.0, 4.0, 8192)
  no_head_dim = {k: v for k, v in hf_config("Qwen3ForCausalLM").items() if k != "head_dim"}
  cfg = checkpoint.model_config(no_head_dim | {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
  assert cfg.head_dim == 64 // 8 and cfg.qk_norm and cfg.rope_scaling is None and cfg.rope_theta == 1e6
  qwen3_yarn = hf_config("Qwen3ForCausalLM", rope_scaling=QWEN3_YARN)
  assert checkpoint.model_config(qwen3_yarn).rope_scaling == config_lib.RopeScaling(
      factor=4.0, original_max_position=32768, rope_type="yarn"
  )
  assert checkpoint.model_config(hf_config(torch_dtype=None)).dtype == "bfloat16"
  assert checkpoint.model_config(hf_config(), dtype="bfloat16").dtype == "bfloat16"


def _drop(name):
  return lambda hf, t: (hf, {k: v for k, v in t.items() if k != name})


def _reshape(name, shape):
  return lambda hf, t: (hf, t | {name: np.zeros(shape, np.float32)})


def _config(**overrides):
  return lambda hf, t: (hf | overrides, t)


BAD = {
    "unknown architecture": (_config(architectures=["MistralForCausalLM"]), r"unsupported architecture.*Mistral"),
    "rope scaling type": (
        _config(rope_scaling={"rope_type": "dynamic", "factor": 4.0}),
        r"rope scaling type 'dynamic'.*'llama3' \(Llama-3.1\) and 'yarn'",
    ),
    "yarn without original": (
        _config(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
        r"yarn rope scaling without 'original_max_position_embeddings'",
    ),
    "attention bias": (_config(attention_bias=True), r"attention_bias"),
    "mlp bias": (_config(mlp_bias=True), r"mlp_bias"),
    "sliding window": (
        _config(architectures=["Qwen3ForCausalLM"], use_sliding_window=True, sliding_window=64),
        r"use_sliding_window",
    ),
    "activation": (_config(hidden_act="gelu"), r"hidden_act 'gelu'"),
    "quantized": (
        _config(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}),
        r"unsupported quantized checkpoint \(quant_method 'fp8'\)",
    ),
    "missing tensor": (_drop("model.layers.1.mlp.up_proj.weight"), r"no tensor model\.layers\.1\.mlp\.up_proj\.weight"),
    "missing lm_head": (_drop("lm_head.weight"), r"no tensor lm_head\.weight"),
    "shape mismatch": (
        _reshape("model.layers.0.self_attn.k_proj.weight", (32, 64)),
        r"model\.layers\.0\.self_attn\.k_proj\.weight has shape \(32, 64\), expected \(64, 64\)",
    ),
    "bias tensor": (
        lambda hf, t: (hf, t | {"model.layers.0.self_attn.q_proj.bias": np.zeros(128, np.float32)}),
        r"unsupported tensor model\.layers\.0\.self_attn\.q_proj\.bias",
    ),
    "extra layer": (_config(num_hidden_layers=2), r"model\.layers\.2\..* beyond num_hidden_layers = 2"),
    "integer tensor": (
        lambda hf, t: (hf, t | {"model.norm.weight": np.ones(64, np.int8)}),
        r"model\.norm\.weight has dtype I8",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_checkpoint_is_named_before_anything_loads(tmp_path, case):
  mutate, message = BAD[case]
  hf = hf_config()
  hf, tensors = mutate(hf, hf_tensors(hf))
  path = write_checkpoint(tmp_path, hf, tensors, shards=2)
  live = len(jax.live_arrays())
  with pytest.raises(ValueError, match=message):
    checkpoint.load(path, helpers.mesh(4))
  assert len(jax.live_arrays()) <= live


def test_missing_files_are_named(tmp_path):
  hf = hf_config()
  mesh = helpers.mesh(1)
  with pytest.raises(ValueError, match=r"checkpoint directory .*nowhere.* does not exist"):
    checkpoint.load(str(tmp_path / "nowhere"), mesh)
  with pytest.raises(ValueError, match=r"has no config\.json"):
    checkpoint.load(str(tmp_path), mesh)
  (tmp_path / "config.json").write_text(json.dumps(hf))
  (tmp_path / "pytorch_model.bin").write_bytes(b"")
  with pytest.raises(ValueError, match=r"no model\.safetensors or model\.safetensors\.index\.json .*pytorch_model"):
    checkpoint.load(str(tmp_path), mesh)
  write_checkpoint(tmp_path, hf, hf_tensors(hf), shards=2)
  os.remove(tmp_path / "model-00002-of-00002.safetensors")
  with pytest.raises(ValueError, match=r"missing: model-00002-of-00002\.safetensors"):
    checkpoint.load(str(tmp_path), mesh)


def test_kv_heads_not_divisible_by_the_tensor_axis(tmp_path):
  hf = hf_config()
  path = write_checkpoint(tmp_path, hf, hf_tensors(hf))
  with pytest.raises(ValueError, match=r"num_kv_heads = 4 is not divisible by the tensor axis size 8"):
    checkpoint.load(path, helpers.mesh(8))


def test_each_device_reads_only_its_block(tmp_path, monkeypatch):
  hf = hf_config()
  tensors = hf_tensors(hf)
  path = write_checkpoint(tmp_path, hf, tensors)
  reads, real = [], checkpoint._Weights.read  # pylint: disable=protected-access

  def recording(self, name, index):
    block = real(self, name, index)
    reads.append((name, block.shape))
    return block

  monkeypatch.setattr(checkpoint._Weights, "read", recording)  # pylint: disable=protected-access
  checkpoint.load(path, helpers.mesh(4))
  blocks = {}
  for name, shape in reads:
    blocks.setdefault(name, []).append(shape)
  assert blocks.keys() == tensors.keys()
  h_dh, d, f, v = 8 * 16, 64, 128, 256
  assert blocks["model.layers.0.self_attn.q_proj.weight"] == [(h_dh // 4, d)] * 4  # By heads: rows.
  assert blocks["model.layers.0.self_attn.k_proj.weight"] == [(4 * 16 // 4, d)] * 4
  assert blocks["model.layers.0.self_attn.o_proj.weight"] == [(d, h_dh // 4)] * 4  # By heads: columns.
  assert blocks["model.layers.0.mlp.gate_proj.weight"] == [(f // 4, d)] * 4
  assert blocks["model.layers.0.mlp.down_proj.weight"] == [(d, f // 4)] * 4
  assert blocks["lm_head.weight"] == [(v // 4, d)] * 4
  assert set(blocks["model.embed_tokens.weight"]) == {(v, d)}  # Replicated (JAX may read a shared block once).


def test_a_failed_read_deletes_what_was_loaded(tmp_path, monkeypatch):
  hf = hf_config()
  path = write_checkpoint(tmp_path, hf, hf_tensors(hf))
  real, calls = checkpoint._Weights.read, []  # pylint: disable=protected-access

  def failing(self, name, index):
    calls.append(name)
    if len(calls) > 30:
      raise OSError("disk went away")
    return real(self, name, index)

  monkeypatch.setattr(checkpoint._Weights, "read", failing)  # pylint: disable=protected-access
  live = len(jax.live_arrays())
  with pytest.raises(OSError, match="disk went away"):
    checkpoint.load(path, helpers.mesh(4))
  assert len(calls) > 30
  assert len(jax.live_arrays()) <= live


# The checks run against the checkpoint's model (whose geometry differs from the config's), before any weight is read.


@pytest.fixture
def no_weight_read(monkeypatch):
  def read(self, name, index):
    raise AssertionError(f"{name} was read")

  monkeypatch.setattr(checkpoint._Weights, "read", read)  # pylint: disable=protected-access


def _config_dict(tensor: int, **fields):
  """The tiny config (head_dim 16, 8 KV heads, 16 heads, MLP 128, vocabulary 256, 6 layers) with `fields`
  ("section__name": value) set."""
  cd = tiny.get_config()
  cd.mesh.tensor = tensor
  for key, value in fields.items():
    section, name = key.split("__")
    cd[section][name] = value
  return cd


def test_kv_int8_is_checked_against_the_checkpoint_head_dim(tmp_path, no_weight_read):
  hf = hf_config(head_dim=32)
  job = preflight.resolve(_config_dict(4, kv__dtype="int8"), write_checkpoint(tmp_path / "a", hf, hf_tensors(hf)))
  assert job.config.model.head_dim == 32 and job.config.kv.dtype == "int8"
  hf = hf_config()  # head_dim 16, under a config with head_dim 32.
  path = write_checkpoint(tmp_path / "b", hf, hf_tensors(hf))
  with pytest.raises(preflight.InputError, match="must be a multiple of 32; got head_dim 16"):
    preflight.resolve(_config_dict(4, kv__dtype="int8", model__head_dim=32), path)


@pytest.mark.parametrize(
    "tensor, overrides, match",
    [
        (8, {}, "num_kv_heads = 4 is not divisible by the tensor axis size 8"),  # The config has 8 KV heads.
        (4, dict(intermediate_size=130), "mlp_dim = 130 is not divisible by the tensor axis size 4"),
        (4, dict(vocab_size=258), "vocab_size = 258 is not divisible by the tensor axis size 4"),
    ],
)
def test_the_tensor_axis_is_checked_against_the_checkpoint(tmp_path, no_weight_read, tensor, overrides, match):
  hf = hf_config(**overrides)
  path = write_checkpoint(tmp_path, hf, hf_tensors(hf))
  with pytest.raises(preflight.InputError, match=match):
    preflight.resolve(_config_dict(tensor), path)


def test_prompts_are_checked_against_the_checkpoint_positions(tmp_path, no_weight_read):
  hf = hf_config(max_position_embeddings=16)
  job = preflight.resolve(_config_dict(4), write_checkpoint(tmp_path, hf, hf_tensors(hf)))
  preflight.check_prompts(job, [[1] * 10], 7)  # Positions 0..15.
  with pytest.raises(preflight.InputError, match=r"needs 19 positions, more than the model's max_position_emb"):
    preflight.check_prompts(job, [[1] * 10], 10)  # The config's capacity (128) would hold it.
  hf = hf_config(vocab_size=512)
  job = preflight.resolve(_config_dict(4), write_checkpoint(tmp_path / "v", hf, hf_tensors(hf)))
  preflight.check_prompts(job, [[300]], 2)  # Outside the config's vocabulary (256), inside the checkpoint's.


def test_the_layer_split_is_checked_against_the_checkpoint_layers(tmp_path, no_weight_read):
  hf = hf_config()  # 3 layers; the config has 6.
  path = write_checkpoint(tmp_path, hf, hf_tensors(hf))
  cd = _config_dict(4, split__mode="layer")
  assert preflight.resolve(cd).layout.stage_of == (0, 0, 1, 2, 3, 3)
  with pytest.raises(preflight.InputError, match=r"gives 3 layers as \[1, 1, 0, 1\] over 4 devices"):
    preflight.resolve(cd, path)


def test_split_mode_layer_loads_each_layer_on_its_device(tmp_path):
  hf = hf_config()
  path = write_checkpoint(tmp_path, hf, hf_tensors(hf))
  outs = {
      mode: runs.generate_checkpoint(_config_dict(3, split__mode=mode), path, lengths=[3, 5], max_new_tokens=3, seed=0)
      for mode in ("none", "layer")
  }
  assert outs["none"]["tokens_sha256"] == outs["layer"]["tokens_sha256"]
  assert outs["none"]["logits_sha256"] == outs["layer"]["logits_sha256"]
  _, _, params, _ = run.build_from_checkpoint(config_lib.from_config_dict(_config_dict(3, split__mode="layer")), path)
  assert [str(next(iter(l["wq"].devices()))) for l in params["layers"]] == [str(d) for d in jax.devices()[:3]]


# Tokenizer and the generate path with text prompts.


@pytest.mark.parametrize("bos", [True, False])
def test_tokenizer_encodes_with_the_post_processor_and_decodes(tmp_path, bos):
  write_tokenizer(tmp_path, bos)
  tok = tokenizer_lib.Tokenizer.from_dir(str(tmp_path))
  assert tok.vocab_size == 256
  assert tok.encode("w5 w17  w200") == [1] * bos + [5, 17, 200]
  assert tok.decode([1, 5, 17, 200]) == "w5 w17 w200"
  with pytest.raises(ValueError, match="has no tokenizer.json"):
    tokenizer_lib.Tokenizer.from_dir(str(tmp_path / "elsewhere"))


def test_generate_with_text_prompts(tmp_path):
  hf = hf_config()
  path = write_checkpoint(tmp_path, hf, hf_tensors(hf))
  cd = tiny.get_config()
  cd.mesh.tensor = 4
  prompts = ["w5 w6 w7", "w9 w10 w11 w12 w13 w14 w15 w16 w17 w18"]
  with pytest.raises(ValueError, match="has no tokenizer.json"):
    runs.generate_checkpoint(cd, path, prompts=prompts, max_new_tokens=4, seed=0)
  write_tokenizer(tmp_path)
  out = runs.generate_checkpoint(cd, path, prompts=prompts, max_new_tokens=6, seed=0)
  assert out["prompt_tokens"] == [[1, 5, 6, 7], [1, *range(9, 19)]]
  assert out["prompt_lengths"] == [4, 11] and out["model"]["num_layers"] == 3
  inverse = {i: w for w, i in WORDS.items()}
  for toks, text in zip(out["tokens"], out["text"]):
    assert len(toks) == 6
    assert text == " ".join(inverse[t] for t in toks if t != 1)
  # The same sequences from the engine on the same weights, without the tokenizer.
  config = config_lib.from_config_dict(cd)
  cfg, params = checkpoint.load(path, helpers.mesh(4))
  engine = engine_lib.Engine(dataclasses.replace(config, model=cfg), helpers.mesh(4), params)
  assert engine.generate(out["prompt_tokens"], 6).tokens == out["tokens"]
  ids = runs.generate_checkpoint(cd, path, lengths=[3, 5], max_new_tokens=2, seed=0)
  assert "text" not in ids and [len(t) for t in ids["tokens"]] == [2, 2] and ids["prompt_lengths"] == [3, 5]


# Parity with transformers.

FAMILIES = {
    # Llama: Llama-3 rope scaling, its own lm_head, one model.safetensors.
    "llama": dict(
        arch="LlamaForCausalLM",
        config=dict(rope_scaling=dict(LLAMA3_ROPE, original_max_position_embeddings=LLAMA3_ORIGINAL)),
        shard="10GB",
    ),
    # Qwen3: per-head q/k RMSNorm, tied embeddings, sharded into several files with an index.
    "qwen3": dict(arch="Qwen3ForCausalLM", config=dict(tie_word_embeddings=True), shard="100KB"),
    # Qwen3's long-context setting: YaRN rope scaling (its attention factor scales cos and sin).
    "qwen3_yarn": dict(arch="Qwen3ForCausalLM", config=dict(rope_scaling=YARN_ROPE), shard="10GB"),
}


@pytest.fixture(scope="module")
def hf_reference(tmp_path_factory):
  """family -> (checkpoint dir, prompts, greedy tokens [B][NEW_TOKENS], logits f32[NEW_TOKENS, B, V]) from
  transformers, built on first use."""
  torch = helpers.import_extra("torch", "parity")
  transformers = helpers.import_extra("transformers", "parity")
  cache = {}

  def get(family):
    if family in cache:
      return cache[family]
    spec = FAMILIES[family]
    config_cls = getattr(transformers, spec["arch"].replace("ForCausalLM", "Config"))
    hf_cfg = config_cls(
        **GEOMETRY, **spec["config"], rope_theta=10_000.0, max_position_embeddings=512, attn_implementation="eager"
    )
    torch.manual_seed(0)
    net = getattr(transformers, spec["arch"])(hf_cfg).float().eval()
    with torch.no_grad():  # Norm weights away from 1, projections at unit gain, so that every tensor matters.
      for name, p in net.named_parameters():
        if p.ndim == 1:
          p.copy_(1 + 0.1 * torch.randn_like(p))
        elif "embed_tokens" in name:
          p.normal_(0.0, 1.0)
        else:
          p.normal_(0.0, p.shape[1] ** -0.5)
    path = tmp_path_factory.mktemp(family)
    net.save_pretrained(path, safe_serialization=True, max_shard_size=spec["shard"])
    prompts = helpers.prompts(PROMPT_LENS, seed=1, vocab=GEOMETRY["vocab_size"])
    tokens, logits = [], []
    with torch.no_grad():
      for p in prompts:  # Greedy, recomputing the whole sequence each step: no cache on the reference side.
        ids, lg = list(p), []
        for _ in range(NEW_TOKENS):
          row = net(torch.tensor([ids])).logits[0, -1].float().numpy()
          lg.append(row)
          ids.append(int(row.argmax()))
        tokens.append(ids[len(p) :])
        logits.append(np.stack(lg))
    cache[family] = (str(path), prompts, tokens, np.stack(logits, axis=1))
    return cache[family]

  return get


@pytest.mark.parametrize("tensor", [1, 4])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_and_greedy_tokens_match_transformers(hf_reference, family, tensor):
  path, prompts, want_tokens, want_logits = hf_reference(family)
  files = sorted(os.listdir(path))
  assert (checkpoint.INDEX_FILE in files) == (family == "qwen3"), files
  mesh = helpers.mesh(tensor)
  cfg, params = checkpoint.load(path, mesh)
  qwen3 = family.startswith("qwen3")
  assert cfg.dtype == "float32" and cfg.qk_norm == qwen3 and cfg.tie_embeddings == (family == "qwen3")
  assert {"llama": "llama3", "qwen3": None, "qwen3_yarn": "yarn"}[family] == getattr(
      cfg.rope_scaling, "rope_type", None
  )
  config = config_lib.Config(
      model=cfg,
      kv=config_lib.KVConfig(placement="host", pipeline_depth=2, block=8, group_layers=1),  # Depth 2 uncapped.
      engine=config_lib.EngineConfig(capacity=64, prefill_chunk=16),
      sampling=config_lib.SamplingConfig(),
      mesh=(("tensor", tensor),),
  )
  res = engine_lib.Engine(config, mesh, params).generate(prompts, NEW_TOKENS, keep_logits=True)
  assert res.transport["placement"] == "host" and res.transport["depth"] == 2
  assert res.tokens == want_tokens
  err = np.abs(res.logits - want_logits).max() / np.abs(want_logits).max()
  assert err <= LOGITS_RTOL, f"relative logits error {err:.2e} > {LOGITS_RTOL:.0e}"
