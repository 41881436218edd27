"""Run the gates: `python3 -m jaxkv.gates` (tiny model, 4 simulated CPU devices by default).

Exits non-zero when a gate fails. With --separate_processes each arm runs in a process of its own, one after the
other, with the same flags, and the gates compare the hashes across the processes. Over several processes
(--coordinator_address, --num_processes, --process_id) every process runs the gates and process 0 prints and writes
the report. On the GPU, e.g.:

  python3 -m jaxkv.gates --cpu_devices=0 --config=experiments/llama3_8b.py --config.engine.capacity=4096 \
      --config.engine.prefill_chunk=1024 --json_out=gates.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags

from jaxkv import compile_cache
from jaxkv import distributed
from jaxkv import preflight
from jaxkv.apps import cli
from jaxkv.apps import launch

ARMS = flags.DEFINE_list(
    "arms",
    ["device", "host_d0", "host_d1_g1", "host_d2_g2", "host_d4_g1"],  # gate_suite.ARMS (imported after setup).
    "Arms that must agree bit for bit.",
)
NEW_TOKENS = flags.DEFINE_integer("new_tokens", 12, "Greedy tokens per task.", lower_bound=1)
PARALLEL = flags.DEFINE_integer("parallel", 8, "Parallel gate: slots.", lower_bound=1)
SEQUENCES = flags.DEFINE_integer("sequences", 16, "Parallel gate: requests served on the slots.", lower_bound=1)
SEED = flags.DEFINE_integer("seed", 0, "Seeds the weights and the prompt ids.", lower_bound=0)
JSON_OUT = flags.DEFINE_string("json_out", None, "Write the gate report here.")
SEPARATE = flags.DEFINE_bool(
    "separate_processes",
    False,
    "Run each arm in a process of its own, one after the other (sharing the compilation cache), with the same "
    "flags, and compare the hashes across the processes.",
)


COMMAND = "jaxkv.gates"  # python3 -m COMMAND runs this app (each arm's process with --separate_processes).

HELP_GROUPS = {
    "model and config": cli.CONFIG_GROUP,
    "gates": [ARMS, NEW_TOKENS, PARALLEL, SEQUENCES, SEED, SEPARATE, cli.SPECULATE_FLAG],
    "KV cache": cli.KV_GROUP,
    "split": cli.SPLIT_GROUP,
    "multi-host": cli.MULTIHOST_GROUP,
    "output": [JSON_OUT],
}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not ARMS.value:
    raise app.UsageError("--arms is empty: give the arms that must agree, e.g. --arms=device,host_d2")
  launch.check_outputs(JSON_OUT)
  from jaxkv.bench import arms as arms_lib  # pylint: disable=g-import-not-at-top
  from jaxkv.bench import gate_suite  # pylint: disable=g-import-not-at-top

  config = cli.resolved_config()
  with preflight.input_errors():
    for arm in ARMS.value:  # An unknown arm, or a KV dtype that does not fit the model.
      arms_lib.arm_config(config, arm)
    gate_suite.task_lengths(config, NEW_TOKENS.value)
  if SEPARATE.value:
    if distributed.settings(cli.COORDINATOR_ADDRESS.value, cli.NUM_PROCESSES.value, cli.PROCESS_ID.value):
      raise app.UsageError("--separate_processes runs on one host: drop the multi-process flags and JAX_* variables")
    report = _run_separate(ARMS.value, gate_suite.child_args(sys.argv[1:]))
    print("(each arm in its own process)")
    _report(report, JSON_OUT.value)
    if not report["passed"]:
      raise SystemExit(1)
    return
  cli.setup_platform(config.model)
  from jaxkv import run  # pylint: disable=g-import-not-at-top
  from jaxkv.apps import runs  # pylint: disable=g-import-not-at-top

  with compile_cache.CompileCounter() as counter:
    mesh, params, _ = run.build(config, SEED.value)
    report = gate_suite.run(
        config, mesh, params, tuple(ARMS.value), NEW_TOKENS.value, SEED.value, PARALLEL.value, SEQUENCES.value
    )
  report["compilation"] = runs.compilation(counter)
  if distributed.is_main():
    _report(report, JSON_OUT.value)
  if not report["passed"]:
    raise SystemExit(1)


def _run_separate(arms, args) -> dict:
  """Runs this app with `--arms=<arm> <args>` for each arm, one process after the other (so that they share the
  compilation cache, as separate runs of the apps do), and merges their reports. Exits, with the end of its
  output, when a process writes no report."""
  from jaxkv.bench import gate_suite  # pylint: disable=g-import-not-at-top

  reports = {}
  with tempfile.TemporaryDirectory(prefix="jaxkv-gates-") as tmp:
    for arm in arms:
      path = os.path.join(tmp, f"{arm}.json")
      cmd = [sys.executable, "-m", COMMAND, f"--arms={arm}", f"--json_out={path}", *args]
      t0 = time.perf_counter()
      proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
      wall = time.perf_counter() - t0
      if not os.path.exists(path):  # Its own error (a bad flag, a crash) ends this run too.
        raise SystemExit(f"{proc.stderr[-4000:]}\ngates process of arm {arm} wrote no report (exit {proc.returncode})")
      with open(path) as f:
        reports[arm] = dict(json.load(f), wall_s=wall)
      c = reports[arm].get("compilation") or {}
      print(
          f"process {arm:>8}: exit {proc.returncode}, {wall:.1f} s, programs compiled {c.get('programs_compiled')}, "
          f"from the cache {c.get('programs_from_cache')}"
      )
  return gate_suite.merge(reports)


def _report(report: dict, json_out: str | None) -> None:
  for t in report["exactness"]["tasks"]:
    first = next(iter(t["hashes"].values()))
    print(f"task prompt {t['prompt_length']:>6}: {'ok  ' if t['passed'] else 'DIFF'} {first[:16]}")
  for arm, m in report["memory"]["arms"].items():
    print(
        f"memory {arm:>8}: ring high-water {m['ring_high_water_bytes_per_device']} B/device (needed "
        f"{m['ring_bytes_per_device_needed']}, configured {m['ring_bytes_per_device_configured']}), device peak "
        f"{m['device_peak_bytes_in_use_process']}"
    )
  print(f"exactness gate: {'PASS' if report['exactness']['passed'] else 'FAIL'}")
  print(f"memory gate: {'PASS' if report['memory']['passed'] else 'FAIL'}")
  p = report["parallel"]
  for arm, h in p["transcripts"].items():
    print(f"parallel {arm:>8}: transcript {h[:16]}")
  print(
      f"parallel gate ({p['sequences']} requests on {p['parallel']} slots, {p['insertions']} slot reuses, "
      f"{p['epochs']} epochs): {'PASS' if p['passed'] else 'FAIL'}"
  )
  launch.write_json(report, json_out)


def run() -> None:
  """The app: `python3 -m jaxkv.gates`."""
  cli.run(main, HELP_GROUPS, __doc__)


if __name__ == "__main__":
  run()
