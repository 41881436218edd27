"""Probe: H2D throughput and host issue cost of delivering a KV window as pages of P rows.

Llama-3-8B share per layer: [B, 8, P, 128] bf16 pages, K and V, 32 layers. Prints a table."""

import json, os, time
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

print("jax", jax.__version__, jax.devices(), flush=True)
print("memory_stats", jax.devices()[0].memory_stats(), flush=True)
mesh = jax.make_mesh((1,), ("tensor",))
HOST = NamedSharding(mesh, P(), memory_kind="pinned_host")
DEV = NamedSharding(mesh, P(), memory_kind="device")
L, KVH, HD = 32, 8, 128
rows = []
for B, ctx in ((1, 4096), (1, 16384), (4, 16384)):
  for page in (256, 512, 1024, 2048, 4096, ctx):
    n = ctx // page
    pages = [
        [jax.device_put(jnp.full((B, KVH, page, HD), l + i, jnp.bfloat16), HOST) for i in range(2 * n)]
        for l in range(L)
    ]
    jax.block_until_ready(pages)

    def step():
      out = [jax.device_put(pages[l], DEV) for l in range(L)]
      t_issue = time.perf_counter()
      jax.block_until_ready(out)
      return t_issue

    for _ in range(2):
      step()
    tot, iss = [], []
    for _ in range(7):
      t0 = time.perf_counter()
      ti = step()
      t1 = time.perf_counter()
      tot.append(t1 - t0)
      iss.append(ti - t0)
    nbytes = L * 2 * B * KVH * ctx * HD * 2
    r = dict(
        B=B,
        ctx=ctx,
        page=page,
        arrays_per_step=2 * n * L,
        step_ms=1e3 * np.median(tot),
        issue_ms=1e3 * np.median(iss),
        GBps=nbytes / np.median(tot) / 1e9,
        page_MiB=B * KVH * page * HD * 2 / 2**20,
    )
    rows.append(r)
    print(r, flush=True)
    del pages
# per-call dispatch of a jitted fn with many array args
xs = [jax.device_put(jnp.ones((8,), jnp.float32), DEV) for _ in range(64)]
f = jax.jit(lambda *a: a[0] + a[-1])
for _ in range(3):
  f(*xs).block_until_ready()
t0 = time.perf_counter()
for _ in range(1000):
  y = f(*xs)
y.block_until_ready()
dt = (time.perf_counter() - t0) / 1000
print(f"jit dispatch, 64 args: {dt*1e6:.1f} us/call", flush=True)
out = os.environ.get("OUT", ".")
json.dump(rows, open(os.path.join(out, "page_probe.json"), "w"), indent=1)
print("\nB ctx page page_MiB arrays step_ms issue_ms GB/s")
for r in rows:
  print(
      r["B"],
      r["ctx"],
      r["page"],
      f'{r["page_MiB"]:.1f}',
      r["arrays_per_step"],
      f'{r["step_ms"]:.2f}',
      f'{r["issue_ms"]:.2f}',
      f'{r["GBps"]:.1f}',
  )
