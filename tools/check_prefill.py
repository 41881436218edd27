"""Check (GPU): the fused (cuDNN) prefill attention against the plain XLA one, and the prefill's time.

1. Accuracy: jaxkv.model.fused_prefill_attention with cudnn_attention against blocked_attention (the XLA reference)
   at the model's heads (Llama-3-8B: 32 / 8 x 128, bf16), a chunk of --chunk rows after W = 0, one chunk and
   --acc_prefix rows, batch 1 and a left-padded batch 2: relative error (Frobenius) and largest absolute error,
   pass <= 1e-2 (bf16 rounds each output to ~4e-3), and each call's ms (median of 5). A cuDNN failure is printed and
   the prefill timings run the XLA attention only.
2. Prefill: per prompt length (--lengths), placement (--placements: device, host at depth 2) and prefill attention
   (--impls: xla, auto), an Engine of the config (random weights, batch 1, 2 new tokens) generates twice in this
   process: prefill_s of the first, which compiles (what `python3 -m jaxkv.generate --max_new_tokens=2` reports;
   only for the first placement of an impl: the others share its programs), and of the second (warm: the targets'
   figure); the prefill plan (rows kept on the devices or not), the prefill's
   h2d and d2h bytes, and whether the placements gave the same bits (logits hash). --long: one more prompt of that
   length (a real prefill, capacity length + 256) with --long_impls only.
Prints a table last; --json_out writes every row. On CPU it runs the tiny model at small lengths (a smoke test).

  PYTHONPATH=. python3 tools/check_prefill.py --json_out=check_prefill.json              # 4k and 32k, then 128k
  PYTHONPATH=. python3 tools/check_prefill.py --lengths=32768 --impls=auto --long=0 \\
      --config.engine.prefill_chunk=4096                                                 # another chunk size
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
import traceback

from absl import app
from absl import flags
from ml_collections import config_flags

# Runs by path from the repository root: make jaxkv and experiments importable without PYTHONPATH too.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=g-import-not-at-top,wrong-import-position

from jaxkv import config as config_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from jaxkv import engine as engine_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from jaxkv import mesh as mesh_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from jaxkv import model  # pylint: disable=g-import-not-at-top,wrong-import-position
from jaxkv import run as run_lib  # pylint: disable=g-import-not-at-top,wrong-import-position

_EXPERIMENTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments")
TOLERANCE = 1e-2
FLAGS: dict = {}  # define_flags(), when run as the app.


def define_flags() -> dict:
  """The app's flags (defined when it runs, not when a test imports the module)."""
  return dict(
      config=config_flags.DEFINE_config_file(
          "config", os.path.join(_EXPERIMENTS, "llama3_8b.py"), "Experiment config (on CPU: experiments/tiny.py)."
      ),
      lengths=flags.DEFINE_list(
          "lengths", ["4096", "32768"], "Prompt lengths (batch 1), each with every placement/impl."
      ),
      placements=flags.DEFINE_list("placements", ["device", "host"], "KV placements (host at depth 2)."),
      impls=flags.DEFINE_list("impls", ["xla", "auto"], "engine.prefill_attention values to compare."),
      long=flags.DEFINE_integer("long", 131072, "A real prompt of this length with --long_impls (0 = none)."),
      long_impls=flags.DEFINE_list("long_impls", ["auto"], "engine.prefill_attention values for --long."),
      chunk=flags.DEFINE_integer("chunk", 2048, "Accuracy check: query rows of the chunk."),
      acc_prefix=flags.DEFINE_integer("acc_prefix", 30720, "Accuracy check: the longest prefix before the chunk."),
      json_out=flags.DEFINE_string("json_out", None, "Write every row here."),
  )


def _median_ms(fn, *args) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(5):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(1e3 * (time.perf_counter() - t0))
  return statistics.median(times)


