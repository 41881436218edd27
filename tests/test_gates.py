"""The gate suite: arms agree bit for bit on the fixed tasks, and a differing arm or a ring that holds more than its
slots fails the gate; the gates app exits non-zero when one fails."""

import dataclasses
import json
import os
import subprocess
import sys
import threading

import helpers
import pytest

from jaxkv import transport as transport_lib
from jaxkv.bench import gate_suite

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(transport_lib.__file__)))  # Holds the jaxkv package.


@pytest.fixture(scope="module")
def report():
  return gate_suite.run(helpers.tiny_config(), helpers.mesh(2), helpers.params(2), new_tokens=6)


def test_gates_pass_with_one_hash_per_task(report):
  assert report["passed"] and report["exactness"]["passed"] and report["memory"]["passed"]
  tasks = report["exactness"]["tasks"]
  assert len(tasks) >= 8
  assert {1, 7, 8, 9} <= {t["prompt_length"] for t in tasks}  # Block boundaries (block = 8).
  assert max(t["prompt_length"] for t in tasks) == helpers.tiny_config().engine.capacity - 6 + 1  # Near capacity.
  for t in tasks:
    assert set(t["hashes"]) == set(gate_suite.ARMS) and len(set(t["hashes"].values())) == 1
  assert len({next(iter(t["hashes"].values())) for t in tasks}) == len(tasks)  # Tasks differ from each other.
  for arm, m in report["memory"]["arms"].items():
    high, needed = m["ring_high_water_bytes_per_device"], m["ring_bytes_per_device_needed"]
    assert high <= needed <= m["ring_bytes_per_device_configured"] and not m["over_needed_prompt_lengths"]
    assert (high > 0) == (needed > 0) == (arm != "device")
  par = report["parallel"]
  assert par["passed"] and set(par["transcripts"]) == set(gate_suite.ARMS)
  assert len(set(par["transcripts"].values())) == 1
  assert par["sequences"] == 16 and par["parallel"] == 8 and par["insertions"] >= 1  # Slots were reused.


def test_capacity_too_small_for_the_tasks_is_a_clear_error():
  cfg = helpers.tiny_config()
  small = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, capacity=20))
  with pytest.raises(ValueError, match="too small for the gate tasks"):
    gate_suite.task_lengths(small, 6)


def test_merge_compares_the_processes_hashes():
  def report(arm, task_hash, transcript):
    mem = dict(ring_high_water_bytes_per_device=0, ring_bytes_per_device_configured=0, passed=True)
    tasks = [dict(prompt_length=n, hashes={arm: f"{task_hash}{n}"}, passed=True) for n in (1, 8)]
    par = dict(passed=True, parallel=2, sequences=4, insertions=2, epochs=1, transcripts={arm: transcript})
    return dict(
        arms=[arm],
        exactness=dict(passed=True, tasks=tasks),
        memory=dict(passed=True, arms={arm: mem}),
        parallel=par,
        passed=True,
        compilation=dict(programs_compiled=3, programs_from_cache=0),
    )

  same = gate_suite.merge({"device": report("device", "a", "t"), "host_d1": report("host_d1", "a", "t")})
  assert same["passed"] and same["separate_processes"] and same["arms"] == ["device", "host_d1"]
  assert [t["hashes"] for t in same["exactness"]["tasks"]] == [{"device": f"a{n}", "host_d1": f"a{n}"} for n in (1, 8)]
  assert same["processes"]["host_d1"]["compilation"]["programs_compiled"] == 3 and "compilation" not in same
  other = gate_suite.merge({"device": report("device", "a", "t"), "host_d1": report("host_d1", "b", "u")})
  assert not other["passed"] and not other["exactness"]["passed"] and not other["parallel"]["passed"]


def test_child_args_pass_on_everything_but_the_arms_the_output_and_the_mode():
  argv = ["--separate_processes", "--arms", "device,host_d1", "--json_out=x.json", "--cpu_devices=2"]
  argv += ["--config.model.num_layers=2", "--new_tokens", "4", "--json_out", "y.json", "--arms=device"]
  assert gate_suite.child_args(argv) == ["--cpu_devices=2", "--config.model.num_layers=2", "--new_tokens", "4"]


def _separate(tmp_path, arms):
  """`python -m jaxkv.gates --separate_processes` on the tiny model, 2 devices, small gates."""
  out = tmp_path / "gates.json"
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  cmd = [sys.executable, "-m", "jaxkv.gates", "--separate_processes", f"--arms={arms}", "--cpu_devices=2"]
  cmd += ["--new_tokens", "4", "--sequences=4", "--parallel=2", f"--json_out={out}"]
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  return proc, json.loads(out.read_text()) if out.exists() else None


