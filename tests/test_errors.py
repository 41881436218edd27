"""Every bad input raises its promised error, before any work; the apps print it as one line with an exit status."""

import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import helpers
import jax
import pytest

import jaxkv
from experiments import tiny
from jaxkv import config as config_lib
from jaxkv import engine as engine_lib
from jaxkv import mesh as mesh_lib
from jaxkv import model


@pytest.mark.parametrize(
    "prompts, new, match",
    [
        ([[1] * 129], 1, "prompt 0 has 129 tokens, longer than the cache capacity 128"),
        ([[1] * 100, [2] * 5], 30, r"longest prompt \(100 tokens\) plus max_new_tokens \(30\) needs 129 cache rows"),
        ([[1, 2], []], 4, "prompt 1 is empty"),
        ([[1, 256]], 4, r"token ids outside \[0, 256\): \[256\]"),
        ([[1, -1]], 4, "token ids outside"),
        ([], 4, "no prompts given"),
        ([[1]], 0, "max_new_tokens must be >= 1"),
    ],
)
def test_bad_generate_input(prompts, new, match):
  with pytest.raises(ValueError, match=match):
    helpers.engine(1, placement="host").generate(prompts, new)


def test_kv_heads_not_divisible_by_the_tensor_axis_names_both_numbers():
  cfg = dataclasses.replace(helpers.tiny_config().model, num_kv_heads=4, num_heads=8)
  with pytest.raises(ValueError, match="num_kv_heads = 4 is not divisible by the tensor axis size 8"):
    model.init_params(cfg, jax.random.key(0), helpers.mesh(8))


def test_prefill_chunk_must_be_a_multiple_of_the_block():
  with pytest.raises(ValueError, match=r"prefill_chunk \(12\) must be a multiple of kv.block \(8\)"):
    helpers.engine(1, chunk=12)


@pytest.mark.parametrize(
    "axes, match",
    [
        ((("data", 2),), "needs a 'tensor' axis"),
        ((("tensor", -1), ("data", -1)), "at most one mesh axis may be -1"),
        ((("tensor", 16),), "needs 16 devices, only 8 available"),
        ((("tensor", 0),), "positive or -1"),
    ],
)
def test_bad_mesh(axes, match):
  with pytest.raises(ValueError, match=match):
    mesh_lib.make_mesh(axes)


def test_mesh_minus_one_takes_the_remaining_devices():
  mesh = mesh_lib.make_mesh((("data", 2), ("tensor", -1)))
  assert dict(mesh.shape) == {"data": 2, "tensor": 4}
  assert mesh_lib.make_mesh((("tensor", 3),)).shape["tensor"] == 3  # A mesh may use a subset of the devices.


@pytest.mark.parametrize(
    "section, field, value, match",
    [
        ("model", "num_layers", 0, "model.num_layers must be positive"),
        ("model", "num_heads", 12, r"num_heads \(12\) must be a multiple of model.num_kv_heads \(8\)"),
        ("model", "dtype", "int4", "model.dtype must be"),
        ("kv", "placement", "disk", "kv.placement must be one of"),
        ("kv", "pipeline_depth", -1, "kv.pipeline_depth must be >= 0"),
        ("kv", "transport_debug", 7, "kv.transport_debug must be 0..3"),
        ("sampling", "top_p", 0.0, r"sampling.top_p must be in \(0, 1\]"),
        ("sampling", "temperature", -1.0, "sampling.temperature must be >= 0"),
    ],
)
def test_bad_config_values(section, field, value, match):
  cd = tiny.get_config()
  cd[section][field] = value
  with pytest.raises(ValueError, match=match):
    config_lib.from_config_dict(cd)


def test_unknown_config_field_is_named():
  cd = tiny.get_config().to_dict()
  cd["kv"]["pipline_depth"] = 2
  with pytest.raises(ValueError, match="unknown kv field.*pipline_depth"):
    config_lib.from_config_dict(cd)


@pytest.mark.parametrize("field, value", [("mlp_dim", 100), ("vocab_size", 260)])
def test_engine_rejects_a_mesh_that_does_not_split_the_model(field, value):
  cfg = helpers.tiny_config()
  params = helpers.params(1)
  mc = dataclasses.replace(cfg.model, **{field: value})
  with pytest.raises(ValueError, match=f"{field} = {value} is not divisible by the tensor axis size 8; choose"):
    engine_lib.Engine(dataclasses.replace(cfg, model=mc), helpers.mesh(8), params)


