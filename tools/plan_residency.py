"""Print (no device needed): the residency planner's plan of kv.placement auto for a device that is not here.

The plan that jaxkv.residency.place gives a cache of --context rows and --batch sequences on one device of
--device_gib GiB with JAX's pool at --mem_fraction, less the weights (bf16: 2 bytes per parameter of the config's
model): the free memory, the ring, the workspace, the budget, the resident and streamed layers, and the step the
link sets (streamed bytes / --link_gbps; compute is not counted); for the prefill's plan and for the decode that
follows it in a generate (residency.decode_plan, the decode attention's kernel reading the windows in place). The
config's overrides apply (--config.kv.dtype=int8, --config.kv.delivery_chunk_mib=0, ...).

  python3 tools/plan_residency.py  # The 8B at 1M, bf16 KV, on a 139 GiB H200 with the pool at 0.95.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top  (after the path)
from absl import app
from absl import flags
from ml_collections import config_flags

from jaxkv import cache as cache_lib
from jaxkv import config as config_lib
from jaxkv import residency

CONFIG = config_flags.DEFINE_config_file("config", "experiments/llama3_8b.py:3.1", "The model and KV config.")
CONTEXT = flags.DEFINE_integer("context", 2**20, "The cache's capacity, tokens.")
BATCH = flags.DEFINE_integer("batch", 1, "Sequences.")
DEVICE_GIB = flags.DEFINE_float("device_gib", 139.0, "The device's memory, GiB.")
MEM_FRACTION = flags.DEFINE_float("mem_fraction", 0.95, "JAX's pool, a fraction of the device's memory.")
LINK_GBPS = flags.DEFINE_float("link_gbps", 52.9, "Host-to-device link, GB/s (the H200's measured peak).")
JSON_OUT = flags.DEFINE_string("json_out", None, "Where to write the plan's summary as JSON (none: not written).")

_GIB = 2**30


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  config = config_lib.from_config_dict(CONFIG.value)
  m, kv = config.model, config_lib.dataclasses.replace(config.kv, placement="auto")
  free = int(MEM_FRACTION.value * DEVICE_GIB.value * _GIB) - 2 * m.num_params()
  if free <= 0:
    raise app.UsageError(f"--device_gib={DEVICE_GIB.value} x --mem_fraction={MEM_FRACTION.value} holds no weights")
  rows = cache_lib.rows_bound(CONTEXT.value, kv.block)
  layer = cache_lib.row_bytes(m, kv.dtype, BATCH.value) * rows
  groups = residency.decode_groups((0,) * m.num_layers, residency.group_layers(kv.group_layers, False, layer))
  plan = residency.auto_plan(m, kv, BATCH.value, CONTEXT.value, config.engine.prefill_chunk, groups, 1, free)
  c_rows = residency.delivery_chunk_rows(kv, max(map(len, groups)), cache_lib.row_bytes(m, kv.dtype, BATCH.value))
  placement = residency.Placement(plan.streamed, groups, plan, c_rows)
  # Decode after the prefill (Engine.generate), attended by the kernel (no gathered copy).
  decode = residency.decode_plan(m, kv, BATCH.value, CONTEXT.value, 1, placement, "pallas")
  summary = dict(context=CONTEXT.value, batch=BATCH.value, kv_dtype=kv.dtype)
  print(
      "| context | kv | plan | free GiB | ring GiB | workspace GiB | budget GiB | layer GiB | resident / streamed "
      "| ms |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|")
  for name, p in (("prefill", plan), ("decode", decode)) if decode else (("prefill and decode", plan),):
    streamed = len(p.streamed) - p.resident_layers
    ms = residency.predict_step_ms(streamed * layer, LINK_GBPS.value, 0.0)
    summary[name] = dict(p.summary(), predicted_ms_per_step=ms)
    print(
        f"| {CONTEXT.value} x {BATCH.value} | {kv.dtype} | {name} | {free / _GIB:.2f} | {p.ring_bytes / _GIB:.2f} | "
        f"{p.workspace_bytes / _GIB:.2f} | {p.budget_bytes / _GIB:.2f} | {layer / _GIB:.3f} | "
        f"{p.resident_layers} / {streamed} | {ms:.0f} |"
    )
  if JSON_OUT.value:
    with open(JSON_OUT.value, "w") as f:
      json.dump(summary, f, indent=1)


if __name__ == "__main__":
  app.run(main)