def test_separate_processes_agree_and_share_the_compilation_cache_and_one_that_differs_fails_the_gate(tmp_path):
  """One run of three processes: device and host_d1 agree bit for bit (every task's hash, the transcript), the second
  loads the first's programs from the cache; a bfloat16 cache on the float32 tiny model changes the bits, and the
  cross-process gate catches it."""
  proc, report = _separate(tmp_path, "device,host_d1,host_d1_bfloat16")
  assert proc.returncode == 1 and not report["passed"] and not report["exactness"]["passed"], proc.stderr[-3000:]
  assert report["separate_processes"] and report["arms"] == ["device", "host_d1", "host_d1_bfloat16"]
  for t in report["exactness"]["tasks"]:
    h = t["hashes"]
    assert h["device"] == h["host_d1"] != h["host_d1_bfloat16"] and not t["passed"], t
  transcripts = report["parallel"]["transcripts"]
  assert transcripts["device"] == transcripts["host_d1"] != transcripts["host_d1_bfloat16"]
  assert not report["parallel"]["passed"]
  assert all(m["passed"] for m in report["memory"]["arms"].values()) and report["memory"]["passed"]
  assert report["parallel"]["sequences"] == 4 and report["new_tokens"] == 4  # The flags reached every process.
  second = report["processes"]["host_d1"]["compilation"]
  assert second["programs_from_cache"] > 0  # The same compiled layer functions serve both arms.
  assert all(f"process {arm:>8}: exit 0" in proc.stdout for arm in report["arms"]), proc.stdout
  assert "DIFF" in proc.stdout and "exactness gate: FAIL" in proc.stdout


def test_the_needed_ring_is_the_slots_of_the_largest_window_delivered():
  cfg = helpers.tiny_config()  # kv.block 8, prefill_chunk 16.
  assert gate_suite.window_rows(cfg, 1, 6) == 0  # Decode windows of rows 1..5: no full block.
  assert gate_suite.window_rows(cfg, 9, 6) == 8  # The last step writes row 13.
  assert gate_suite.window_rows(cfg, 123, 6) == 120  # Near capacity: short of the ring's 136-row slots.
  assert gate_suite.window_rows(cfg, 40, 1) == 32  # No decode step: the last prefill chunk's window.
  assert gate_suite.row_bytes_per_device(cfg, helpers.mesh(2)) == 2 * 8 // 2 * 16 * 4  # K and V, 4 of 8 heads, f32.


def test_a_ring_that_holds_one_delivery_more_fails_the_memory_gate(monkeypatch):
  """The feeder given one slot more than depth + 1 holds depth + 3 windows: within the configured ring (sized for
  full capacity) but over what the windows need."""
  init = transport_lib.Transport.__init__

  def one_more_slot(self, cache, depth, debug=0):
    init(self, cache, depth, debug)
    if self.streamed:  # The feeder has taken no slot yet: nothing is queued before the first pass.
      self._slots = threading.Semaphore(self.depth + 2)  # pylint: disable=protected-access

  monkeypatch.setattr(transport_lib.Transport, "__init__", one_more_slot)
  out = gate_suite.run(helpers.tiny_config(), helpers.mesh(1), helpers.params(1), ("host_d1",), 6, sequences=2)
  m = out["memory"]["arms"]["host_d1"]
  assert not out["passed"] and not out["memory"]["passed"] and out["exactness"]["passed"]
  # Shorter tasks fail too: their high-water stays within the configured ring, the old bound, which only the tasks near
  # capacity (the last two) could pass.
  assert set(m["over_needed_prompt_lengths"]) - set(gate_suite.task_lengths(helpers.tiny_config(), 6)[-2:])


def test_the_gates_app_exits_non_zero_when_a_gate_fails(tmp_path):
  """A bfloat16 cache arm beside the float32 device arm: it changes the logits, every task's and the transcript's
  bits differ, and the app prints FAIL and exits 1."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  out = tmp_path / "gates.json"
  proc = subprocess.run(
      [
          sys.executable,
          "-m",
          "jaxkv.gates",  # Not imported here: its flags would clash with other apps'.
          "--cpu_devices=1",
          "--arms=device,host_d1_bfloat16",
          "--new_tokens=3",
          "--config.engine.capacity=32",  # Fewer window shapes to compile.
          "--config.model.num_layers=2",
          "--sequences=2",
          "--parallel=2",
          f"--json_out={out}",
      ],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert "exactness gate: FAIL" in proc.stdout and "parallel gate" in proc.stdout and "memory gate: PASS" in proc.stdout
  report = json.loads(out.read_text())
  assert not report["passed"] and not report["exactness"]["passed"] and not report["parallel"]["passed"]
  assert report["exactness"]["tasks"] and not any(t["passed"] for t in report["exactness"]["tasks"])