def accuracy(cfg: config_lib.ModelConfig, chunk: int, prefixes, batches) -> list[dict]:
  """The fused prefill attention (cuDNN) against the XLA attention per (batch starts, prefix rows)."""
  rng = np.random.default_rng(0)
  fused = jax.jit(model.fused_prefill_attention, static_argnums=4)
  xla = jax.jit(model.blocked_attention)
  rows = []
  for starts in batches:
    for w in prefixes:
      b, dt = len(starts), cfg.dtype
      q = jnp.asarray(rng.standard_normal((b, chunk, cfg.num_heads, cfg.head_dim)), dt)
      chunk_kv = jnp.asarray(rng.standard_normal((2, b, cfg.num_kv_heads, chunk, cfg.head_dim)), dt)
      prefix_kv = jnp.asarray(rng.standard_normal((2, b, cfg.num_kv_heads, w, cfg.head_dim)), dt) if w else None
      start = jnp.asarray(starts, jnp.int32)
      kv = chunk_kv if w == 0 else jnp.concatenate([prefix_kv, chunk_kv], axis=3)
      r, keys = w + jnp.arange(chunk), jnp.arange(w + chunk)
      mask = (keys[None, None, :] <= r[None, :, None]) & (keys[None, None, :] >= start[:, None, None])
      mask = mask | (keys[None, None, :] == r[None, :, None])
      row = dict(batch_starts=list(starts), prefix_rows=w, chunk=chunk)
      ref = np.asarray(xla(q, kv, mask), np.float32)
      row["xla_ms"] = _median_ms(xla, q, kv, mask)
      try:
        got = np.asarray(fused(q, chunk_kv, prefix_kv, start, model.cudnn_attention), np.float32)
        row["cudnn_ms"] = _median_ms(fused, q, chunk_kv, prefix_kv, start, model.cudnn_attention)
      except Exception as e:  # pylint: disable=broad-exception-caught  (reported: the timings fall back to XLA)
        row.update(error=f"{type(e).__name__}: {str(e)[:500]}", ok=False)
        print(f"cuDNN prefill attention failed (batch {starts}, W {w}): {row['error']}", flush=True)
        rows.append(row)
        continue
      row["rel_err"] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
      row["max_abs_err"] = float(np.max(np.abs(got - ref)))
      row["ok"] = bool(np.isfinite(got).all() and row["rel_err"] <= TOLERANCE)
      rows.append(row)
      print(json.dumps(row), flush=True)
  return rows