# The apps, each case a process of its own (helpers.fork_apps) whose weight building and checkpoint loading fail loudly:
# each case must stop at its check, before any weights exist. The host has 8 GiB of RAM available there, so that the
# memory check's cases do not depend on the machine.
_PRELUDE = """
import jaxkv.checkpoint, jaxkv.gguf_loader, jaxkv.host.memory, jaxkv.model
def built(*args, **kwargs):
  raise SystemExit("weights were built")
jaxkv.model.init_params = jaxkv.checkpoint.load = jaxkv.gguf_loader.load = built
jaxkv.host.memory.available_host_bytes = lambda: 8 * 2**30
"""
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(jaxkv.__file__)))
GEN, BENCH, GATES = "jaxkv.generate", "jaxkv.bench", "jaxkv.gates"  # Each defines its flags: one per process.
SERVE, SERVE_BENCH = "jaxkv.serve", "jaxkv.serve_bench"
WITHIN_S = 90  # An input error ends the app before any heavy work: within seconds of its start (4 apps at a time).
ALARM_S = 300  # A run's bound.


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _cases(tmp) -> dict:
  """name -> (app module, flags, the error line's text, exit status)."""
  hf = helpers.hf_config()
  ckpt = helpers.write_checkpoint(tmp / "ckpt", hf, helpers.hf_tensors(hf), shards=2)
  corrupt = tmp / "corrupt"
  corrupt.mkdir()
  (corrupt / "config.json").write_text("{not json")
  partial = helpers.write_checkpoint(tmp / "partial", hf, helpers.hf_tensors(hf), shards=2)
  os.remove(os.path.join(partial, "model-00002-of-00002.safetensors"))
  port = _free_port()
  (tmp / "a_folder").mkdir()
  return {
      "mesh": (GEN, ["--cpu_devices=3"], "model.num_kv_heads = 8 is not divisible by the tensor axis size 3", 2),
      "depth": (GEN, ["--kv_pipeline_depth=-1"], "kv.pipeline_depth must be >= 0, got -1", 2),
      "max_new_tokens": (GEN, ["--max_new_tokens=-1"], "max_new_tokens must be >= 1, got -1", 2),
      "layer_split": (GEN, ["--split_mode=layer", "--layer_split=1,0"], "layer_split values must be positive", 2),
      "layer_split_devices": (
          GEN,
          ["--cpu_devices=2", "--split_mode=layer", "--layer_split=1,1,1"],
          "layer_split has 3 values for 2 devices",
          2,
      ),
      "capacity": (GEN, ["--prompt_len=200"], "prompt 0 has 200 tokens, longer than the cache capacity 128", 2),
      "capacity_new": (GEN, ["--prompt_len=100", "--max_new_tokens=40"], "needs 139 cache rows", 2),
      "auto_layer": (GEN, ["--kv_placement=auto", "--split_mode=layer"], "kv.placement auto plans one mesh", 2),
      "json_out": (GEN, [f"--json_out={tmp}/missing/out.json"], f"the folder {tmp}/missing does not exist", 2),
      "budget": (
          GEN,
          ["--kv_placement=auto", "--kv_device_budget_gib=1e6"],
          "kv.device_budget_gib=1e+06 is more than the host's memory over its 4 devices",
          2,
      ),
      "prompt_len": (GEN, ["--prompt_len=3,x"], "--prompt_len must be comma-separated integers", 2),
      "batch_prompt_len": (GEN, ["--batch=3", "--prompt_len=1,2"], "--batch=3 but 2 --prompt_len values", 2),
      "parallel": (GEN, ["--sequences=4", "--parallel=0"], "--sequences must be >= 0 and --parallel >= 1", 2),
      "capacity_0": (GEN, ["--capacity=0"], "engine.capacity and engine.prefill_chunk must be positive", 2),
      "batch_0": (GEN, ["--batch=0"], "--batch must be >= 1, got 0", 2),
      "batch_negative": (GEN, ["--batch=-2"], "--batch must be >= 1, got -2", 2),
      "config_missing": (GEN, ["--config=nowhere.py"], "--config=nowhere.py: no such file", 2),
      "flag_value": (GEN, ["--batch=x"], "flag --batch=x", 2),
      "argument": (GEN, ["extra"], "unexpected arguments: ['extra']", 2),
      "kv_int8": (GEN, ["--kv_dtype=int8"], "must be a multiple of 32; got head_dim 16", 2),
      "speculate_penalty": (
          GEN,
          ["--speculate=lookup", "--config.sampling.presence_penalty=0.5"],
          "--speculate=lookup verifies drafts without penalties: it needs no presence, frequency or repetition penalty",
          2,
      ),
      "speculate_self": (
          GEN,
          ["--speculate=self"],
          "--speculate=self drafts over a copy of the KV in int4 (32-value blocks along head_dim): model.head_dim must "
          "be a multiple of 32, got 16; use --speculate=lookup",
          2,
      ),
      "checkpoint_corrupt": (GEN, [f"--checkpoint_dir={corrupt}"], "config.json is not valid JSON", 1),
      "checkpoint_incomplete": (
          GEN,
          [f"--checkpoint_dir={partial}"],
          "lists weight files that are missing: model-00002-of-00002.safetensors",
          1,
      ),
      # A checkpoint run without --config takes the engine's capacity (4096 rows), not the tiny config's 128.
      "checkpoint_capacity": (
          GEN,
          [f"--checkpoint_dir={ckpt}", "--prompt_len=5000"],
          "prompt 0 has 5000 tokens, longer than the cache capacity 4096",
          2,
      ),
      "processes": (
          GEN,
          [
              f"--coordinator_address=127.0.0.1:{port}",
              "--num_processes=2",
              "--process_id=0",
              "--distributed_timeout_s=2",
          ],
          f"process 1 did not join the coordinator at 127.0.0.1:{port} within 2 s",
          1,
      ),
      "bench_kv_dtype": (BENCH, ["--arms=device,host_d1_int8"], "got head_dim 16", 2),
      "bench_output": (BENCH, [f"--md_out={tmp}/missing/bench.md"], "does not exist", 2),
      "bench_contexts": (BENCH, ["--contexts=1,x"], "--contexts must be comma-separated integers", 2),
      "bench_arm": (BENCH, ["--arms=device,bogus"], "unknown arm 'bogus'", 2),
      "config_field": (GEN, ["--config.x.y=1"], "--config.x.y: the config has no field x", 2),
      "config_field_typo": (GEN, ["--config.kv.blok=16"], "--config.kv.blok: the config has no field blok", 2),
      "config_variant": (
          GEN,
          ["--config=experiments/llama3_8b.py:bogus"],
          "experiments/llama3_8b.py has no variant 'bogus': it takes no variant or one of: 3.1",
          2,
      ),
      "config_file": (GEN, ["--config=README.md"], "--config: ", 2),
      "json_out_folder": (GEN, [f"--json_out={tmp}/a_folder"], f"--json_out={tmp}/a_folder is a folder", 2),
      "seed": (GEN, ["--seed=-1"], "flag --seed=-1: -1 is not a non-negative integer", 2),
      "coordinator": (
          GEN,
          ["--coordinator_address=nohost", "--num_processes=2", "--process_id=0"],
          "the coordinator address 'nohost' is not host:port",
          2,
      ),
      "num_processes": (GEN, ["--num_processes=0"], "the number of processes must be >= 1, got 0", 2),
      "process_id": (
          GEN,
          [f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2", "--process_id=5"],
          "the process id must be in [0, 2), got 5",
          2,
      ),
      "host_memory": (
          GEN,
          ["--config=experiments/llama3_8b.py"],
          "the model's weights (16.06 GB: 8,030,261,248 parameters in bfloat16) need 14.96 GiB of host RAM on CPU "
          "devices, but this host has 8.00 GiB available",
          2,
      ),
      "gates_arm": (GATES, ["--arms=device,bogus"], "unknown arm 'bogus'", 2),
      "gates_no_arms": (GATES, ["--arms="], "--arms is empty", 2),
      "serve_port": (SERVE, ["--port=99999"], "flag --port=99999: 99999 is not an integer in the range [1, 65535]", 2),
      "serve_bench_requests": (SERVE_BENCH, ["--requests=0"], "flag --requests=0: 0 is not a positive integer", 2),
      "serve_bench_url": (
          SERVE_BENCH,
          ["--url=http://127.0.0.1:1", "--server_flags=--parallel=2"],
          "--server_flags starts a server and --url drives a running one: give one of them",
          2,
      ),
      "serve_api_key_file": (
          SERVE,
          [f"--port={_free_port()}", "--api_key_file=no_such_key_file"],
          "cannot read the API key file no_such_key_file (No such file or directory); fix --api_key_file",
          2,
      ),
      "serve_prompt": (
          SERVE,
          ["--prompt=hi", "--max_new_tokens=4"],
          "jaxkv.serve takes its prompts from requests: drop --prompt, --max_new_tokens",
          2,
      ),
      "serve_both": (
          SERVE,
          ["--gguf=m.gguf", f"--checkpoint_dir={ckpt}"],
          "give --checkpoint_dir or --gguf, not both",
          2,
      ),
      "serve_body": (SERVE, ["--max_body_mb=0"], "--max_body_mb must be > 0, got 0", 2),
      "serve_slot_save_path": (
          SERVE,
          [f"--slot_save_path={tmp}/slots"],
          "--slot_save_path saves slots as prefix cache blocks: give --prefix_cache_gib too",
          2,
      ),
      "serve_speculate_penalty": (
          SERVE,
          [f"--port={_free_port()}", "--speculate=lookup", "--config.sampling.repetition_penalty=1.1"],
          "--speculate=lookup verifies drafts without penalties: it needs no presence, frequency or repetition penalty",
          2,
      ),
      "serve_gguf": (
          SERVE,
          [f"--gguf={tmp}/missing.gguf", f"--port={_free_port()}"],
          "missing.gguf' does not exist",
          1,
      ),
  }


# Each app's --help groups hold every flag that the app and jaxkv.apps.cli define, each once.
_GROUPS_CHECK = """
import importlib, sys
from absl import flags
app = importlib.import_module(sys.argv[1])
shared = [m.__name__ for m in vars(app).values() if getattr(m, "__name__", None) == "jaxkv.apps.cli"]
groups = [h.name for holders in app.HELP_GROUPS.values() for h in holders]
own = {f.name for m in [app.__name__, *shared] for f in flags.FLAGS.get_flags_for_module(m)}
assert len(groups) == len(set(groups)) and set(groups) == own, (sorted(own - set(groups)), groups)
"""
GROUPS_APPS = ("jaxkv.apps.generate", "jaxkv.bench.__main__", "jaxkv.apps.gates", "jaxkv.apps.serve_bench")
NO_ACCELERATOR = shutil.which("nvidia-smi") is None


@pytest.fixture(scope="module")
def apps(tmp_path_factory):
  """(the input error cases (_cases), name -> (exit status, stdout, stderr, seconds) of the runs of this module but
  Ctrl-C's, all in one batch (helpers.fork_apps): the cases, --cpu_devices=0 where no accelerator may be present, --help and
  each app's groups check)."""
  tmp = tmp_path_factory.mktemp("apps")
  cases = _cases(tmp)
  runs = {name: ["-m", module, *flags_] for name, (module, flags_, _, _) in cases.items()}
  if NO_ACCELERATOR:
    runs["cpu_devices_0"] = ["-m", GEN, "--cpu_devices=0"]
  runs["help"] = ["-m", GEN, "--help"]
  runs |= {f"groups {app}": ["-c", _GROUPS_CHECK, app] for app in GROUPS_APPS}
  return cases, helpers.fork_apps(tmp / "runs", runs, prelude=_PRELUDE, parallel=4, alarm_s=ALARM_S)


@pytest.fixture(scope="module")
def app_errors(apps):
  """name -> (expected text, status, the process's exit status, stderr, seconds) of each input error case."""
  cases, runs = apps
  return {name: (case[2], case[3], runs[name][0], runs[name][2], runs[name][3]) for name, case in cases.items()}


def _error_lines(stderr: str) -> list[str]:
  """stderr without absl's log lines (I1201 12:00:00.000 ...) and tqdm's."""
  return [l for l in stderr.splitlines() if l.strip() and not (l[:1] in "IWE" and l[1:5].isdigit())]


CASES = (
    "mesh",
    "depth",
    "max_new_tokens",
    "layer_split",
    "layer_split_devices",
    "capacity",
    "capacity_new",
    "auto_layer",
    "json_out",
    "budget",
    "prompt_len",
    "batch_prompt_len",
    "parallel",
    "capacity_0",
    "batch_0",
    "batch_negative",
    "config_missing",
    "flag_value",
    "argument",
    "kv_int8",
    "speculate_penalty",
    "speculate_self",
    "checkpoint_corrupt",
    "checkpoint_incomplete",
    "checkpoint_capacity",
    "processes",
    "bench_kv_dtype",
    "bench_output",
    "bench_contexts",
    "bench_arm",
    "config_field",
    "config_field_typo",
    "config_variant",
    "config_file",
    "json_out_folder",
    "seed",
    "coordinator",
    "num_processes",
    "process_id",
    "host_memory",
    "gates_arm",
    "gates_no_arms",
    "serve_port",
    "serve_bench_requests",
    "serve_bench_url",
    "serve_api_key_file",
    "serve_prompt",
    "serve_both",
    "serve_body",
    "serve_slot_save_path",
    "serve_speculate_penalty",
    "serve_gguf",
)


def test_every_case_runs(app_errors):
  assert tuple(app_errors) == CASES


@pytest.mark.parametrize("name", CASES)
def test_an_input_error_is_one_line_with_its_exit_status(app_errors, name):
  text, status, returncode, stderr, seconds = app_errors[name]
  lines = _error_lines(stderr)
  assert "Traceback" not in stderr and "weights were built" not in stderr, stderr[-3000:]
  assert lines and lines[0].startswith("python3 -m jaxkv.") or name == "processes", stderr[-3000:]
  assert "error: " in lines[0] and text in lines[0], (text, stderr[-3000:])
  assert len(lines) == 1 or (len(lines) == 2 and lines[1].startswith("  hint: ")), lines
  assert returncode == status, (returncode, stderr[-3000:])
  assert seconds < WITHIN_S, seconds


@pytest.mark.skipif(not NO_ACCELERATOR, reason="an accelerator may be present")
def test_no_accelerator_with_cpu_devices_0(apps):
  status, _, stderr, _ = apps[1]["cpu_devices_0"]
  lines = _error_lines(stderr)
  assert status == 2 and "--cpu_devices=0 runs on the accelerators, and JAX finds none" in lines[0], lines
  assert len(lines) == 2 and "--cpu_devices=N" in lines[1]


@pytest.mark.parametrize("app", GROUPS_APPS)
def test_help_groups_hold_every_flag_of_the_app(apps, app):
  status, _, stderr, _ = apps[1][f"groups {app}"]
  assert status == 0, stderr[-2000:]


def test_help_lists_the_app_flags_in_groups(apps):
  status, stdout, stderr, _ = apps[1]["help"]
  assert status == 0, stderr[-2000:]
  for line in ("model and config:", "KV cache:", "split:", "serving:", "multi-host:", "output:"):
    assert line in stdout.splitlines(), line
  assert "  --kv_placement <device|host|auto>  (config kv.placement)" in stdout.splitlines()
  assert "  --cpu_devices=4" in stdout and "  --config=" in stdout
  assert "--logtostderr" not in stdout and len(stdout.splitlines()) < 120


def test_ctrl_c_prints_interrupted_and_exits_130():
  """SIGINT in the middle of a decode (its progress bar is up): one line, exit status 130, at once."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  cmd = [sys.executable, "-m", GEN, "--capacity=4096", "--batch=1", "--prompt_len=1", "--max_new_tokens=4000"]
  proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  try:
    os.set_blocking(proc.stderr.fileno(), False)
    err, deadline = b"", time.monotonic() + 300
    while b"decode steps" not in err and proc.poll() is None and time.monotonic() < deadline:
      time.sleep(0.2)
      err += proc.stderr.read() or b""
    assert b"decode steps" in err, err.decode()[-3000:]  # The bar shows after 5 s of work.
    proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    returncode = proc.wait(timeout=60)
    assert time.monotonic() - t0 < 10
  finally:
    proc.kill()
  os.set_blocking(proc.stderr.fileno(), True)
  err = (err + proc.stderr.read()).decode()
  lines = [l for l in _error_lines(err) if "decode steps" not in l]  # The progress bar's lines (\r) apart.
  assert returncode == 130 and lines == ["interrupted"], (returncode, err[-3000:])
