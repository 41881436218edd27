"""Check (GPU): int4 KV (--kv_dtype=int4) streamed at 32k, batch 1, with the Llama-3-8B geometry.

One `python3 -m jaxkv.bench` process (random bf16 weights, --synthetic_context) runs host_d2 (bf16 KV) and the int4
arms device_int4, host_d0_int4, host_d2_int4 and auto_d2_int4 (auto with --auto_budget_gib of device memory for the
KV, so that some layers stream), then checks:

  speed:  host_d2_int4's tokens/s (median) >= --target (3.0) x host_d2's (issue 52: 72 B rows against bf16's 256);
  exact:  the int4 arms' samples give one tokens hash (device, host at depths 0 and 2, auto: the same bits).

and reports host_d2_int4's share of its link bound (x_link_bound). Prints a pass/fail table last; writes the summary
and the bench's JSON to --json_out ($OUT/check_int4.json by default). Run from the repo root:

  python3 tools/check_int4.py

A try of the plumbing on the CPU (the speed check means nothing there): python3 tools/check_int4.py
--config=experiments/tiny.py --context=64 --auto_budget_gib=0.00003 --bench_args="--cpu_devices=2
--config.model.head_dim=32"
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import bench_child  # tools/bench_child.py, beside this script.

_BF16, _INT4 = "host_d2", "host_d2_int4"
_EXACT = ("device_int4", "host_d0_int4", _INT4, "auto_d2_int4")


def _bench(a: argparse.Namespace, json_out: str) -> dict:
  """The bench process; its JSON, or {"error": why there is none}."""
  cmd = [
      sys.executable,
      "-m",
      "jaxkv.bench",
      "--cpu_devices=0",
      f"--config={a.config}",
      "--nopeer",
      "--synthetic_context",
      f"--contexts={a.context}",
      "--batches=1",
      f"--arms={','.join((_BF16, *_EXACT))}",
      f"--new_tokens={a.new_tokens}",
      f"--rounds={a.rounds}",
      f"--kv_device_budget_gib={a.auto_budget_gib}",
      f"--json_out={json_out}",
      *a.bench_args.split(),
  ]
  out, _, wall = bench_child.run(cmd, json_out, a.timeout_s)
  out.update(check_command=" ".join(cmd), check_wall_s=wall)
  return out


def checks(cell: dict, target: float) -> list[dict]:
  """[{name, passed, detail}] for one bench cell (its "arms": name -> record)."""
  arms = cell["arms"]
  ok = lambda name: arms.get(name, {}).get("status") == "ok"
  rows = []
  if ok(_BF16) and ok(_INT4):
    bf16, int4 = arms[_BF16]["tok_s"]["median"], arms[_INT4]["tok_s"]["median"]
    rows.append(
        dict(
            name=f"speed: {_INT4} >= {target}x {_BF16}",
            passed=int4 >= target * bf16,
            detail=f"{int4:.2f} / {bf16:.2f} tok/s = {int4 / bf16:.2f}x; {_INT4} at "
            f"{arms[_INT4]['x_link_bound']:.3f} of its link bound",
        )
    )
  else:
    reasons = {n: arms.get(n, {}).get("reason") for n in (_BF16, _INT4) if not ok(n)}
    rows.append(dict(name=f"speed: {_INT4} >= {target}x {_BF16}", passed=False, detail=f"not run: {reasons}"))
  hashes = {n: sorted({s["tokens_sha256"] for s in arms[n]["samples"]}) for n in _EXACT if ok(n)}
  missing = [n for n in _EXACT if n not in hashes]
  plan = (arms.get("auto_d2_int4", {}).get("transport") or {}).get("residency") or {}
  rows.append(
      dict(
          name="exact: one tokens hash over the int4 arms",
          passed=not missing and len({h for v in hashes.values() for h in v}) == 1,
          detail=f"{len({h for v in hashes.values() for h in v})} hash(es); not run: {missing or 'none'}; auto "
          f"resident/streamed layers {plan.get('resident_layers')}/{plan.get('streamed_layers')}",
      )
  )
  return rows


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default="experiments/llama3_8b.py")
  p.add_argument("--context", type=int, default=32768)
  p.add_argument("--new_tokens", type=int, default=32)
  p.add_argument("--rounds", type=int, default=2)
  p.add_argument("--target", type=float, default=3.0, help="host_d2_int4 over host_d2, tokens/s.")
  p.add_argument("--auto_budget_gib", type=float, default=0.5, help="auto_d2_int4's device memory for the KV.")
  p.add_argument("--timeout_s", type=float, default=560)
  p.add_argument("--bench_args", default="", help="More flags for the bench, e.g. '--cpu_devices=2' (a CPU try).")
  p.add_argument("--json_out", default=os.path.join(os.environ.get("OUT", "."), "check_int4.json"))
  a = p.parse_args()
  with tempfile.TemporaryDirectory() as tmp:
    out = _bench(a, os.path.join(tmp, "bench.json"))
  rows = checks(out["cells"][0], a.target) if out.get("cells") else [dict(name="bench", passed=False, detail="")]
  os.makedirs(os.path.dirname(os.path.abspath(a.json_out)), exist_ok=True)
  with open(a.json_out, "w") as f:
    json.dump(dict(checks=rows, bench=out), f, indent=1)
  print(f"wrote {a.json_out}")
  if "error" in out:
    print(out["error"])
  print("\n| check | result | detail |\n| --- | --- | --- |")
  for r in rows:
    print(f"| {r['name']} | {'PASS' if r['passed'] else 'FAIL'} | {r['detail']} |")
  sys.exit(0 if all(r["passed"] for r in rows) else 1)


if __name__ == "__main__":
  main()
