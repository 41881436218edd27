"""Run the gates: `python -m jaxkv.gates` (tiny model, 4 simulated CPU devices by default).

Exits non-zero when a gate fails. Over several processes (--coordinator_address, --num_processes, --process_id)
every process runs the gates and process 0 prints and writes the report. On the GPU, e.g.:

  python -m jaxkv.gates --cpu_devices=0 --config=experiments/llama3_8b.py --config.engine.capacity=4096 \
      --config.engine.prefill_chunk=1024 --json_out=gates.json
"""

from __future__ import annotations


from absl import app
from absl import flags

from jaxkv import cli
from jaxkv import distributed

ARMS = flags.DEFINE_list("arms", ["device", "host_d0", "host_d1", "host_d4"], "Arms that must agree bit for bit.")
NEW_TOKENS = flags.DEFINE_integer("new_tokens", 12, "Greedy tokens per task.")
PARALLEL = flags.DEFINE_integer("parallel", 8, "Parallel gate: slots.")
SEQUENCES = flags.DEFINE_integer("sequences", 16, "Parallel gate: requests served on the slots.")
SEED = flags.DEFINE_integer("seed", 0, "Seeds the weights and the prompt ids.")
JSON_OUT = flags.DEFINE_string("json_out", None, "Write the gate report here.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  cli.setup_platform()
  from jaxkv import gate_suite  # pylint: disable=g-import-not-at-top
  from jaxkv import run  # pylint: disable=g-import-not-at-top

  config = cli.resolved_config()
  mesh, params, _ = run.build(config, SEED.value)
  report = gate_suite.run(
      config, mesh, params, tuple(ARMS.value), NEW_TOKENS.value, SEED.value, PARALLEL.value, SEQUENCES.value
  )
  if distributed.is_main():
    _report(report, JSON_OUT.value)
  if not report["passed"]:
    raise SystemExit(1)


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
  cli.write_json(report, json_out)


if __name__ == "__main__":
  app.run(main)
