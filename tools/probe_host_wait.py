"""Probe (GPU): the host-wait op (jaxkv.host.wait) alone, then host attention with kv.host_attention_wait "device"
against "thread", alternating in one process, with streaming alone (no host attention) beside them.

Part 1, the ops: calls dispatched before their data exist must not block the dispatching thread nor finish early,
and must copy the data signalled for them; a published array must reach the host; the time to dispatch a call whose
input comes from a call still waiting (does the dispatch block?); then the latency from the host's signal to the
call's output being ready, against a call dispatched after the data were written (the "thread" way), and from a
call's dispatch to its published output, against its pinned-host output, with and without 256 MiB host-to-device
copies running meanwhile.
Part 2, the engine: Llama-3-8B geometry on the GPU (the tiny model on CPU), random weights, a synthetic context,
depth 2, one device; CELLS batch:fraction pairs, each run with both waits, ROUNDS rounds alternating the order, and
streaming alone once a round per batch. Prints one JSON line per run, then a table; OUT=dir writes
probe_host_wait.json. Run from the repo root: PYTHONPATH=. CELLS=1:0.35,1:0.4 THREADS=24 python3 tools/probe_host_wait.py
"""

import json
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import llama3_8b
from experiments import tiny
from jaxkv import config as config_lib
from jaxkv import engine as engine_lib
from jaxkv import run as run_lib
from jaxkv.host import attention as host_attention
from jaxkv.host import wait as host_wait


def _ready_after(out: jax.Array, t0: float) -> float:
  while not out.is_ready():
    pass
  return 1e6 * (time.perf_counter() - t0)


