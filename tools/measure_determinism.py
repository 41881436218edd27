"""Measure (GPU): the same bits in every process, and the warm start, with the default compilation cache.

Every run is a fresh `python3 -m jaxkv.x --cpu_devices=0` process with its own fresh cache folder per part:
  a  4 processes, one cache: device, device, host depth 1, host depth 4 (Llama-3-8B geometry, 4 layers, batch 3,
     prompts 1, 4095, 4097, 24 new tokens, seed 11); then 2 processes with the cache off (--compilation_cache_dir=),
     the behaviour before the cache: their hashes may differ. All hashes, walls and compile counts.
  b  the README's GPU command (8B, host, depth 2, 4096-token prompt, 64 new tokens) twice: cold and warm cache;
     wall, prefill_s, decode_s, the compile counts and those inside the decode.
  c  `python3 -m jaxkv.gates --separate_processes` on a 2-layer 8B geometry (capacity 4096, prefill chunk 1024).
  d  (not in the default --parts) the bench A/B: cache off vs warm cache, 8B, 4096 context, batch 1 and 4, device
     and host_d2, 3 rounds, in five processes (off, cold, warm, off, warm: the spread between processes shows);
     median ms/step per arm and process, and warm / off of the two pairs.
Prints a table per part and a summary last; writes JSON to $OUT/determinism.json (or --json_out). Run from the repo
root: python3 tools/measure_determinism.py [--parts=a,b,c,d]. a+b+c take about 5 minutes on one H200 (estimate).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

_8B = ["--cpu_devices=0", "--config=experiments/llama3_8b.py"]
_A = [*_8B, "--config.model.num_layers=4", "--batch=3", "--prompt_len=1,4095,4097", "--max_new_tokens=24", "--seed=11"]
_A_ARMS = {
    "device": ["--kv_placement=device"],
    "device_again": ["--kv_placement=device"],
    "host_d1": ["--kv_placement=host", "--kv_pipeline_depth=1"],
    "host_d4": ["--kv_placement=host", "--kv_pipeline_depth=4"],
}
_B = [*_8B, "--kv_placement=host", "--kv_pipeline_depth=2", "--batch=1", "--prompt_len=4096", "--max_new_tokens=64"]
_C = [*_8B, "--config.model.num_layers=2", "--config.engine.capacity=4096", "--config.engine.prefill_chunk=1024"]
_D = [*_8B, "--synthetic_context", "--contexts=4096", "--batches=1,4", "--arms=device,host_d2"]
_D += ["--new_tokens=32", "--rounds=3", "--nopeer"]


def _app(module: str, args: list[str], json_out: str, timeout: float = 590) -> dict:
  """Runs `python3 -m <module> <args> --json_out=<json_out>`; returns its JSON, with wall_process_s and rc."""
  t0 = time.perf_counter()
  proc = subprocess.run(
      [sys.executable, "-m", module, *args, f"--json_out={json_out}"],
      capture_output=True,
      text=True,
      timeout=timeout,
      check=False,
  )
  wall = time.perf_counter() - t0
  if not os.path.exists(json_out):
    print(proc.stdout[-2000:], proc.stderr[-4000:], sep="\n")
    raise SystemExit(f"{module} {' '.join(args)}: exit {proc.returncode}, no JSON")
  with open(json_out) as f:
    out = json.load(f)
  out.update(wall_process_s=wall, rc=proc.returncode)
  return out


def _autotune_files(cache_root: str) -> int:
  return sum(len(files) for d, _, files in os.walk(cache_root) if "autotune" in d)


def _compiles(out: dict) -> str:
  c = out.get("compilation") or {}
  d = c.get("during_decode") or {}
  return f"{c.get('programs_compiled')}/{c.get('programs_from_cache')} (decode {d.get('programs_compiled')}/{d.get('programs_from_cache')})"


def part_a(tmp: str) -> dict:
  cache = os.path.join(tmp, "a_cache")
  rows = {}
  for name, flags in _A_ARMS.items():
    rows[name] = _app("jaxkv.generate", [*_A, *flags, f"--compilation_cache_dir={cache}"], f"{tmp}/a_{name}.json")
  for name in ("device_off", "device_off_again"):
    rows[name] = _app(
        "jaxkv.generate", [*_A, "--kv_placement=device", "--compilation_cache_dir="], f"{tmp}/a_{name}.json"
    )
  print("\n(a) 8B geometry, 4 layers, batch 3, prompts 1,4095,4097, 24 new tokens: one process each")
  print(f"{'run':>17} {'tokens_sha256':>18} {'logits_sha256':>18} {'wall_s':>7}  compiled/from cache")
  for name, o in rows.items():
    print(f"{name:>17} {o['tokens_sha256'][:16]:>18} {o['logits_sha256'][:16]:>18} {o['wall_s']:7.1f}  {_compiles(o)}")
  cached = [rows[n]["logits_sha256"] for n in _A_ARMS]
  off = [rows[n]["logits_sha256"] for n in ("device_off", "device_off_again")]
  return dict(
      runs={
          n: {k: o.get(k) for k in ("tokens_sha256", "logits_sha256", "wall_s", "compilation")} for n, o in rows.items()
      },
      one_hash_with_cache=len(set(cached)) == 1 and len({rows[n]["tokens_sha256"] for n in _A_ARMS}) == 1,
      one_hash_cache_off=len(set(off)) == 1,
      autotune_cache_files=_autotune_files(cache),
  )


def part_b(tmp: str) -> dict:
  cache = os.path.join(tmp, "b_cache")
  rows = {
      n: _app("jaxkv.generate", [*_B, f"--compilation_cache_dir={cache}"], f"{tmp}/b_{n}.json")
      for n in ("cold", "warm")
  }
  print("\n(b) README GPU command (8B, host, depth 2, prompt 4096, 64 new tokens), cold then warm cache")
  print(
      f"{'run':>5} {'wall_s':>7} {'process_s':>9} {'prefill_s':>9} {'decode_s':>8}  compiled/from cache  logits_sha256"
  )
  for n, o in rows.items():
    t = o["timing"]
    print(
        f"{n:>5} {o['wall_s']:7.1f} {o['wall_process_s']:9.1f} {t['prefill_s']:9.2f} {t['decode_s']:8.2f}  "
        f"{_compiles(o)}  {o['logits_sha256'][:16]}"
    )
  cold, warm = rows["cold"], rows["warm"]
  return dict(
      runs={
          n: {k: o.get(k) for k in ("wall_s", "wall_process_s", "timing", "compilation", "logits_sha256")}
          for n, o in rows.items()
      },
      warm_over_cold_wall=warm["wall_s"] / cold["wall_s"],
      warm_over_cold_process=warm["wall_process_s"] / cold["wall_process_s"],
      same_hashes=(cold["tokens_sha256"], cold["logits_sha256"]) == (warm["tokens_sha256"], warm["logits_sha256"]),
  )


def part_c(tmp: str) -> dict:
  cache = os.path.join(tmp, "c_cache")
  out = _app("jaxkv.gates", [*_C, "--separate_processes", f"--compilation_cache_dir={cache}"], f"{tmp}/c.json")
  print("\n(c) gates --separate_processes, 8B geometry, 2 layers, capacity 4096")
  for arm, p in out["processes"].items():
    c = p["compilation"] or {}
    print(
        f"{arm:>8}: {p['wall_s']:6.1f} s, compiled {c.get('programs_compiled')}, from cache {c.get('programs_from_cache')}"
    )
  hashes = [next(iter(t["hashes"].values()))[:16] for t in out["exactness"]["tasks"]]
  print(f"task hashes: {' '.join(hashes)}; passed {out['passed']}")
  return dict(passed=out["passed"], rc=out["rc"], task_hashes=hashes, processes=out["processes"], report=out)


def part_d(tmp: str) -> dict:
  cache = os.path.join(tmp, "d_cache")
  order = (("off", ""), ("cold", cache), ("warm", cache), ("off2", ""), ("warm2", cache))
  runs = {n: _app("jaxkv.bench", [*_D, f"--compilation_cache_dir={c}"], f"{tmp}/d_{n}.json") for n, c in order}
  med = {
      n: {
          f"{a} b{cell['batch']}": r["ms_per_step"]["median"]
          for cell in o["cells"]
          for a, r in cell["arms"].items()
          if r.get("ms_per_step")
      }
      for n, o in runs.items()
  }
  print("\n(d) bench, 8B, 4096 context: median ms/step per process")
  print(f"{'arm':>12} " + " ".join(f"{n:>8}" for n, _ in order) + f" {'warm/off':>8} {'warm2/off2':>10}")
  for a in med["off"]:
    ms = [med[n].get(a, float("nan")) for n, _ in order]
    print(f"{a:>12} " + " ".join(f"{m:8.3f}" for m in ms) + f" {ms[2] / ms[0]:8.3f} {ms[4] / ms[3]:10.3f}")
  return dict(ms_per_step_median=med)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--parts", default="a,b,c")
  parser.add_argument(
      "--json_out", default=os.path.join(os.environ["OUT"], "determinism.json") if os.environ.get("OUT") else None
  )
  args = parser.parse_args()
  parts = {"a": part_a, "b": part_b, "c": part_c, "d": part_d}
  out = dict(command=" ".join(sys.argv), started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
  t0 = time.perf_counter()
  with tempfile.TemporaryDirectory(prefix="jaxkv-determinism-") as tmp:
    for p in args.parts.split(","):
      out[p] = parts[p](tmp)
      if args.json_out:
        with open(args.json_out, "w") as f:
          json.dump(out, f, indent=1)
  out["total_s"] = time.perf_counter() - t0
  print("\nsummary")
  if "a" in out:
    print(
        f"  (a) one hash over 4 processes with the cache: {out['a']['one_hash_with_cache']}; 2 processes with the cache "
        f"off agree: {out['a']['one_hash_cache_off']}; autotune cache files: {out['a']['autotune_cache_files']}"
    )
  if "b" in out:
    print(
        f"  (b) warm/cold wall (target <= 0.40): {out['b']['warm_over_cold_wall']:.2f} (process {out['b']['warm_over_cold_process']:.2f}); same hashes: {out['b']['same_hashes']}"
    )
  if "c" in out:
    print(f"  (c) gates --separate_processes passed: {out['c']['passed']}")
  print(f"  total {out['total_s']:.0f} s")
  if args.json_out:
    with open(args.json_out, "w") as f:
      json.dump(out, f, indent=1)
    print(f"wrote {args.json_out}")


if __name__ == "__main__":
  main()
