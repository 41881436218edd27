"""Probe (GPU): host attention with each split layer's merge carried by the next split layer's query (the engine's
way, "carried") against the merge dispatched alone before that query ("alone"), alternating in one process.

One process, one model: the two differ in nothing but that dispatch, so the machine's spread (the host side of host
attention varies by up to ~25% between fresh machines) cancels. Llama-3-8B geometry on the GPU (the tiny model on
CPU), random weights, a synthetic context (rows below the last prefill chunk are zeros), depth 2, one device.
Prints one JSON line per run, then the median ms/step per cell and variant; OUT=dir writes probe_held_merge.json.
Run from the repo root: PYTHONPATH=. CELLS=1:0.3,4:0.4 THREADS=24 python3 tools/probe_held_merge.py
(CELLS: batch:fraction pairs; CTX, NEW, ROUNDS, THREADS as below.)
"""

import json
import os

import jax
import numpy as np

from experiments import llama3_8b
from experiments import tiny
from jaxkv import config as config_lib
from jaxkv import engine as engine_lib
from jaxkv import run as run_lib
from jaxkv.host import decode as host_decode

HostDecode = host_decode.HostDecode
_CARRIED = HostDecode.decode_layer


def _alone(self, l, calls, p, x, held, tail, meta, start):
  """The split layer with the held merge dispatched on its own first."""
  return _CARRIED(self, l, calls, p, self.merge_held(held, x), None, tail, meta, start)


def run(cells, ctx: int, new: int, rounds: int, threads: int) -> list[dict]:
  """cells: (batch, fraction) pairs. Returns one row per timed generate."""
  cd = (llama3_8b if jax.default_backend() == "gpu" else tiny).get_config().unlock()
  cd.engine.capacity = -(-(ctx + new) // cd.kv.block) * cd.kv.block
  cd.mesh.tensor = 1
  cd.kv.update(placement="host", pipeline_depth=2, host_attention=True, host_attention_threads=threads)
  rows, mesh, params = [], None, None
  try:
    for batch, fraction in cells:
      cd.kv.host_attention_fraction = fraction
      cfg = config_lib.from_config_dict(cd)
      if mesh is None:
        mesh, params, _ = run_lib.build(cfg, 0)
      eng = engine_lib.Engine(cfg, mesh, params, run_lib.make_layout(cfg, mesh))
      prompts = run_lib.random_prompts(cfg.model.vocab_size, [ctx] * batch, 1)
      chunk = cfg.engine.prefill_chunk
      zero_rows = (ctx - 1) // chunk * chunk
      variants = {"carried": _CARRIED, "alone": _alone}
      for split in variants.values():  # Warm-up: compiles both.
        HostDecode.decode_layer = split
        eng.generate(prompts, new, zero_rows=zero_rows)
      for r in range(rounds):
        for name in ("carried", "alone") if r % 2 == 0 else ("alone", "carried"):
          HostDecode.decode_layer = variants[name]
          res = eng.generate(prompts, new, zero_rows=zero_rows)
          ha = res.transport["host_attention"]
          parts = {k.removesuffix("_ms_per_step"): round(v, 2) for k, v in ha.items() if k.endswith("_ms_per_step")}
          ms = 1e3 * res.timing["decode_s"] / res.timing["decode_steps"]
          rows.append(
              dict(batch=batch, fraction=fraction, variant=name, round=r, ms_per_step=round(ms, 2), **parts)
              | dict(tokens_sha256=res.tokens_sha256)
          )
          print(json.dumps(rows[-1]), flush=True)
  finally:
    HostDecode.decode_layer = _CARRIED
  return rows


def main():
  cells = [(int(b), float(f)) for b, f in (c.split(":") for c in os.environ.get("CELLS", "1:0.3,4:0.4").split(","))]
  gpu = jax.default_backend() == "gpu"
  rows = run(
      cells,
      ctx=int(os.environ.get("CTX", 32768 if gpu else 100)),
      new=int(os.environ.get("NEW", 17)),
      rounds=int(os.environ.get("ROUNDS", 3)),
      threads=int(os.environ.get("THREADS", 0)),
  )
  for batch, fraction in cells:
    for name in ("carried", "alone"):
      ms = [r["ms_per_step"] for r in rows if (r["batch"], r["fraction"], r["variant"]) == (batch, fraction, name)]
      print(f"batch {batch} f {fraction} {name}: median {np.median(ms):.2f} ms/step of {ms}")
  if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "probe_held_merge.json"), "w") as f:
      json.dump(dict(device=str(jax.devices()[0].device_kind), rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
