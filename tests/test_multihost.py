"""Two processes of two simulated CPU devices each, joined through jax.distributed on localhost, decode like one
process of four. Every distributed run is `python -m jaxkv.generate` in processes of their own (helpers.fork_apps).

The reference for the bits is one process of four devices that also joins jax.distributed, so that its
all-reduces run over the same CPU collectives (gloo) as the two-process run. A plain one-process run (generate's run in
the test process) sums the all-reduces in XLA:CPU's in-process order instead: the same tokens, logits that differ in
the last bits.
"""

import json
import socket

import helpers
import pytest

from experiments import tiny
from jaxkv import distributed
from jaxkv import generate as generate_app
from jaxkv.apps import runs as runs_lib

TIMEOUT_S = 600  # For each process.
# New tokens after generate's default prompts (5, 12, 1 and 9 tokens): the longest one's window grows past 16 rows (2
# blocks of 8) during the decode. Process 1 compiles every program (JAX writes the persistent compilation cache from
# process 0 only), so each window size more, like each step more, costs every 2-process run.
NEW_TOKENS = 6
PROMPT_LENGTHS = [5, 12, 1, 9]  # generate's default --prompt_len.
HOST = ("--kv_placement=host", "--kv_pipeline_depth=2", f"--max_new_tokens={NEW_TOKENS}")
DEVICE = ("--kv_placement=device", f"--max_new_tokens={NEW_TOKENS}")


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


def _generate(tmp_path, runs: dict[str, tuple]) -> dict[str, list[dict]]:
  """Runs of generate joined through jax.distributed, every process at once (the 2-process ones mostly wait on each
  other), each forked from one process that imported the library (helpers.fork_apps) without the test process's device
  count, platform and distributed settings: name -> (processes, devices per process, flags...). Returns per run and
  process its stdout and the JSON it wrote (None where it wrote none)."""
  ports = iter(_free_ports(len(runs)))
  argv, json_out = {}, {}
  for name, (processes, devices, *flags) in runs.items():
    dist = [f"--coordinator_address=localhost:{next(ports)}", f"--num_processes={processes}"]
    for i in range(processes):
      json_out[f"{name}.{i}"] = tmp_path / f"{name}.{i}.json"
      cmd = [f"--cpu_devices={devices}", f"--json_out={json_out[f'{name}.{i}']}", *dist, f"--process_id={i}", *flags]
      argv[f"{name}.{i}"] = ["-m", generate_app.__name__, *cmd]
  env = {k: None for k in ("PJRT_NPROC", *distributed.ENV)}
  done = helpers.fork_apps(tmp_path / "runs", argv, parallel=len(argv), alarm_s=TIMEOUT_S, env=env)
  results = {}
  for name, (processes, *_) in runs.items():
    results[name] = []
    for i in range(processes):
      status, stdout, stderr, _ = done[f"{name}.{i}"]
      assert status == 0, stderr[-3000:]
      out = json_out[f"{name}.{i}"]
      results[name].append(dict(stdout=stdout, json=json.loads(out.read_text()) if out.exists() else None))
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
          split=(2, 2, *HOST, "--kv_host_attention"),  # Host attention, share measured.
      ),
  )
  [one], host, device, split = runs["one"], runs["host"], runs["device"], runs["split"]
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
  # In-process all-reduces (this process: generate's run on 4 of its devices, without jax.distributed) round
  # differently, not enough to change a token.
  cd = tiny.get_config()
  cd.mesh.tensor, cd.kv.placement = 4, "device"
  plain = runs_lib.generate_random(cd, PROMPT_LENGTHS, NEW_TOKENS, 0)
  assert plain["processes"] == 1 and plain["tokens"] == ref["tokens"]


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
