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
import tokenizers
from safetensors import safe_open
from safetensors.numpy import save_file

import helpers
from experiments import tiny
from jaxkv import checkpoint
from jaxkv import config as config_lib
from jaxkv import engine as engine_lib
from jaxkv import mesh as mesh_lib
from jaxkv import model
from jaxkv import run
from jaxkv import tokenizer as tokenizer_lib

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
# Llama-3 scaling with a short original context, so that the tiny head_dim has frequencies in all three bands
# (wavelengths below 8 kept, 8..32 smoothed, above 32 divided by the factor).
LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
LLAMA3_ORIGINAL = 32
PROMPT_LENS = (11, 20)  # Two prefill chunks of 16 for the longer one; left padding for the shorter.
NEW_TOKENS = 32
# Relative error of the logits: max |jaxkv - transformers| / max |transformers| over every step and sequence.
# Both run in float32; what differs is the order of the float32 sums (XLA vs torch) and RoPE's inverse
# frequencies (jaxkv computes them in float64 before rounding, torch in float32): measured ~5e-7.
LOGITS_RTOL = 1e-5


# Checkpoints written with safetensors.numpy (no torch).


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
    "rope scaling type": (_config(rope_scaling={"rope_type": "yarn", "factor": 4.0}), r"rope scaling type 'yarn'"),
    "attention bias": (_config(attention_bias=True), r"attention_bias"),
    "mlp bias": (_config(mlp_bias=True), r"mlp_bias"),
    "sliding window": (
        _config(architectures=["Qwen3ForCausalLM"], use_sliding_window=True, sliding_window=64),
        r"use_sliding_window",
    ),
    "activation": (_config(hidden_act="gelu"), r"hidden_act 'gelu'"),
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


# Tokenizer and the generate path with text prompts.

WORDS = {"<unk>": 0, "<bos>": 1, **{f"w{i}": i for i in range(2, 256)}}


def write_tokenizer(path, bos: bool = True) -> None:
  """A word-level tokenizer.json over the whole tiny vocabulary; with `bos`, its post-processor adds <bos>."""
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(WORDS, unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens(["<bos>"])
  if bos:
    tok.post_processor = tokenizers.processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
  tok.save(os.path.join(path, tokenizer_lib.TOKENIZER_FILE))


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
    run.generate_checkpoint(cd, path, prompts=prompts, max_new_tokens=4, seed=0)
  write_tokenizer(tmp_path)
  out = run.generate_checkpoint(cd, path, prompts=prompts, max_new_tokens=6, seed=0)
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
  ids = run.generate_checkpoint(cd, path, lengths=[3, 5], max_new_tokens=2, seed=0)
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
}


@pytest.fixture(scope="module")
def hf_reference(tmp_path_factory):
  """family -> (checkpoint dir, prompts, greedy tokens [B][NEW_TOKENS], logits f32[NEW_TOKENS, B, V]) from
  transformers, built on first use."""
  torch = pytest.importorskip("torch", reason="the parity tests need the parity extra: pip install -e '.[parity]'")
  transformers = pytest.importorskip(
      "transformers", reason="the parity tests need the parity extra: pip install -e '.[parity]'"
  )
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
  assert cfg.dtype == "float32" and cfg.qk_norm == (family == "qwen3") and cfg.tie_embeddings == (family == "qwen3")
  assert (cfg.rope_scaling is not None) == (family == "llama")
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
