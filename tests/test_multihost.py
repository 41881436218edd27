"""Two processes of two simulated CPU devices each, joined through jax.distributed on localhost, decode like one
process of four. Every run is `python -m jaxkv.generate` in subprocesses that the test starts and always kills.

The reference for the bits is one process of four devices that also joins jax.distributed, so that its
all-reduces run over the same CPU collectives (gloo) as the two-process run. A plain one-process run sums the
all-reduces in XLA:CPU's in-process order instead: the same tokens, logits that differ in the last bits.
"""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from jaxkv import distributed
from jaxkv import generate as generate_app

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(generate_app.__file__)))  # Holds the jaxkv package.
TIMEOUT_S = 600  # For all the processes of all the runs together.
# New tokens after generate's default prompts (5, 12, 1 and 9 tokens): the longest one's window grows past 16 rows (2
# blocks of 8) during the decode. Process 1 compiles every program (JAX writes the persistent compilation cache from
# process 0 only), so each window size more, like each step more, costs every 2-process run.
NEW_TOKENS = 6
HOST = ("--kv_placement=host", "--kv_pipeline_depth=2", f"--max_new_tokens={NEW_TOKENS}")
DEVICE = ("--kv_placement=device", f"--max_new_tokens={NEW_TOKENS}")


def _env() -> dict:
  """This environment without the device count, platform and distributed settings of the test process."""
  drop = {"XLA_FLAGS", "JAX_PLATFORMS", "PJRT_NPROC", *distributed.ENV}
  return {k: v for k, v in os.environ.items() if k not in drop}


def _free_ports(n: int) -> list[int]:
  """n distinct ports that are free now."""
  socks = [socket.socket() for _ in range(n)]
  try:
    for s in socks:
      s.bind(("localhost", 0))
    return [s.getsockname()[1] for s in socks]
  finally:
    for s in socks:
      s.close()


def _start(tmp_path, name: str, port: int | None, processes: int, devices: int, *flags) -> list[tuple]:
  """Starts generate in `processes` processes of `devices` CPU devices each, joined through jax.distributed at `port`
  (None: one process without jax.distributed); returns per process (the process, its files)."""
  dist = [] if port is None else [f"--coordinator_address=localhost:{port}", f"--num_processes={processes}"]
  runs = []
  for i in range(processes):
    files = {k: tmp_path / f"{name}.{i}.{k}" for k in ("json", "out", "err")}
    cmd = [sys.executable, "-m", generate_app.__name__, f"--cpu_devices={devices}", f"--json_out={files['json']}"]
    cmd += dist + ([] if port is None else [f"--process_id={i}"]) + list(flags)
    with open(files["out"], "w") as out, open(files["err"], "w") as err:
      runs.append((subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=out, stderr=err), files))
  return runs


def _generate(tmp_path, runs: dict[str, tuple]) -> dict[str, list[dict]]:
  """Runs of generate, all at once (the 2-process ones mostly wait on each other): name -> (processes, devices per
  process, flags...), processes None for one process without jax.distributed. Returns per run and process its stdout
  and the JSON it wrote (None where it wrote none)."""
  ports = iter(_free_ports(len(runs)))
  started = {}
  try:
    for name, (processes, devices, *flags) in runs.items():
      port = None if processes is None else next(ports)
      started[name] = _start(tmp_path, name, port, processes or 1, devices, *flags)
    deadline = time.monotonic() + TIMEOUT_S
    for proc, _ in [r for rs in started.values() for r in rs]:
      proc.wait(timeout=max(deadline - time.monotonic(), 1))
  finally:
    for proc, _ in [r for rs in started.values() for r in rs]:
      if proc.poll() is None:
        proc.kill()  # Not terminate(): JAX's preemption notifier catches SIGTERM.
        proc.wait()
  results = {}
  for name, rs in started.items():
    results[name] = []
    for proc, files in rs:
      assert proc.returncode == 0, files["err"].read_text()[-3000:]
      out = json.loads(files["json"].read_text()) if files["json"].exists() else None
      results[name].append(dict(stdout=files["out"].read_text(), json=out))
  return results


def _hashes(out: dict) -> tuple[str, str]:
  return out["tokens_sha256"], out["logits_sha256"]


def test_two_processes_decode_like_one(tmp_path):
  runs = _generate(
      tmp_path,
      dict(
          one=(1, 4, *HOST),
          host=(2, 2, *HOST),
          device=(2, 2, *DEVICE),
          plain=(None, 4, *DEVICE),
          split=(2, 2, *HOST, "--kv_host_attention"),  # Host attention, share measured.
      ),
  )
  [one], host, device, [plain], split = runs["one"], runs["host"], runs["device"], runs["plain"], runs["split"]
  ref = one["json"]
  assert ref["processes"] == 1 and [len(t) for t in ref["tokens"]] == [NEW_TOKENS] * 4
  for run in (host, device):
    out = run[0]["json"]
    assert out["processes"] == 2 and len(out["devices"]) == 4
    assert _hashes(out) == _hashes(ref) and out["tokens"] == ref["tokens"]
    assert f"logits_sha256 {ref['logits_sha256']}" in run[0]["stdout"]
    assert run[1]["json"] is None and "tokens_sha256" not in run[1]["stdout"]  # Only process 0 reports.
  # Each process holds its devices' half of the KV heads in its pinned host memory.
  local = host[0]["json"]["transport"]["kv_window_bytes_process"]
  assert local > 0 and 2 * local == ref["transport"]["kv_window_bytes_process"]
  assert host[0]["json"]["transport"]["h2d_bytes"] == ref["transport"]["h2d_bytes"]  # Totals over all devices.
  # Host attention sums in another order (not the same bits) and splits at process 0's measured share everywhere.
  assert split[0]["json"]["tokens"] == ref["tokens"]
  assert split[0]["json"]["transport"]["host_attention"]["source"] == "measured"
  # In-process all-reduces round differently, not enough to change a token.
  assert plain["json"]["processes"] == 1 and plain["json"]["tokens"] == ref["tokens"]


def test_settings_come_from_the_flags_then_the_environment():
  env = {"JAX_COORDINATOR_ADDRESS": "node0:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
  assert distributed.settings(None, None, None, {}) is None  # One process: jax.distributed is not started.
  assert distributed.settings(None, None, None, env) == dict(
      coordinator_address="node0:1234", num_processes=4, process_id=3
  )
  assert distributed.settings("localhost:5", None, 0, env) == dict(
      coordinator_address="localhost:5", num_processes=4, process_id=0
  )
  assert distributed.settings(None, 2, None, {}) == dict(coordinator_address=None, num_processes=2, process_id=None)
  with pytest.raises(ValueError, match="JAX_PROCESS_ID must be an integer"):
    distributed.settings(None, None, None, {"JAX_PROCESS_ID": "one"})
