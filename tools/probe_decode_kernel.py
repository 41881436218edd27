"""Probe (GPU): the decode attention kernel's launch constants against the legacy attention, and its int8 read.

For each variant of (TILE_ROWS, NUM_WARPS, NUM_STAGES) of jaxkv.decode_attention (set on the module before tracing;
each variant has its own bits), the median ms of --layers layers' decode attention in one jitted call (the
Llama-3-8B heads: 8 kv heads of 4 queries, head_dim 128, values in bf16), per batch x window cell.
  --kv_dtype=bfloat16: the legacy attention, each variant, and for the module's own constants the leaves alone (no
    fold) to apportion the fold's share.
  --kv_dtype=int8 (--variants defaults to the module's constants): per variant, `unpack first` (the packed window
    unpacked by XLA in the same call, then the kernel over values: the read before the kernel unpacked int8 itself),
    `packed` (the kernel reads the rows packed and unpacks each tile), whether the two give the same bits, and the
    packed read's GB/s (the stored window and page read once).
Prints each cell as it ends and a table last; writes --json_out. From the repository root:
  python3 tools/probe_decode_kernel.py --json_out=probe_decode_kernel.json
  python3 tools/probe_decode_kernel.py --kv_dtype=int8 --cells=1x32768,1x131072,1x1048576 --layers=4
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
from jaxkv.kv_quant import KVFormat  # pylint: disable=g-import-not-at-top,wrong-import-position

BF16_VARIANTS = "128x4x2,128x4x1,64x4x2,64x4x3,64x2x2,128x8x2,256x8x1"


def _median_ms(fn, args, reps: int) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(1e3 * (time.perf_counter() - t0))
  return statistics.median(times)


def _layers(what: str, fmt: KVFormat):
  """One jitted call over every layer's rows stored in fmt: what = legacy, attend (the leaves folded, the rows as
  the kernel reads them: int8 packed), unpacked (attend over the rows unpacked first) or leaves (the kernel alone)."""

  def f(qs, windows, pages, start, end):
    outs = []
    for q, window, p in zip(qs, windows, pages):
      if what == "legacy":
        outs.append(model.legacy_decode_attention(q, (fmt.unpack(window), fmt.unpack(p)), start, end))
      elif what == "attend":
        parts = da.attention_rows("pallas", fmt, (window, p))
        outs.append(da.attend(q, parts, 0, start, end, impl="pallas", kv_format=fmt)[0])
      elif what == "unpacked":
        outs.append(da.attend(q, (fmt.unpack(window), fmt.unpack(p)), 0, start, end, impl="pallas")[0])
      else:
        n = da.leaf_count(window.shape[3] + p.shape[3])
        parts = da.attention_rows("pallas", fmt, (window, p))
        outs.append(da.leaf_partials(q, parts, 0, start, end, n, impl="pallas", kv_format=fmt).o.sum(0))
    return jnp.stack(outs)

  return jax.jit(f)


def _cell(args, fmt: KVFormat, variants: list[str], reps: int, gb: float) -> dict:
  """ms (and, for int8, same bits and GB/s) of one cell's arguments per variant (launch constants)."""
  base = (da.TILE_ROWS, da.NUM_WARPS, da.NUM_STAGES)
  ms = {} if fmt.quantized else {"legacy": _median_ms(_layers("legacy", fmt), args, reps)}
  for v in variants:
    da.TILE_ROWS, da.NUM_WARPS, da.NUM_STAGES = (int(x) for x in v.split("x"))
    try:
      if fmt.quantized:
        ms[f"unpack first {v}"] = _median_ms(_layers("unpacked", fmt), args, reps)
        ms[f"packed {v}"] = _median_ms(_layers("attend", fmt), args, reps)
        ms[f"same bits {v}"] = bool(jnp.array_equal(*(_layers(n, fmt)(*args) for n in ("attend", "unpacked"))))
        ms[f"packed GB/s {v}"] = gb / ms[f"packed {v}"] * 1e3
      else:
        ms[v] = _median_ms(_layers("attend", fmt), args, reps)
        if (da.TILE_ROWS, da.NUM_WARPS, da.NUM_STAGES) == base:
          ms[v + " leaves"] = _median_ms(_layers("leaves", fmt), args, reps)
    except Exception as e:  # pylint: disable=broad-except  (a variant that does not compile)
      ms[v] = f"{type(e).__name__}: {str(e)[:200]}"
    da.TILE_ROWS, da.NUM_WARPS, da.NUM_STAGES = base
  return ms


def _show(x) -> str:
  if isinstance(x, bool):
    return "yes" if x else "NO"
  return f"{x:.3f}" if isinstance(x, float) else "err"


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--cells", default="8x4096,1x4096,1x32768,8x32768")
  p.add_argument("--variants", default=None, help=f"TILExWARPSxSTAGES,... (bfloat16: {BF16_VARIANTS}; int8: the base)")
  p.add_argument("--layers", type=int, default=32)
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--kv_dtype", default="bfloat16", choices=["bfloat16", "int8"])
  p.add_argument("--json_out", default=os.path.join(os.environ.get("OUT", "."), "probe_decode_kernel.json"))
  a = p.parse_args()
  k, g, dh, page = 8, 4, 128, 256
  base = (da.TILE_ROWS, da.NUM_WARPS, da.NUM_STAGES)
  fmt = KVFormat(a.kv_dtype, dh, "bfloat16")
  variants = (a.variants or (BF16_VARIANTS if a.kv_dtype == "bfloat16" else "x".join(map(str, base)))).split(",")
  out = dict(jax=jax.__version__, devices=[str(d) for d in jax.devices()], base=base, kv_dtype=a.kv_dtype)
  out.update(layers=a.layers, cells={})
  for cell in a.cells.split(","):
    b, w = (int(v) for v in cell.split("x"))
    key = jax.random.key(0)
    rand = lambda i, shape: jax.random.normal(jax.random.fold_in(key, i), shape, jnp.bfloat16)
    rows = jax.jit(lambda i, shape: fmt.pack(rand(i, shape)), static_argnums=1)
    args = (
        [rand(l, (b, k, g, dh)) for l in range(a.layers)],
        [rows(100 + l, (2, b, k, w, dh)) for l in range(a.layers)],
        [rows(200 + l, (2, b, k, page, dh)) for l in range(a.layers)],
        jnp.zeros((b,), jnp.int32),
        jnp.int32(w + page // 2),
    )
    gb = a.layers * 2 * b * k * (w + page) * fmt.row_bytes / 1e9  # The stored rows of every layer.
    out["cells"][cell] = ms = _cell(args, fmt, variants, a.reps, gb)
    del args
    print(cell, {n: round(x, 3) if isinstance(x, float) else x for n, x in ms.items()}, flush=True)
    with open(a.json_out, "w") as f:
      json.dump(out, f, indent=1)
  names = list(dict.fromkeys(n for ms in out["cells"].values() for n in ms))
  print(f"\nkv_dtype {a.kv_dtype}, {a.layers} layers, ms per call (tile x warps x stages; {out['devices'][0]})")
  print("| | " + " | ".join(out["cells"]) + " |")
  print("| --- |" + " --- |" * len(out["cells"]))
  for n in names:
    print(f"| {n} | " + " | ".join(_show(out["cells"][c].get(n)) for c in out["cells"]) + " |")


if __name__ == "__main__":
  main()
