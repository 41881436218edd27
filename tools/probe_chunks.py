"""Probe (GPU): the link's rate for a streamed layer's window delivered whole and in delivery chunks.

A window of the 8B at --rows rows (bf16 [2, 1, 8, rows, 128], pinned host) reaches the device as one device_put, or
as chunks of --chunk_rows rows (jaxkv.cache.rows_to_device, the transport's chunk delivery), issued back to back
and waited for at the end. Prints GB/s for each, --reps times; the decode step's link-only prediction uses the
whole-window rate (jaxkv.bench's link peak), so a lower chunked rate shows in measured / predicted.

  python3 tools/probe_chunks.py --rows=1048576 --chunk_rows=131072
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=g-import-not-at-top  (after the path)
import jax
import jax.numpy as jnp
from absl import app
from absl import flags

from jaxkv import cache as cache_lib

ROWS = flags.DEFINE_integer("rows", 2**20, "The window's rows.")
CHUNK_ROWS = flags.DEFINE_integer("chunk_rows", 2**17, "A delivery chunk's rows.")
REPS = flags.DEFINE_integer("reps", 3, "Timed repetitions of each.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  mesh = jax.make_mesh((1,), ("tensor",))
  host = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(), memory_kind="pinned_host")
  dev = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(), memory_kind="device")
  window = jax.device_put(jnp.ones((2, 1, 8, ROWS.value, 128), jnp.bfloat16), host)
  jax.block_until_ready(window)
  firsts = range(0, ROWS.value, CHUNK_ROWS.value)
  ways = {
      "whole": lambda: [jax.device_put(window, dev)],
      f"chunks of {CHUNK_ROWS.value} rows": lambda: [
          cache_lib.rows_to_device(window, f, min(CHUNK_ROWS.value, ROWS.value - f), dev) for f in firsts
      ],
  }
  print(f"window {window.nbytes / 2**30:.2f} GiB, {jax.devices()[0].device_kind}")
  for name, deliver in ways.items():
    jax.block_until_ready(deliver())  # Compiles.
    for _ in range(REPS.value):
      t0 = time.perf_counter()
      out = deliver()
      t_issue = time.perf_counter() - t0
      jax.block_until_ready(out)
      dt = time.perf_counter() - t0
      print(f"{name}: {window.nbytes / dt / 1e9:.1f} GB/s ({1e3 * dt:.1f} ms, issued in {1e3 * t_issue:.1f} ms)")
      del out


if __name__ == "__main__":
  app.run(main)
