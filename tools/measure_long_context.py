"""Measure (GPU): long contexts at batch 1 with the Llama-3.1-8B geometry, KV placement auto.

Each context (default 128k, 256k, 512k, 1M tokens) is one `python3 -m jaxkv.bench` process with --synthetic_context
(each prompt's rows below its last prefill chunk stored as zeros: the decode does the same work) and the arms
device, device_int8, auto_d2 and auto_d2_int8: tokens/s, resident/streamed layers of the auto arms, their predicted
ms per step (jaxkv.residency.predict_step_ms: max(streamed bytes / link peak, the device arm's ms; the link's term
alone where the device arm does not fit) against the measured. The auto arms' budget is the free device memory
(XLA_PYTHON_CLIENT_MEM_FRACTION raised to --mem_fraction so that JAX's pool is most of the device). Then (first, as it is the shortest) a real 128k prefill: one bench process
without --synthetic_context, arm auto_d2, whose timed sample's prefill_s is the prefill of 128k real tokens.

The pinned host pool (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB, 64 GiB unless raised) is set per context to what its auto
arms may stream (estimated from --device_gib, with a margin), so that the bench's per-cell transfer ceilings (the
whole KV in pinned memory, dozens of passes) are skipped where the KV is large; a cell whose estimate exceeds the
host's available RAM (MemAvailable, less --ram_reserve_gib) is reported as limited by host RAM and not run. An arm
that does not fit is reported with the library's reason (device out of memory, pinned pool, host RAM).

Prints one line per process as it ends and a table last; writes JSON (the summary and every bench output) to
$OUT/long_context.json (or --json_out). Run from the repo root: python3 tools/measure_long_context.py. Bounded by
--budget_s (default 540 s; each process gets a share of what is left and is stopped at it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top  (after the path; no JAX backend starts in this process)
from experiments import llama3_8b
from jaxkv import config as config_lib
from jaxkv import kv_quant
from jaxkv import residency
from jaxkv.bench import arms as arms_lib
from jaxkv.host import memory

_CONFIG = "experiments/llama3_8b.py:3.1"
_ARMS = ("device", "device_int8", "auto_d2", "auto_d2_int8")
_GIB = 2**30
_EXTRA: list[str] = []  # --bench_args.
# Share of the budget per context (the rest rolls over): larger contexts take longer to fill and decode.
_WEIGHT = {131072: 1.0, 262144: 1.0, 524288: 1.3, 1048576: 1.7}


def _host_estimate(
    model, kv_dtype: str, capacity: int, free_gib: float, chunk: int, depth: int = 2
) -> tuple[float, float]:
  """(the whole KV, the pinned host bytes its auto arm needs at most) in GiB, with free_gib of device memory
  free after the weights: residency's budget (prefill chunks of `chunk` rows), two layers fewer resident for safety,
  plus one layer in flight."""
  layer = 2 * model.num_kv_heads * capacity * kv_quant.KVFormat.of(model, kv_dtype).row_bytes
  workspace = residency.workspace_bytes(model, kv_dtype, 1, capacity, chunk, 1, 1, False)
  budget = residency.device_budget(int(free_gib * _GIB), None, (depth + 2) * layer, workspace, 512)[0]
  resident = max(min(model.num_layers, budget // layer) - 2, 0)
  streamed = model.num_layers - resident
  return model.num_layers * layer / _GIB, (streamed + 1) * layer / _GIB if streamed else 0.0


def _bench(args: list[str], env: dict, json_out: str, timeout: float) -> dict:
  """One `python3 -m jaxkv.bench` process; its JSON (or why there is none) with wall_s and rc."""
  t0 = time.perf_counter()
  cmd = [sys.executable, "-m", "jaxkv.bench", f"--config={_CONFIG}", "--nopeer", *args, *_EXTRA]
  try:
    proc = subprocess.run(
        [*cmd, f"--json_out={json_out}"], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    rc, tail = proc.returncode, proc.stderr[-3000:]
  except subprocess.TimeoutExpired as e:
    rc, tail = "timeout", (e.stderr or b"")[-3000:].decode(errors="replace")
  out = {"command": " ".join(cmd)}
  if os.path.exists(json_out):
    with open(json_out) as f:
      out = json.load(f)
  if rc != 0 or not out.get("cells"):
    out["error"] = f"exit {rc} after {time.perf_counter() - t0:.0f} s: {tail[-1500:]}"
  out.update(wall_s=time.perf_counter() - t0, rc=rc)
  return out


def _arm_row(context: int, name: str, rec: dict) -> dict:
  plan = (rec.get("transport") or {}).get("residency") or {}
  ms, tok_s = rec.get("ms_per_step") or {}, rec.get("tok_s") or {}
  pred = rec.get("predicted_ms_per_step")
  return dict(
      context=context,
      arm=name,
      status=rec["status"],
      reason=rec.get("reason"),
      tok_s=tok_s.get("median"),
      ms_per_step=ms.get("median"),
      resident_layers=plan.get("resident_layers"),
      streamed_layers=plan.get("streamed_layers"),
      device_budget_gib=plan["device_budget_bytes"] / _GIB if plan.get("device_budget_bytes") else None,
      predicted_ms_per_step=pred,
      measured_over_predicted=ms["median"] / pred if pred and ms.get("median") else None,
      device_peak_gib=(rec.get("device_peak_bytes_in_use_process") or 0) / _GIB or None,
  )


def _fmt(v, spec: str) -> str:
  return "-" if v is None else format(v, spec)


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--contexts", default="131072,262144,524288,1048576")
  p.add_argument("--arms", default=",".join(_ARMS))
  p.add_argument("--new_tokens", type=int, default=16, help="Below kv.block (256): one window shape per cell.")
  p.add_argument("--rounds", type=int, default=2)
  p.add_argument("--prefill", default="131072", help="Real-prompt prefill context ('' = none).")
  p.add_argument("--prefill_timeout_s", type=float, default=200)
  p.add_argument("--budget_s", type=float, default=540)
  p.add_argument("--mem_fraction", default="0.95", help="XLA_PYTHON_CLIENT_MEM_FRACTION (unless already set).")
  p.add_argument("--device_gib", type=float, default=139.0, help="Device memory that JAX sees (H200: ~139.8 GiB).")
  p.add_argument("--ram_reserve_gib", type=float, default=8.0, help="Host RAM left to everything else.")
  p.add_argument("--json_out", default=os.path.join(os.environ.get("OUT", "."), "long_context.json"))
  p.add_argument(
      "--bench_args",
      default="--cpu_devices=0",
      help="Appended to every bench command (a smoke run on CPU: '--cpu_devices=1 --config.model.num_layers=2 ...').",
  )
  a = p.parse_args()
  _EXTRA[:] = a.bench_args.split()
  t_end = time.perf_counter() + a.budget_s
  config = config_lib.from_config_dict(llama3_8b.get_config("3.1"))
  model = config.model
  weights_gib = 2 * model.num_params() / _GIB  # bfloat16.
  mem_fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", a.mem_fraction))
  free_gib = mem_fraction * a.device_gib - weights_gib - 2.0  # 2 GiB for the rest (estimate).
  ram_gib = (memory.available_host_bytes() or 0) / _GIB
  arms = a.arms.split(",")
  dtypes = sorted(
      {parse.kv_dtype or "bfloat16" for parse in map(arms_lib.parse_arm, arms) if parse.placement == "auto"}
  )
  summary = dict(
      config=_CONFIG,
      mem_fraction=mem_fraction,
      weights_gib=weights_gib,
      free_device_gib_estimate=free_gib,
      host_ram_available_gib=ram_gib,
      cells=[],
      prefill=None,
      runs=[],
  )
  base_env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=str(mem_fraction))
  tmp = tempfile.mkdtemp(prefix="long_context_")
  rows = []

  def pool_env(context: int) -> tuple[dict | None, dict]:
    """The env for one context's process, or None with the reason when host RAM limits it."""
    cap = -(-(context + a.new_tokens) // 256) * 256
    est = {d: _host_estimate(model, d, cap, free_gib, config.engine.prefill_chunk) for d in dtypes}
    host_gib = max([h for _, h in est.values()], default=0.0)
    info = dict(
        capacity=cap,
        kv_gib={d: kv for d, (kv, _) in est.items()},
        host_gib_estimate={d: h for d, (_, h) in est.items()},
    )
    if host_gib > ram_gib - a.ram_reserve_gib:
      info["limited_by_host_ram"] = (
          f"the auto arms may need {host_gib:.1f} GiB of pinned host memory; the host has {ram_gib:.1f} GiB "
          f"available (less {a.ram_reserve_gib:.0f} GiB kept)"
      )
      return None, info
    pool = max(4, math.ceil(host_gib + 4))
    info["pinned_pool_gib"] = pool  # XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB: above 64 it must be raised, as here.
    return dict(base_env, **{memory.POOL_ENV: str(pool)}), info

  if a.prefill:
    ctx = int(a.prefill)
    env, info = pool_env(ctx)
    args = [f"--contexts={ctx}", "--arms=auto_d2", "--new_tokens=2", "--rounds=1"]
    timeout = min(a.prefill_timeout_s, t_end - time.perf_counter())
    out = _bench(args, env or base_env, os.path.join(tmp, "prefill.json"), timeout) if env else dict(info)
    rec = ((out.get("cells") or [{}])[0].get("arms") or {}).get("auto_d2", {})
    samples = rec.get("samples") or []
    summary["prefill"] = dict(
        context=ctx,
        status=rec.get("status", "error"),
        reason=rec.get("reason") or out.get("error") or info.get("limited_by_host_ram"),
        prefill_s=samples[0]["prefill_s"] if samples else None,
        warmup_prefill_s=(rec.get("warmup") or {}).get("prefill_s"),
        residency=(rec.get("transport") or {}).get("residency"),
        **info,
    )
    summary["runs"].append(out)
    print(f"prefill {ctx}: {summary['prefill']['prefill_s']} s ({summary['prefill']['status']})", flush=True)

  contexts = [int(c) for c in a.contexts.split(",")]
  for i, ctx in enumerate(contexts):
    left = t_end - time.perf_counter()
    share = _WEIGHT.get(ctx, 1.0) / sum(_WEIGHT.get(c, 1.0) for c in contexts[i:])
    env, info = pool_env(ctx)
    if env is None or left < 30:
      reason = info.get("limited_by_host_ram") or f"out of budget ({left:.0f} s left)"
      rows += [dict(context=ctx, arm=arm, status="not run", reason=reason) for arm in arms]
      summary["cells"].append(dict(context=ctx, not_run=reason, **info))
      print(f"context {ctx}: not run: {reason}", flush=True)
      continue
    args = [f"--contexts={ctx}", f"--arms={','.join(arms)}", f"--new_tokens={a.new_tokens}", f"--rounds={a.rounds}"]
    out = _bench([*args, "--synthetic_context"], env, os.path.join(tmp, f"ctx{ctx}.json"), share * left)
    summary["runs"].append(out)
    cell = (out.get("cells") or [None])[0]
    if cell is None:
      rows += [dict(context=ctx, arm=arm, status="error", reason=out.get("error")) for arm in arms]
      summary["cells"].append(dict(context=ctx, error=out.get("error"), **info))
    else:
      cell_rows = [_arm_row(ctx, name, rec) for name, rec in cell["arms"].items()]
      rows += cell_rows
      summary["cells"].append(dict(context=ctx, link_peak_gbps=cell.get("link_peak_gbps"), arms=cell_rows, **info))
    print(f"context {ctx}: {out['wall_s']:.0f} s, rc {out['rc']}", flush=True)

  summary["rows"] = rows
  os.makedirs(os.path.dirname(os.path.abspath(a.json_out)), exist_ok=True)
  with open(a.json_out, "w") as f:
    json.dump(summary, f, indent=1)
  print(f"wrote {a.json_out}")
  for r in rows:
    if r.get("reason"):
      print(f"{r['context']} {r['arm']}: {r['status']}: {r['reason'][:300]}")
  for c in summary["cells"]:
    kv = ", ".join(f"{d} {g:.1f}" for d, g in c["kv_gib"].items())
    host = ", ".join(f"{d} {g:.1f}" for d, g in c["host_gib_estimate"].items())
    print(
        f"context {c['context']}: KV {kv} GiB; auto's pinned host estimate {host} GiB; pool "
        f"{c.get('pinned_pool_gib', '-')} GiB (host RAM available {ram_gib:.1f} GiB)"
    )
  pf = summary["prefill"]
  if pf:
    print(f"real-prompt prefill, {pf['context']} tokens, auto_d2: {_fmt(pf['prefill_s'], '.2f')} s ({pf['status']})")
  print(f"\n| context | arm | tok/s | ms/step | resident/streamed | predicted ms | measured/predicted | status |")
  print("|---|---|---|---|---|---|---|---|")
  for r in rows:
    layers = "-" if r.get("resident_layers") is None else f"{r['resident_layers']}/{r['streamed_layers']}"
    print(
        f"| {r['context']} | {r['arm']} | {_fmt(r.get('tok_s'), '.2f')} | {_fmt(r.get('ms_per_step'), '.1f')} | "
        f"{layers} | {_fmt(r.get('predicted_ms_per_step'), '.1f')} | {_fmt(r.get('measured_over_predicted'), '.3f')} "
        f"| {r['status']} |"
    )


if __name__ == "__main__":
  main()