def prefill_times(cd, lengths, placements, impls, mesh, params) -> list[dict]:
  """Two generates per (length, impl, placement) in this process, with the weights `params` on `mesh`: cold
  (compiles) and warm prefill_s."""
  rows = []
  for n in lengths:
    for impl in impls:
      hashes = {}
      for placement in placements:
        c = cd.copy_and_resolve_references().unlock()
        c.engine.capacity = -(-(n + 2) // c.kv.block) * c.kv.block + c.kv.block
        c.engine.prefill_attention = impl
        c.kv.update(placement=placement, pipeline_depth=2, transport_debug=1)
        cfg = config_lib.from_config_dict(c)
        row = dict(prompt_len=n, impl=impl, placement=placement, chunk=cfg.engine.prefill_chunk)
        try:
          eng = engine_lib.Engine(cfg, mesh, params, run_lib.make_layout(cfg, mesh))
          prompts = run_lib.random_prompts(cfg.model.vocab_size, [n], 1)
          first = eng.generate(prompts, 2)
          res = eng.generate(prompts, 2)
        except Exception as e:  # pylint: disable=broad-exception-caught  (reported, the other rows still run)
          row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
          print(f"prefill {n} {impl} {placement} failed:\n{traceback.format_exc()}", flush=True)
          rows.append(row)
          continue
        steps = [s for s in res.transport["steps"] if s["kind"] == "prefill"]
        plan = res.transport["prefill"]
        row.update(
            attention=plan["attention"],
            cold_prefill_s=first.timing["prefill_s"],
            warm_prefill_s=res.timing["prefill_s"],
            keep=plan["keep"],
            plan=plan["reason"],
            prefill_h2d_bytes=sum(s["h2d_bytes"] for s in steps),
            prefill_d2h_bytes=sum(s["d2h_bytes"] for s in steps),
            logits_sha256=res.logits_sha256,
            same_bits_twice=first.logits_sha256 == res.logits_sha256,
        )
        hashes[placement] = res.logits_sha256
        row["same_bits_as_placements"] = len(set(hashes.values())) == 1
        rows.append(row)
        print(json.dumps(row), flush=True)
  return rows


def _table(acc: list[dict], pre: list[dict]) -> str:
  lines = ["", "fused (cuDNN) vs XLA prefill attention, tolerance rel err <= 1e-2:", ""]
  lines.append("| batch starts | prefix rows | rel err | max abs err | cudnn ms | xla ms | ok |")
  lines.append("|---|---|---|---|---|---|---|")
  for r in acc:
    if "error" in r:
      lines.append(f"| {r['batch_starts']} | {r['prefix_rows']} | {r['error'][:80]} | | | {r['xla_ms']:.2f} | False |")
    else:
      lines.append(
          f"| {r['batch_starts']} | {r['prefix_rows']} | {r['rel_err']:.2e} | {r['max_abs_err']:.2e} "
          f"| {r['cudnn_ms']:.2f} | {r['xla_ms']:.2f} | {r['ok']} |"
      )
  lines += ["", "prefill (batch 1, 2 new tokens): prefill_s cold (compiles) / warm:", ""]
  lines.append(
      "| prompt | impl (ran) | placement | chunk | cold s | warm s | rows kept on device | prefill h2d MiB "
      "| prefill d2h MiB | same bits as the placements before |"
  )
  lines.append("|---|---|---|---|---|---|---|---|---|---|")
  for r in pre:
    head = f"| {r['prompt_len']} | {r['impl']}"
    if "error" in r:
      lines.append(f"{head} | {r['placement']} | {r['chunk']} | {r['error'][:100]} | | | | | |")
      continue
    lines.append(
        f"{head} ({r['attention']}) | {r['placement']} | {r['chunk']} | {r['cold_prefill_s']:.3f} "
        f"| {r['warm_prefill_s']:.3f} | {r['keep']} | {r['prefill_h2d_bytes'] / 2**20:.0f} "
        f"| {r['prefill_d2h_bytes'] / 2**20:.0f} | {r['same_bits_as_placements']} |"
    )
  return "\n".join(lines)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    lengths = [int(v) for v in FLAGS["lengths"].value]
  except ValueError as e:
    raise app.UsageError(f"--lengths must be comma-separated integers, got {FLAGS['lengths'].value}") from e
  cd = FLAGS["config"].value
  if jax.default_backend() != "gpu" and cd.model.d_model > 512:
    raise app.UsageError(f"no GPU ({jax.default_backend()}): run it with --config=experiments/tiny.py on CPU")
  cfg = config_lib.from_config_dict(cd)
  acc_prefixes = sorted({0, FLAGS["chunk"].value, FLAGS["acc_prefix"].value})
  acc = accuracy(cfg.model, FLAGS["chunk"].value, acc_prefixes, [[0], [0, FLAGS["chunk"].value + 7]])
  impls = FLAGS["impls"].value
  if not all(r.get("ok") for r in acc) and "auto" in impls:
    print(
        "the cuDNN prefill attention failed or missed the tolerance: the prefill times run the XLA one only", flush=True
    )
    impls = ["xla"]
  mesh = mesh_lib.make_mesh(cfg.mesh)
  params = model.init_params(cfg.model, jax.random.key(0), mesh, run_lib.make_layout(cfg, mesh))
  rows = prefill_times(cd, lengths, FLAGS["placements"].value, impls, mesh, params)
  if FLAGS["long"].value:
    long_impls = [i for i in FLAGS["long_impls"].value if i in impls] or ["xla"]
    rows += prefill_times(cd, [FLAGS["long"].value], FLAGS["placements"].value, long_impls, mesh, params)
  out = dict(
      devices=[str(d) for d in jax.devices()],
      jax=jax.__version__,
      config=dataclasses.asdict(cfg),
      tolerance=TOLERANCE,
      accuracy=acc,
      prefill=rows,
  )
  if FLAGS["json_out"].value:
    with open(FLAGS["json_out"].value, "w") as f:
      json.dump(out, f, indent=1)
  print(_table(acc, rows))


if __name__ == "__main__":
  FLAGS.update(define_flags())
  app.run(main)