def probe_op(n: int = 200) -> dict:
  """Part 1; microseconds."""
  dev = jax.devices()[0]
  mesh = jax.make_mesh((1,), ("k",), devices=[dev])
  shape = (1, 8, 4, 129)
  spec = jax.sharding.PartitionSpec("k")
  pinned = jax.sharding.NamedSharding(mesh, spec, memory_kind="pinned_host")
  on_dev = jax.sharding.NamedSharding(mesh, spec)
  arr = jax.device_put(np.zeros(shape, np.float32), pinned)
  ((_, view),) = host_attention.shard_views(arr, writable=True)
  sig = host_wait.Slot(arr)
  waited = jax.jit(lambda x: host_wait.wait(sig.id, shape, on_dev) * 2 + x, out_shardings=on_dev)
  taken = jax.jit(lambda h, x: jax.device_put(h, jax.memory.Space.Device) * 2 + x, out_shardings=on_dev)
  pub_arr = jax.device_put(np.zeros(shape, np.float32), pinned)
  ((_, pub_view),) = host_attention.shard_views(pub_arr)
  pub = host_wait.Slot(pub_arr)

  published = jax.jit(lambda x: host_wait.publish(x * 3, pub.id, on_dev), out_shardings=on_dev)
  pinned_out = jax.jit(lambda x: x * 3, out_shardings=pinned)
  x = jax.device_put(np.ones(shape, np.float32), on_dev)
  out = {}
  # Dispatched ahead: no blocking, nothing early, the right data.
  for i in range(2):  # Compile and warm up.
    view[...] = i
    sig.signal()
    waited(x).block_until_ready()
    taken(arr, x).block_until_ready()
    published(x)
    pub.wait()
    pinned_out(x).block_until_ready()
  t0 = time.perf_counter()
  outs = [waited(x) for _ in range(5)]
  out["dispatch_5_us"] = 1e6 * (time.perf_counter() - t0)
  time.sleep(0.05)
  out["ready_before_signal"] = sum(o.is_ready() for o in outs)
  ok = True
  for k, o in enumerate(outs):
    data = np.random.default_rng(k).random(shape, np.float32)
    view[...] = data
    sig.signal()
    ok &= bool(np.array_equal(np.asarray(o), data * 2 + 1))
  xr = jax.device_put(np.random.default_rng(9).random(shape, np.float32), on_dev)
  published(xr)
  pub.wait()
  ok &= bool(np.array_equal(pub_view, np.asarray(xr) * 3))
  out["values_ok"] = ok
  # Does dispatching a call block while its input comes from a call waiting on the devices? A timer signals 5 ms
  # after each waiting call: a dispatch that blocks takes ~5 ms, one that does not tens of microseconds.
  follow = jax.jit(lambda y: y * 2, out_shardings=on_dev)
  follow(x).block_until_ready()
  for name, dependent in (("independent", False), ("dependent", True)):
    times = []
    for i in range(20):
      view[...] = i
      o = waited(x)
      timer = threading.Timer(0.005, sig.signal)
      timer.start()
      t0 = time.perf_counter()
      f = follow(o if dependent else x)
      times.append(1e6 * (time.perf_counter() - t0))
      timer.join()
      jax.block_until_ready((o, f))
    out[f"{name}_dispatch_while_waiting_us_median"] = round(float(np.median(times)), 1)

  big = jax.device_put(np.ones(2**26, np.float32), jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host"))
  stop = threading.Event()

  def stream():
    while not stop.is_set():
      jax.device_put(big, jax.sharding.SingleDeviceSharding(dev)).block_until_ready()

  for load in ("idle", "streaming"):
    if load == "streaming":
      t = threading.Thread(target=stream, daemon=True)
      t.start()
      time.sleep(0.05)
    lat = {k: [] for k in ("signal_to_ready", "dispatch_to_ready", "dispatch_to_published", "dispatch_to_pinned")}
    for i in range(n):
      o = waited(x)
      time.sleep(0.001)  # The device reaches the wait.
      view[...] = i
      t0 = time.perf_counter()
      sig.signal()
      lat["signal_to_ready"].append(_ready_after(o, t0))
      time.sleep(0.001)
      view[...] = i
      t0 = time.perf_counter()
      lat["dispatch_to_ready"].append(_ready_after(taken(arr, x), t0))
      time.sleep(0.001)
      t0 = time.perf_counter()
      published(x)
      pub.wait()
      lat["dispatch_to_published"].append(1e6 * (time.perf_counter() - t0))
      time.sleep(0.001)
      t0 = time.perf_counter()
      lat["dispatch_to_pinned"].append(_ready_after(pinned_out(x), t0))
    if load == "streaming":
      stop.set()
      t.join()
    for k, v in lat.items():
      out[f"{load}_{k}_us_median"] = round(float(np.median(v)), 1)
  print(json.dumps(out), flush=True)
  return out


def probe_engine(cells, ctx: int, new: int, rounds: int, threads: int) -> list[dict]:
  """Part 2: one row per timed generate."""
  cd = (llama3_8b if jax.default_backend() == "gpu" else tiny).get_config().unlock()
  cd.engine.capacity = -(-(ctx + new) // cd.kv.block) * cd.kv.block
  cd.mesh.tensor = 1
  cd.kv.update(placement="host", pipeline_depth=2, host_attention_threads=threads)
  cfg = config_lib.from_config_dict(cd)
  mesh, params, _ = run_lib.build(cfg, 0)
  layout = run_lib.make_layout(cfg, mesh)
  chunk = cfg.engine.prefill_chunk
  zero_rows = (ctx - 1) // chunk * chunk
  rows = []

  def engine(**kv):
    cd.kv.update(host_attention=False, host_attention_fraction=0.0, host_attention_wait="thread")
    cd.kv.update(**kv)
    return engine_lib.Engine(config_lib.from_config_dict(cd), mesh, params, layout)

  for batch in sorted({b for b, _ in cells}):
    prompts = run_lib.random_prompts(cfg.model.vocab_size, [ctx] * batch, 1)
    variants = {("stream", 0.0): engine()}
    for b, f in cells:
      if b == batch:
        for wait in ("thread", "device"):
          variants[(wait, f)] = engine(host_attention=True, host_attention_fraction=f, host_attention_wait=wait)
    for eng in variants.values():  # Warm-up: compiles.
      eng.generate(prompts, new, zero_rows=zero_rows)
    for r in range(rounds):
      for (wait, f), eng in variants.items() if r % 2 == 0 else reversed(variants.items()):
        res = eng.generate(prompts, new, zero_rows=zero_rows)
        ha = res.transport.get("host_attention", {})
        parts = {k.removesuffix("_ms_per_step"): round(v, 2) for k, v in ha.items() if k.endswith("_ms_per_step")}
        ms = 1e3 * res.timing["decode_s"] / res.timing["decode_steps"]
        rows.append(
            dict(batch=batch, fraction=f, wait=wait, round=r, ms_per_step=round(ms, 2), **parts)
            | dict(tokens_sha256=res.tokens_sha256, logits_sha256=res.logits_sha256)
        )
        print(json.dumps(rows[-1]), flush=True)
  return rows


def main():
  gpu = jax.default_backend() == "gpu"
  if os.environ.get("OP_ONLY"):
    probe_op(200 if gpu else 20)
    return
  op = None if os.environ.get("SKIP_OP") else probe_op(200 if gpu else 20)
  cells = [(int(b), float(f)) for b, f in (c.split(":") for c in os.environ.get("CELLS", "1:0.35").split(","))]
  rows = probe_engine(
      cells,
      ctx=int(os.environ.get("CTX", 32768 if gpu else 100)),
      new=int(os.environ.get("NEW", 17)),
      rounds=int(os.environ.get("ROUNDS", 3)),
      threads=int(os.environ.get("THREADS", 0)),
  )
  print("batch fraction wait: median ms/step (rounds); same bits as thread")
  for key in dict.fromkeys((r["batch"], r["fraction"], r["wait"]) for r in rows):
    mine = [r for r in rows if (r["batch"], r["fraction"], r["wait"]) == key]
    ref = [r for r in rows if (r["batch"], r["fraction"], r["wait"]) == (key[0], key[1], "thread")]
    same = all(r["logits_sha256"] == ref[0]["logits_sha256"] for r in mine) if ref else "-"
    ms = [r["ms_per_step"] for r in mine]
    print(f"{key[0]} {key[1]} {key[2]}: {np.median(ms):.2f} {ms} {same}")
  if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "probe_host_wait.json"), "w") as f:
      json.dump(dict(device=str(jax.devices()[0].device_kind), op=op, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
