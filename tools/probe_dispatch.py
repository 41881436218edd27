"""Probe (GPU): where the host blocks in a pipelined decode step, Llama-3-8B geometry, batch 1.

Times 32 layers of `decode_layer`, one call each (a decode group of one layer), with windows delivered from pinned host memory, issued inline (device_put
on the dispatching thread) or from a feeder thread, against compute-only and transfer-only; prints ms/step,
host issue ms, and the host time spent in device_put and in the layer dispatch. CTX=4096 by default. The mesh
spans every visible GPU (split mode tensor); CUDA_VISIBLE_DEVICES=0 times one.
Run from the repo root: PYTHONPATH=. CTX=16384 python3 tools/probe_dispatch.py
"""

import dataclasses, os, queue, threading, time
import jax, jax.numpy as jnp, numpy as np
from experiments import llama3_8b
from jaxkv import config as C, run, cache as cache_lib, mesh as mesh_lib, residency
from jaxkv.meta import Meta

ctx = int(os.environ.get("CTX", "4096"))
N = 20
cd = llama3_8b.get_config()
cd.engine.capacity = ctx + 512
cfg = C.from_config_dict(cd)
mesh, params, eng = run.build(cfg, 0)
L = cfg.model.num_layers
fns = eng.fns
kv = dataclasses.replace(cfg.kv, placement="host")
args = (cfg.model, kv, eng.layout, 1, cfg.engine.capacity)
cache = cache_lib.KVCache(*args, placement=residency.place(*args))
hw = [jax.device_put(jnp.ones((2, 1, 8, ctx, 128), jnp.bfloat16) * 0.01, cache.host_sharding) for _ in range(L)]
opens = [jax.device_put(jnp.zeros((2, 1, 8, 256, 128), jnp.bfloat16), cache.device_sharding) for _ in range(L)]
rep = mesh_lib.replicated(eng.layout.last)  # The engine's replicated sharding: the head's stage.
meta = jax.device_put(Meta.pack(np.zeros(1, np.int32), ctx), rep)
x0 = jax.device_put(jnp.zeros((1, 4096), jnp.bfloat16), rep)
layers = params["layers"]
DEV = cache.device_sharding
acc = {"put": 0.0, "dec": 0.0}


def decode(p, x, w, o, m):
  x, (o,) = fns.decode_group([p], x, [w], [o], m)
  return x, o


def step_inline(depth):
  x = x0
  ring = []
  nxt = 0
  for l in range(L):
    while nxt <= min(l + depth, L - 1):
      t0 = time.perf_counter()
      ring.append(jax.device_put(hw[nxt], DEV))
      acc["put"] += time.perf_counter() - t0
      nxt += 1
    w = ring.pop(0)
    t0 = time.perf_counter()
    x, opens[l] = decode(layers[l], x, w, opens[l], meta)
    acc["dec"] += time.perf_counter() - t0
  return x


class Feeder:
  """Issues deliveries from a thread, at most `depth + 1` ahead of the layer being computed."""

  def __init__(self, depth):
    self.q = queue.Queue()
    self.sem = threading.Semaphore(depth + 1)
    self.t = threading.Thread(target=self.run, daemon=True)
    self.jobs = queue.Queue()
    self.t.start()

  def run(self):
    while True:
      l = self.jobs.get()
      self.sem.acquire()
      self.q.put(jax.device_put(hw[l], DEV))

  def step(self):
    for l in range(L):
      self.jobs.put(l)
    x = x0
    for l in range(L):
      w = self.q.get()
      self.sem.release()
      x, opens[l] = decode(layers[l], x, w, opens[l], meta)
    return x


def timeit(fn, n=N):
  jax.block_until_ready(fn())
  jax.block_until_ready(fn())
  acc["put"] = acc["dec"] = 0.0
  ts = []
  for _ in range(n):
    t0 = time.perf_counter()
    r = fn()
    t1 = time.perf_counter()
    jax.block_until_ready(r)
    ts.append((time.perf_counter() - t0, t1 - t0))
  a = np.array(ts)
  return 1e3 * np.median(a[:, 0]), 1e3 * np.median(a[:, 1]), 1e3 * acc["put"] / n, 1e3 * acc["dec"] / n


rows = []
for name, fn in [
    ("inline d0", lambda: step_inline(0)),
    ("inline d1", lambda: step_inline(1)),
    ("inline d2", lambda: step_inline(2)),
    ("inline d4", lambda: step_inline(4)),
    ("thread d1", Feeder(1).step),
    ("thread d2", Feeder(2).step),
    ("thread d4", Feeder(4).step),
]:
  r = timeit(fn)
  rows.append((name,) + r)
  print(rows[-1], flush=True)
dw = [jax.device_put(h, DEV) for h in hw]


def comp():
  x = x0
  for l in range(L):
    x, opens[l] = decode(layers[l], x, dw[l], opens[l], meta)
  return x


r = timeit(comp)
rows.append(("compute only",) + r)
r = timeit(lambda: [jax.device_put(h, DEV) for h in hw])
rows.append(("transfer only",) + r)
print(f"\nctx {ctx}: arm ms/step host_ms put_ms dispatch_ms")
for r in rows:
  print(f"{r[0]:16s} {r[1]:7.2f} {r[2]:7.2f} {r[3]:7.2f} {r[4]:7.2f}")
