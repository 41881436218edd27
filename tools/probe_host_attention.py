"""Probe: GB/s of the host attention kernel (jaxkv.host.attention) on the Llama-3-8B per-layer shape, alone and
while a thread streams pinned host memory to the device.

For each (batch, context, kv dtype, threads): enough layers of [2, B, 8, W, E] windows in pinned host memory to
exceed --min_gib (so the last-level cache does not serve them), each attended over all W rows by 4 query heads per
kv head, in place (zero-copy views), layer after layer as a decode step would. GB/s = stored bytes / time (median of
--repeats passes). Then the same while a thread loops `jax.device_put` of a --stream_mib pinned host array to the
device; the link's GB/s is measured alone and during the kernel. split = C / (C + L) is the host share at which
both sides finish together (C = kernel GB/s while streaming, L = link GB/s during), and bound_x = (C + L) / L the
resulting speedup over the link-bound step, ignoring per-layer latencies. --kernels=read measures a bare parallel
read (a sum of the same bytes, one range of them per thread) instead: the host memory's ceiling for the kernel.
--fractions attends only rows [0, f W) of each window (rounded down to a ROW_BLOCK), as the engine calls the kernel
for a host share f: a call's fixed cost weighs more there (ms_per_call; the read reads the same bytes).

  PYTHONPATH=. python3 tools/probe_host_attention.py --threads=0,14,8 --out=host_attention.json  # 16k, 32k; B 1, 4
  PYTHONPATH=. python3 tools/probe_host_attention.py --contexts=512 --stream_mib=8 --min_gib=0.01  # CPU: a smoke run
  PYTHONPATH=. python3 tools/probe_host_attention.py --batches=1 --contexts=32768 --kv_dtypes=bfloat16 \
      --threads=8,16,24 --kernels=attend,read  # The kernel against the bare read, bf16 at 32k
  PYTHONPATH=. python3 tools/probe_host_attention.py --batches=1 --contexts=32768 --kv_dtypes=bfloat16 \
      --threads=24 --fractions=1,0.84,0.42,0.21,0.09  # Per call, at the engine's sizes

With GNU OpenMP (numba's "omp" layer) a thread that loses its core makes the others spin at the barrier; on a busy
2-core machine "workqueue" kept 2-thread scaling where "omp" lost it, so compare --threading_layer=workqueue.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import statistics
import threading
import time

import jax
import jax.numpy as jnp
import numba
import numpy as np
from absl import app, flags

from jaxkv import mesh as mesh_lib
from jaxkv.host import attention as host_attention
from jaxkv.kv_quant import KVFormat

KV_HEADS, GROUP, HEAD_DIM = 8, 4, 128  # Llama-3-8B on one device.

BATCHES = flags.DEFINE_list("batches", ["1", "4"], "Batch sizes.")
CONTEXTS = flags.DEFINE_list("contexts", ["16384", "32768"], "Window rows W.")
KV_DTYPES = flags.DEFINE_list("kv_dtypes", ["bfloat16", "int8"], "Stored formats (jaxkv.kv_quant).")
THREADS = flags.DEFINE_list("threads", ["0"], "numba thread counts; 0 = all cores.")
KERNELS = flags.DEFINE_list("kernels", ["attend"], "attend (jaxkv.host.attention) and/or read (a bare read).")
FRACTIONS = flags.DEFINE_list("fractions", ["1"], "Shares f in (0, 1] of each window's rows attended per call.")
STREAM_MIB = flags.DEFINE_integer("stream_mib", 512, "Size of each streamed device_put.")
MIN_GIB = flags.DEFINE_float("min_gib", 2.0, "Host bytes of windows per measurement, at least (layers cycle).")
REPEATS = flags.DEFINE_integer("repeats", 5, "Passes over the layers per measurement.")
LAYER = flags.DEFINE_enum(
    "threading_layer", "default", ["default", "omp", "tbb", "workqueue"], "numba's threading layer (see its docs)."
)
OUT = flags.DEFINE_string("out", None, "Write the rows as JSON here.")


class _Stream:
  """Loops device_put of one pinned host array to the device; records (finish time, bytes) of each copy."""

  def __init__(self, mib: int):
    mesh = mesh_lib.make_mesh((("tensor", 1),))
    self.src = jax.device_put(np.ones(mib << 20, np.uint8), mesh_lib.sharding(mesh, (None,), "pinned_host"))
    self.dst = mesh_lib.sharding(mesh, (None,), "device")
    self.done: list[float] = []
    self.stop = threading.Event()
    self.thread = threading.Thread(target=self._loop, daemon=True)

  def _loop(self):
    while not self.stop.is_set():
      jax.device_put(self.src, self.dst).block_until_ready()
      self.done.append(time.perf_counter())

  def gbps(self, t0: float, t1: float) -> float:
    """Link GB/s over copies that finished in [t0, t1]."""
    n = sum(t0 <= t <= t1 for t in self.done)
    return n * self.src.nbytes / (t1 - t0) / 1e9

  def __enter__(self):
    self.thread.start()
    while len(self.done) < 2:  # Warm.
      time.sleep(0.001)
    return self

  def __exit__(self, *exc):
    self.stop.set()
    self.thread.join()


def _windows(batch: int, rows: int, fmt: KVFormat, min_bytes: float) -> list[jax.Array]:
  """Layers of stored windows [2, B, 8, W, E] in pinned host memory, N(0, 1) values packed in `fmt`."""
  mesh = mesh_lib.make_mesh((("tensor", 1),))
  x = jax.random.normal(jax.random.key(0), (2, batch, KV_HEADS, rows, HEAD_DIM), jnp.float32)
  stored = jax.jit(fmt.pack)(x)
  host = mesh_lib.sharding(mesh, mesh_lib.CACHE_AXES, "pinned_host")
  layers = [jax.device_put(stored, host) for _ in range(max(2, int(np.ceil(min_bytes / stored.nbytes))))]
  view = host_attention.shard_views(layers[0])[0][1]
  if not np.array_equal(view, np.asarray(jax.device_get(stored))):
    raise RuntimeError("a zero-copy view does not show the pinned host array's values")
  return layers


@numba.njit(parallel=True, nogil=True)
def _read(words, parts):
  """The sum of u64 words [S, N] (S segments, each contiguous), each of `parts` tasks reading one range of the words
  in row-major order."""
  s, n = words.shape
  sums = np.zeros(parts, np.uint64)
  for t in numba.prange(parts):
    total = np.uint64(0)
    lo, hi = s * n * t // parts, s * n * (t + 1) // parts
    for seg in range(lo // n, (hi + n - 1) // n):
      for i in range(max(lo - seg * n, 0), min(hi - seg * n, n)):
        total += words[seg, i]
    sums[t] = total
  return sums.sum()


def _pass_seconds(kernel, layers, q, start, rows, fmt, threads) -> float:
  """One pass over the layers, rows [0, rows) of each."""
  t0 = time.perf_counter()
  for w in layers:
    if kernel == "read":
      numba.set_num_threads(threads)
      for _, view in host_attention.shard_views(w):  # [2, B, K, W, E]: rows [0, rows) of each (K or V, b, head).
        raw = view.view(np.uint8).reshape(-1, view[0, 0, 0].nbytes)
        _read(raw[:, : raw.shape[1] * rows // view.shape[3]].view(np.uint64), threads)
    else:
      host_attention.attend_array(w, q, start, 0, rows, fmt, threads=threads)
  return time.perf_counter() - t0


def run(
    batches, contexts, dtypes, threads, stream_mib, repeats, min_gib=0.0, kernels=("attend",), fractions=(1.0,)
) -> list[dict]:
  """Measures every combination; returns one dict per (batch, context, kv dtype, threads, kernel, fraction)."""
  out = []
  with _Stream(stream_mib) as stream:  # The link alone, once.
    t0 = time.perf_counter()
    time.sleep(1.0)
    link_alone = stream.gbps(t0, time.perf_counter())
  for name in dtypes:
    fmt = KVFormat(name, HEAD_DIM, "bfloat16")
    for batch in batches:
      for rows in contexts:
        layers = _windows(batch, rows, fmt, min_gib * 2**30)
        q = np.random.default_rng(0).standard_normal((batch, KV_HEADS, GROUP, HEAD_DIM)).astype(np.float32)
        start = np.zeros(batch, np.int32)
        for t, kernel, f in itertools.product(threads, kernels, fractions):
          t = t or numba.config.NUMBA_NUM_THREADS
          r1 = max(int(f * rows) // host_attention.ROW_BLOCK * host_attention.ROW_BLOCK, host_attention.ROW_BLOCK)
          nbytes = layers[0].nbytes * len(layers) * r1 // rows
          measure = functools.partial(_pass_seconds, kernel, layers, q, start, r1, fmt, t)
          measure()  # Compiles (or loads the cache) and warms.
          alone = statistics.median(measure() for _ in range(repeats))
          with _Stream(stream_mib) as stream:
            t0 = time.perf_counter()
            during = statistics.median(measure() for _ in range(repeats))
            link_during = stream.gbps(t0, time.perf_counter())
          c = nbytes / during / 1e9
          out.append(
              dict(
                  batch=batch,
                  context=rows,
                  kv_dtype=name,
                  threads=t,
                  kernel=kernel,
                  fraction=f,
                  rows_per_call=r1,
                  threading_layer=numba.threading_layer(),
                  layers=len(layers),
                  layer_mib=layers[0].nbytes / 2**20,
                  alone_ms_per_call=1e3 * alone / len(layers),
                  alone_gbps=nbytes / alone / 1e9,
                  streaming_gbps=c,
                  link_alone_gbps=link_alone,
                  link_during_gbps=link_during,
                  split=c / (c + link_during) if link_during else 1.0,
                  bound_x=(c + link_during) / link_during if link_during else float("inf"),
              )
          )
          print(out[-1], flush=True)
        del layers
  return out


def write(rows: list[dict], path: str) -> None:
  with open(path, "w") as f:
    json.dump(rows, f, indent=1)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if set(KERNELS.value) - {"attend", "read"}:
    raise app.UsageError(f"--kernels takes attend and read, got {KERNELS.value}")
  try:
    fractions = [float(f) for f in FRACTIONS.value]
  except ValueError as e:
    raise app.UsageError(f"--fractions takes numbers, got {FRACTIONS.value}") from e
  if not all(0 < f <= 1 for f in fractions):
    raise app.UsageError(f"--fractions must be in (0, 1], got {FRACTIONS.value}")
  numba.config.THREADING_LAYER = LAYER.value  # Before the first parallel call.
  print("jax", jax.__version__, jax.devices(), "numba", numba.__version__, "cores", os.cpu_count(), flush=True)
  rows = run(
      [int(b) for b in BATCHES.value],
      [int(c) for c in CONTEXTS.value],
      KV_DTYPES.value,
      [int(t) for t in THREADS.value],
      STREAM_MIB.value,
      REPEATS.value,
      MIN_GIB.value,
      KERNELS.value,
      fractions,
  )
  if OUT.value:
    write(rows, OUT.value)
  cols = (
      "batch context kv_dtype threads kernel rows_per_call alone_ms_per_call alone_gbps streaming_gbps link_alone_gbps"
  )
  cols += " link_during_gbps split"
  print("\n" + cols + " bound_x")
  for r in rows:
    print(
        " ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols.split()), f"{r['bound_x']:.2f}"
    )


if __name__ == "__main__":
  app.run(main)
