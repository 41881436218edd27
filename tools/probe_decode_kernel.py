"""Probe (GPU): the decode attention kernel's launch constants against the legacy attention.

For each variant of (TILE_ROWS, NUM_WARPS, NUM_STAGES) of jaxkv.decode_attention (set on the module before tracing;
each variant has its own bits), the median ms of --layers layers' decode attention in one jitted call (bf16, the
Llama-3-8B heads: 8 kv heads of 4 queries, head_dim 128), per batch x window cell; and, for the module's own
constants, the leaves alone (no fold) to apportion the fold's share. Prints a table; writes --json_out. From the
repository root: python3 tools/probe_decode_kernel.py --json_out=probe_decode_kernel.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position

from jaxkv import decode_attention as da  # pylint: disable=g-import-not-at-top,wrong-import-position
from jaxkv import model  # pylint: disable=g-import-not-at-top,wrong-import-position


def _median_ms(fn, args, reps: int) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(1e3 * (time.perf_counter() - t0))
  return statistics.median(times)


def _layers(what: str):
  """One jitted call over every layer: what = legacy, attend (the leaves folded) or leaves (the kernel alone)."""

  def f(qs, windows, pages, start, end):
    outs = []
    for q, window, p in zip(qs, windows, pages):
      if what == "legacy":
        outs.append(model.legacy_decode_attention(q, (window, p), start, end))
      elif what == "attend":
        outs.append(da.attend(q, (window, p), 0, start, end, impl="pallas")[0])
      else:
        n = da.leaf_count(window.shape[3] + p.shape[3])
        outs.append(da.leaf_partials(q, (window, p), 0, start, end, n, impl="pallas").o.sum(0))
    return jnp.stack(outs)

  return jax.jit(f)


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--cells", default="8x4096,1x4096,1x32768,8x32768")
  p.add_argument("--variants", default="128x4x2,128x4x1,64x4x2,64x4x3,64x2x2,128x8x2,256x8x1")
  p.add_argument("--layers", type=int, default=32)
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--json_out", default=os.path.join(os.environ.get("OUT", "."), "probe_decode_kernel.json"))
  a = p.parse_args()
  k, g, dh, page = 8, 4, 128, 256
  base = (da.TILE_ROWS, da.NUM_WARPS, da.NUM_STAGES)
  out = dict(jax=jax.__version__, devices=[str(d) for d in jax.devices()], base=base, cells={})
  for cell in a.cells.split(","):
    b, w = (int(v) for v in cell.split("x"))
    key = jax.random.key(0)
    rand = lambda i, shape: jax.random.normal(jax.random.fold_in(key, i), shape, jnp.bfloat16)
    args = (
        [rand(l, (b, k, g, dh)) for l in range(a.layers)],
        [rand(100 + l, (2, b, k, w, dh)) for l in range(a.layers)],
        [rand(200 + l, (2, b, k, page, dh)) for l in range(a.layers)],
        jnp.zeros((b,), jnp.int32),
        jnp.int32(w + page // 2),
    )
    ms = {"legacy": _median_ms(_layers("legacy"), args, a.reps)}
    for v in a.variants.split(","):
      da.TILE_ROWS, da.NUM_WARPS, da.NUM_STAGES = (int(x) for x in v.split("x"))
      try:
        ms[v] = _median_ms(_layers("attend"), args, a.reps)
        if (da.TILE_ROWS, da.NUM_WARPS, da.NUM_STAGES) == base:
          ms[v + " leaves"] = _median_ms(_layers("leaves"), args, a.reps)
      except Exception as e:  # pylint: disable=broad-except  (a variant that does not compile)
        ms[v] = f"{type(e).__name__}: {str(e)[:200]}"
      da.TILE_ROWS, da.NUM_WARPS, da.NUM_STAGES = base
    out["cells"][cell] = ms
    print(cell, {n: round(x, 3) if isinstance(x, float) else x for n, x in ms.items()}, flush=True)
    with open(a.json_out, "w") as f:
      json.dump(out, f, indent=1)
  names = list(next(iter(out["cells"].values())))
  print("\n| variant (tile x warps x stages) | " + " | ".join(out["cells"]) + " |")
  print("| --- |" + " --- |" * len(out["cells"]))
  for n in names:
    row = [out["cells"][c].get(n) for c in out["cells"]]
    print(f"| {n} | " + " | ".join(f"{x:.3f}" if isinstance(x, float) else "err" for x in row) + " |")


if __name__ == "__main__":
  main()
