"""Probe (GPU): the link's rate for a streamed layer's window delivered whole and in delivery chunks, the chunks put
as their contiguous runs or cut by a jitted slice, at several batches.

For each batch B a window of the 8B's geometry (bf16 [2, B, 8, rows / B, 128], pinned host; the same bytes at every
B) reaches the device as one device_put, or as chunks of --chunk_mib (jaxkv.chunked.chunk_rows) by
jaxkv.cache.rows_to_device with cache.MIN_RUN_BYTES set to put every chunk as runs, or none; issued back to back and
waited for at the end. A run is one (K or V, sequence, head)'s rows of a chunk: chunk_mib / (2 * 8 * B) MiB. Prints
GB/s (the median of --reps) for each, and the run's MiB; what decides cache.MIN_RUN_BYTES.

  python3 tools/probe_chunks.py --rows=1048576 --batches=1,4,8,32 --json_out=$OUT/probe_chunks.json
"""

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top  (after the path)
import jax
import jax.numpy as jnp
from absl import app
from absl import flags

from jaxkv import cache as cache_lib
from jaxkv import chunked

ROWS = flags.DEFINE_integer("rows", 2**20, "The window's rows over all its sequences.")
BATCHES = flags.DEFINE_list("batches", ["1", "4", "8", "32"], "Sequences in the window.")
CHUNK_MIB = flags.DEFINE_float("chunk_mib", 512, "A delivery chunk's MiB (kv.delivery_chunk_mib's default).")
REPS = flags.DEFINE_integer("reps", 3, "Timed repetitions of each.")
JSON_OUT = flags.DEFINE_string("json_out", "", "Where to write the figures (empty: not written).")

_ALL, _NONE = 0, 2**62  # cache.MIN_RUN_BYTES: every chunk as runs, or every chunk sliced.


def _gbps(window, deliver) -> float:
  jax.block_until_ready(deliver())  # Compiles.
  rates = []
  for _ in range(REPS.value):
    t0 = time.perf_counter()
    jax.block_until_ready(deliver())
    rates.append(window.nbytes / (time.perf_counter() - t0) / 1e9)
  return statistics.median(rates)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  mesh = jax.make_mesh((1,), ("tensor",))
  host = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(), memory_kind="pinned_host")
  dev = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(), memory_kind="device")
  rows_out = []
  for batch in map(int, BATCHES.value):
    shape = (2, batch, 8, ROWS.value // batch, 128)
    window = jax.device_put(jnp.ones(shape, jnp.bfloat16), host)
    jax.block_until_ready(window)
    c_rows = chunked.chunk_rows(CHUNK_MIB.value, window.nbytes // shape[3], 256)
    pieces = chunked.chunks(shape[3], c_rows)
    chunks = lambda: [cache_lib.rows_to_device(window, c.first_row, c.rows, dev) for c in pieces]
    row = {
        "batch": batch,
        "chunk_rows": c_rows,
        "run_mib": c_rows * 256 / 2**20,
        "whole": _gbps(window, lambda: [jax.device_put(window, dev)]),
    }
    for name, least in (("runs", _ALL), ("slice", _NONE)):
      cache_lib.MIN_RUN_BYTES = least
      row[name] = _gbps(window, chunks)
    rows_out.append(row)
    window.delete()
  print(f"{jax.devices()[0].device_kind}, window {2 * 8 * ROWS.value * 256 / 2**30:.1f} GiB, GB/s:")
  print("| batch | chunk rows | run MiB | whole | runs | slice |\n|---|---|---|---|---|---|")
  for r in rows_out:
    print(
        f"| {r['batch']} | {r['chunk_rows']} | {r['run_mib']:.2f} | {r['whole']:.1f} | {r['runs']:.1f} | "
        f"{r['slice']:.1f} |"
    )
  if JSON_OUT.value:
    with open(JSON_OUT.value, "w") as f:
      json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows_out), f, indent=1)


if __name__ == "__main__":
  app.run(main)
