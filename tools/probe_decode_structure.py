"""Probe (GPU): the structure of a device-resident decode step, Llama-3-8B geometry, 4096-row windows, batch 1 and 8.

Times 32 layers in steady state (20 + 3 steps dispatched back to back, one wait at the end; no head) as:
  per_layer      one jitted call per layer (model.decode_layer, as the engine with kv.group_layers=1)
  group_plain    one call for all 32 layers, each layer attending its window with the open page appended (a copy)
  group_split    one call, each layer attending its window and its open page apart, merged (model.decode_layer)
(before commit 5533781 model.decode_layer was group_plain's layer)
  group_noattn   one call, the layers without attention: the weights' matrix products alone (their floor)
and the one-call step waited for each time (dispatch and execution in series). Prints a JSON line per batch and
writes $OUT/p2_$TAG.json. Run from the repo root: PYTHONPATH=. TAG=default python3 tools/probe_decode_structure.py
(XLA_FLAGS picks the variant, e.g. TAG=nocb XLA_FLAGS=--xla_gpu_enable_command_buffer=).
"""

import os, time, json, math
import jax, jax.numpy as jnp, numpy as np
from experiments import llama3_8b
from jaxkv import config as C, run, model, mesh as mesh_lib
from jaxkv.kv_quant import KVFormat
from jaxkv.meta import Meta

OUT = os.environ.get("OUT", "/tmp")
TAG = os.environ.get("TAG", "default")
cd = llama3_8b.get_config()
cd.engine.capacity = 8192
if os.environ.get("SMOKE"):
  cd.model.num_layers = 4
  cd.model.d_model = 256
  cd.model.mlp_dim = 512
  cd.model.vocab_size = 512
cfg = C.from_config_dict(cd)
mc = cfg.model
mesh, params, eng = run.build(cfg, 0)
L = mc.num_layers
layers = params["layers"]
kv = mesh_lib.sharding(mesh, mesh_lib.CACHE_AXES, "device")
rep = mesh_lib.replicated(mesh)
fmt = KVFormat.of(mc)


def layer_plain(p, x, w, o, meta):  # the open page appended to the window (a copy), attended together
  start, end = Meta.start(meta), Meta.end(meta)
  q, o2 = model.query_and_write(p, x, o, start, end, end - w.shape[3], mc, fmt)
  rows = jnp.arange(w.shape[3] + o2.shape[3])
  mask = (rows[None] >= start[:, None]) & (rows[None] <= end)
  out = model.attention(q, fmt.unpack(jnp.concatenate([w, o2], axis=3)), mask[:, None, :])
  return model.attn_out_and_mlp(p, x[:, None, :], out, mc)[:, 0, :], o2


def layer_noattn(p, x, w, o, meta):
  q, o2 = model.query_and_write(p, x, o, Meta.start(meta), Meta.end(meta), Meta.end(meta) - w.shape[3], mc, fmt)
  return model.attn_out_and_mlp(p, x[:, None, :], q.astype(x.dtype), mc)[:, 0, :], o2


def layer_split(p, x, w, o, meta):  # window and open page attended apart, merged
  return model.decode_layer(p, x, w, o, Meta.start(meta), Meta.end(meta), cfg=mc, kv_format=fmt)


one_layer = jax.jit(layer_split, donate_argnums=(3,))  # One call per layer.


def group(layer_fn):
  def g(ps, x, ws, os_, meta):
    new = []
    for p, w, o in zip(ps, ws, os_):
      x, o = layer_fn(p, x, w, o, meta)
      x = jax.lax.optimization_barrier(x)
      new.append(o)
    return x, new

  return jax.jit(g, donate_argnums=(3,))


res = {}
for B in [1, 8]:
  W = 4096
  key = jax.random.key(1)
  ws = [
      jax.device_put(
          jax.random.normal(jax.random.fold_in(key, l), (2, B, mc.num_kv_heads, W, mc.head_dim), jnp.bfloat16), kv
      )
      for l in range(L)
  ]
  opens = [jax.device_put(jnp.zeros((2, B, mc.num_kv_heads, 256, mc.head_dim), jnp.bfloat16), kv) for l in range(L)]
  meta = jax.device_put(Meta.pack(np.zeros(B, np.int32), W + 5), rep)
  x0 = jax.device_put(jax.random.normal(jax.random.key(7), (B, mc.d_model), jnp.bfloat16), rep)

  def steady(step, n=40):
    for _ in range(3):
      jax.block_until_ready(step())
    t0 = time.perf_counter()
    last = None
    for _ in range(n):
      last = step()
    t1 = time.perf_counter()
    jax.block_until_ready(last)
    t2 = time.perf_counter()
    return dict(ms=(t2 - t0) * 1e3 / n, dispatch_ms=(t1 - t0) * 1e3 / n)

  def per_layer():
    x = x0
    for l in range(L):
      x, opens[l] = one_layer(layers[l], x, ws[l], opens[l], meta)
    return x

  r = {"per_layer": steady(per_layer)}
  for name, fn in [("group_plain", layer_plain), ("group_noattn", layer_noattn), ("group_split", layer_split)]:
    G = group(fn)

    def st():
      x, new = G(layers, x0, ws, opens, meta)
      opens[:] = new
      return x

    r[name] = steady(st)
  # single-call exec: block each time (exec + dispatch, no overlap)
  G = group(layer_plain)

  def st1():
    x, new = G(layers, x0, ws, opens, meta)
    opens[:] = new
    return x

  ts = []
  for _ in range(10):
    t0 = time.perf_counter()
    jax.block_until_ready(st1())
    ts.append((time.perf_counter() - t0) * 1e3)
  r["group_plain_blocking_ms"] = sorted(ts)[5]
  res[f"B{B}"] = r
  print(TAG, B, json.dumps(r), flush=True)
  del ws
json.dump(res, open(os.path.join(OUT, f"p2_{TAG}.json"), "w"), indent=1)
