"""Check (GPU): a request's bits whatever else is in flight, and in every fresh process (issue 50), and their cost.

Random weights of --config (default the Llama-3-8B geometry with --layers layers), greedy. Parts (--parts; by
default the ones that start processes first, before this process holds device memory):
  kernel   jaxkv.decode_attention's start-up check of the Pallas kernel at the model's heads, and --kernel_layers
           layers' decode attention in one jitted call (distinct windows per layer, bf16) per batch x window of
           --kernel_cells: legacy (today's), xla (the leaves in plain XLA) and pallas, median ms.
  server   jaxkv.serving.Server in this process (the library behind `python3 -m jaxkv.serve`, which hashes each
           request's logits) with --parallel slots: a --target_len-token request (--new_tokens new tokens) alone,
           then among --others others of mixed lengths (shorter and longer, --other_lengths as multiples of the
           target's) in --orders orders (the target first, in the middle, last); per variant (decode attention x
           placement x prefix cache: on = every prompt prefilled alone from row 0, off = at its slot's rows): do its
           tokens and logits hash equal the alone run's? Wanted for every variant but legacy, which the check must
           see differ; with the cache off the prefill still depends on the slot's rows (not yet batch-invariant).
  process  --processes fresh `python3 -m jaxkv.generate` processes per JAXKV_GPU_KERNELS choice (--kernel_choices;
           "table" = one process with record:FILE, then the others with table:FILE), each with its own empty
           --compilation_cache_dir, run two at a time (two servers started at once): one logits hash per choice?
           And each choice's decode ms per step.
  cost     `python3 -m jaxkv.bench` A/B, one process per decode attention (--cost_impls, interleaved), --cost_layers
           layers, synthetic context: arms device, host_d2, host_d2_int8 at --cost_contexts, batch 1, and device at
           batch 8 (--cost_arms); median ms per step, new / legacy (target <= 1.03).
Prints a pass/fail table and the ms tables last; writes everything to --json_out. About 8 minutes on one H200
(estimate: not yet timed there). From the repository root:

  python3 tools/check_invariance.py --cpu_devices=0 --config=experiments/llama3_8b.py --json_out=invariance.json

A CPU dry run (tiny model, small sizes):

  python3 tools/check_invariance.py --cpu_devices=1 --config=experiments/tiny.py --layers=2 --cost_layers=2 \\
      --capacity=1024 --target_len=40 --new_tokens=6 --kernel_cells=1x512 --kernel_layers=2 \\
      --process_prompts=1,40,41 --processes=2 --cost_arms=device,host_d2 --cost_contexts=64 --cost_new_tokens=4 \\
      --cost_rounds=1 --json_out=/tmp/invariance.json
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags
from ml_collections import config_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jaxkv.apps import cli  # pylint: disable=g-import-not-at-top,wrong-import-position
from jaxkv.apps import generate  # pylint: disable=g-import-not-at-top,wrong-import-position  (--parallel, --seed, --json_out)
from jaxkv.apps import launch  # pylint: disable=g-import-not-at-top,wrong-import-position

PARTS = flags.DEFINE_list("parts", ["process", "cost", "kernel", "server"], "Parts to run, in this order.")
LAYERS = flags.DEFINE_integer("layers", 4, "model.num_layers of the server and process parts.")
KERNEL_CELLS = flags.DEFINE_list("kernel_cells", ["1x4096", "8x4096", "1x32768", "8x32768"], "kernel: BxW cells.")
KERNEL_LAYERS = flags.DEFINE_integer("kernel_layers", 32, "kernel: layers per timed call.")
TARGET_LEN = flags.DEFINE_integer("target_len", 1500, "server: the target request's prompt tokens.")
NEW_TOKENS = flags.DEFINE_integer("new_tokens", 48, "server: the target's new tokens (the others': 1/3 to all).")
OTHERS = flags.DEFINE_integer("others", 15, "server: requests beside the target.")
OTHER_LENGTHS = flags.DEFINE_list(
    "other_lengths",
    ["0.1", "0.4", "0.9", "1.0007", "1.05", "1.4", "2.0", "0.6", "1.7", "0.2", "1.2", "0.8", "1.9", "0.3", "1.5"],
    "server: the others' prompt lengths as multiples of --target_len (cycled).",
)
ORDERS = flags.DEFINE_integer("orders", 3, "server: orders of the requests (the target first, middle, last, ...).")
VARIANTS = flags.DEFINE_list(
    "variants",
    ["auto/device/on", "auto/host/on", "auto/device/off", "legacy/device/on"],
    "server: decode_attention/placement/prefix cache (on: prompts prefilled alone) per variant.",
)
PROCESS_PROMPTS = flags.DEFINE_list("process_prompts", ["1", "4095", "4097"], "process: prompt lengths (batch).")
PROCESSES = flags.DEFINE_integer("processes", 2, "process: fresh processes per kernel choice.")
KERNEL_CHOICES = flags.DEFINE_list(
    "kernel_choices", ["timed", "untimed", "cublas_untimed", "deterministic", "table"], "process: JAXKV_GPU_KERNELS."
)
COST_ARMS = flags.DEFINE_list("cost_arms", ["device", "host_d2", "host_d2_int8"], "cost: bench arms at batch 1.")
COST_IMPLS = flags.DEFINE_list("cost_impls", ["legacy", "auto"], "cost: engine.decode_attention values, A then B.")
COST_LAYERS = flags.DEFINE_integer("cost_layers", 8, "cost: model.num_layers.")
COST_CONTEXTS = flags.DEFINE_list("cost_contexts", ["4096", "32768"], "cost: contexts.")
COST_NEW_TOKENS = flags.DEFINE_integer("cost_new_tokens", 32, "cost: new tokens per sample.")
COST_ROUNDS = flags.DEFINE_integer("cost_rounds", 3, "cost: rounds per arm.")
COST_TARGET = 1.03  # New / legacy ms per step, every cell (issue 50).


def _config_args() -> list[str]:
  """--cpu_devices, --config and the --config.* overrides of this run, for the processes it starts."""
  path = config_flags.get_config_filename(flags.FLAGS["config"])
  overrides = [a for a in sys.argv[1:] if a.startswith("--config.")]
  capacity = [f"--capacity={cli.SHORTHAND_FLAGS['capacity'].value}"] if cli.SHORTHAND_FLAGS["capacity"].value else []
  return [f"--cpu_devices={cli.CPU_DEVICES.value}", f"--config={path}", *overrides, *capacity]


def _app(module: str, args: list[str], json_out: str, env: dict | None = None, timeout: float = 600) -> dict:
  """`python3 -m module args --json_out=json_out` from the repository root; its JSON with wall_process_s, or the
  error's tail."""
  t0 = time.perf_counter()
  proc = subprocess.run(
      [sys.executable, "-m", module, *args, f"--json_out={json_out}"],
      cwd=ROOT,
      env=dict(os.environ, **(env or {})),
      capture_output=True,
      text=True,
      timeout=timeout,
      check=False,
  )
  if proc.returncode or not os.path.exists(json_out):
    return dict(rc=proc.returncode, error=proc.stderr[-3000:])
  with open(json_out) as f:
    out = json.load(f)
  return dict(out, rc=0, wall_process_s=time.perf_counter() - t0)


def _median_ms(fn, args, reps: int = 10) -> float:
  import jax  # pylint: disable=g-import-not-at-top

  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(1e3 * (time.perf_counter() - t0))
  return statistics.median(times)


def part_kernel(config) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  from jaxkv import decode_attention as da  # pylint: disable=g-import-not-at-top
  from jaxkv import model  # pylint: disable=g-import-not-at-top

  m, device = config.model, jax.devices()[0]
  gpu = device.platform == "gpu"
  check = da.pallas_check(device, "bfloat16", m.num_heads, m.num_kv_heads, m.head_dim, interpret=not gpu)
  out = dict(check=check, cells={})
  print(f"\n(kernel) start-up check on {device}: {check or 'passed'}", flush=True)
  k, g, dh, page = m.num_kv_heads, m.num_heads // m.num_kv_heads, m.head_dim, config.kv.block
  for cell in KERNEL_CELLS.value:
    b, w = (int(v) for v in cell.split("x"))
    key = jax.random.key(0)
    rand = lambda i, shape: jax.random.normal(jax.random.fold_in(key, i), shape, jnp.bfloat16)
    n = KERNEL_LAYERS.value
    qs = [rand(l, (b, k, g, dh)) for l in range(n)]
    windows = [rand(100 + l, (2, b, k, w, dh)) for l in range(n)]
    pages = [rand(200 + l, (2, b, k, page, dh)) for l in range(n)]
    start, end = jnp.zeros((b,), jnp.int32), jnp.int32(w + page // 2)

    def layers(impl):
      def f(qs, windows, pages, start, end):
        outs = []
        for q, window, p in zip(qs, windows, pages):
          if impl == "legacy":
            outs.append(model.legacy_decode_attention(q, (window, p), start, end))
          else:
            outs.append(da.attend(q, (window, p), 0, start, end, impl=impl, interpret=not gpu)[0])
        return jnp.stack(outs)

      return jax.jit(f)

    ms = {}
    for impl in ("legacy", "xla") + (("pallas",) if check is None else ()):
      ms[impl] = _median_ms(layers(impl), (qs, windows, pages, start, end), reps=10 if gpu else 1)
    out["cells"][cell] = ms
    print(f"  b{b} w{w}, {n} layers: " + ", ".join(f"{i} {v:.3f} ms" for i, v in ms.items()), flush=True)
  return out


def _requests(vocab: int, order: int):
  """(requests, the target's index): the target and --others others, shuffled by `order` (order 0: the target first,
  1: in the middle, 2: last, then seeded positions)."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  from jaxkv import serving  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(1234)
  draw = lambda n: tuple(rng.integers(0, vocab, n).tolist())
  target = serving.Request(draw(TARGET_LEN.value), NEW_TOKENS.value, seed=0)
  fractions = [float(f) for f in OTHER_LENGTHS.value]
  lengths = [max(1, round(TARGET_LEN.value * fractions[i % len(fractions)])) for i in range(OTHERS.value)]
  news = rng.integers(max(1, NEW_TOKENS.value // 3), NEW_TOKENS.value + 1, OTHERS.value).tolist()
  others = [serving.Request(draw(n), int(t), seed=i + 1) for i, (n, t) in enumerate(zip(lengths, news))]
  mix = np.random.default_rng(order).permutation(len(others)).tolist()
  others = [others[i] for i in mix]
  at = (0, len(others) // 2, len(others))[order] if order < 3 else int(np.random.default_rng(order).integers(0, 16))
  return others[:at] + [target] + others[at:], at


def _serve(server, requests):
  """The requests on all `parallel` slots, as the HTTP server's loop runs them (jaxkv.serving.loop), where
  Server.serve runs min(parallel, len(requests)): a request alone would run a batch of 1, whose logits product is
  another shape, which the GPU computes with another kernel."""
  from jaxkv import serving  # pylint: disable=g-import-not-at-top

  run = serving.Run(server, batch=server.parallel)
  try:
    errors = server.validate(requests)
    ids = [None if e else run.submit(r) for r, e in zip(requests, errors)]
    t0 = time.perf_counter()
    while run.scheduler.queue:
      for _ in run.epoch():
        pass
    return run.result(ids, errors, time.perf_counter() - t0)
  finally:
    run.close()


def part_server(config, mesh, params) -> dict:
  import dataclasses  # pylint: disable=g-import-not-at-top

  from jaxkv import engine as engine_lib  # pylint: disable=g-import-not-at-top
  from jaxkv import serving  # pylint: disable=g-import-not-at-top

  out = {}
  print(
      f"\n(server) target {TARGET_LEN.value} tokens + {NEW_TOKENS.value} new, {OTHERS.value} others, --parallel "
      f"{generate.PARALLEL.value}; same tokens / same logits hash as alone:",
      flush=True,
  )
  for variant in VARIANTS.value:
    impl, placement, cache = variant.split("/")
    cfg = dataclasses.replace(
        config,
        engine=dataclasses.replace(config.engine, decode_attention=impl),
        kv=dataclasses.replace(config.kv, placement=placement),
    )
    engine = engine_lib.Engine(cfg, mesh, params)
    serve = lambda reqs: _serve(serving.Server(engine, generate.PARALLEL.value, 1 if cache == "on" else 0), reqs)
    t0 = time.perf_counter()
    alone = serve([_requests(cfg.model.vocab_size, 0)[0][0]]).results[0]
    runs = []
    for order in range(ORDERS.value):
      reqs, at = _requests(cfg.model.vocab_size, order)
      got = serve(reqs).results[at]
      first_diff = next((i for i, (a, b) in enumerate(zip(got.tokens, alone.tokens)) if a != b), None)
      runs.append(
          dict(
              order=order,
              first_row=got.first_row,
              slot=got.slot,
              epoch=got.epoch,
              same_tokens=got.tokens == alone.tokens,
              same_logits=got.logits_sha256 == alone.logits_sha256,
              first_different_token=first_diff,
          )
      )
    out[variant] = dict(
        alone=dict(first_row=alone.first_row, logits_sha256=alone.logits_sha256),
        runs=runs,
        same_tokens=all(r["same_tokens"] for r in runs),
        same_logits=all(r["same_logits"] for r in runs),
        decode_attention=engine.stage_fns[0].decode_attention,
        wall_s=time.perf_counter() - t0,
    )
    rows = ", ".join(f"order {r['order']} row {r['first_row']}: {r['same_tokens']}/{r['same_logits']}" for r in runs)
    print(f"  {variant:>18} ({out[variant]['decode_attention']}): {rows}", flush=True)
  return out


def part_process(tmp: str) -> dict:
  lens = PROCESS_PROMPTS.value
  args = _config_args() + [f"--config.model.num_layers={LAYERS.value}", f"--batch={len(lens)}"]
  args += [f"--prompt_len={','.join(lens)}", "--max_new_tokens=24", "--seed=11", "--kv_placement=device"]
  env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.4"}  # Two processes share the GPU with this one.

  def fresh(name: str, choice: str) -> dict:
    cache = tempfile.mkdtemp(prefix=f"cache-{name}-", dir=tmp)
    o = _app(
        "jaxkv.generate",
        [*args, f"--compilation_cache_dir={cache}"],
        f"{tmp}/{name}.json",
        dict(env, JAXKV_GPU_KERNELS=choice),
    )
    t = o.get("timing") or {}
    ms = 1e3 * t["decode_s"] / max(1, t["decode_steps"]) if t else None
    return dict(
        rc=o["rc"],
        error=o.get("error"),
        logits_sha256=o.get("logits_sha256"),
        tokens_sha256=o.get("tokens_sha256"),
        decode_ms_per_step=ms,
        wall_process_s=o.get("wall_process_s"),
    )

  out = {}
  print(f"\n(process) {PROCESSES.value} fresh processes per choice, each with an empty compilation cache:", flush=True)
  for choice in KERNEL_CHOICES.value:
    runs = {}
    if choice == "table":
      table = os.path.join(tmp, "autotune.textproto")
      runs["record"] = fresh("record", f"record:{table}")
      choice_env = f"table:{table}"
    else:
      choice_env = choice
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
      names = [f"{choice}_{i}" for i in range(PROCESSES.value)]
      runs.update(zip(names, pool.map(lambda n: fresh(n, choice_env), names)))
    hashes = {r["logits_sha256"] for r in runs.values()}
    ok = all(r["rc"] == 0 for r in runs.values())
    ms = [r["decode_ms_per_step"] for r in runs.values() if r["decode_ms_per_step"]]
    out[choice] = dict(
        runs=runs, ran=ok, one_hash=ok and len(hashes) == 1, decode_ms_per_step=statistics.median(ms) if ms else None
    )
    errors = "; ".join(f"{n}: {r['error'][-300:]}" for n, r in runs.items() if r["rc"])
    print(
        f"  {choice:>15}: ran {ok}, one logits hash {out[choice]['one_hash']} ({len(hashes)} seen), decode "
        f"{out[choice]['decode_ms_per_step'] or float('nan'):.2f} ms/step {errors}",
        flush=True,
    )
  return out


def part_cost(tmp: str) -> dict:
  base = _config_args() + [f"--config.model.num_layers={COST_LAYERS.value}", "--synthetic_context", "--nopeer"]
  base += [f"--contexts={','.join(COST_CONTEXTS.value)}", f"--new_tokens={COST_NEW_TOKENS.value}"]
  base += [f"--rounds={COST_ROUNDS.value}"]
  groups = {"b1": ["--batches=1", f"--arms={','.join(COST_ARMS.value)}"], "b8": ["--batches=8", "--arms=device"]}
  ms: dict[str, dict[str, float]] = {impl: {} for impl in COST_IMPLS.value}
  runs = {}
  print(f"\n(cost) bench, {COST_LAYERS.value} layers, median ms/step:", flush=True)
  for group, flags_ in groups.items():
    for impl in COST_IMPLS.value:
      name = f"{group}_{impl}"
      o = _app("jaxkv.bench", [*base, *flags_, f"--config.engine.decode_attention={impl}"], f"{tmp}/{name}.json")
      runs[name] = {k: o.get(k) for k in ("rc", "error", "wall_process_s")}
      if o["rc"]:
        print(f"  {name}: exit {o['rc']}: {o['error'][-500:]}", flush=True)
      for cell in o.get("cells", []):
        for arm, rec in cell["arms"].items():
          if rec.get("ms_per_step"):
            ms[impl][f"{arm} {cell['context']} b{cell['batch']}"] = rec["ms_per_step"]["median"]
  a, b = COST_IMPLS.value[0], COST_IMPLS.value[-1]
  ratios = {cell: ms[b][cell] / ms[a][cell] for cell in ms[a] if cell in ms[b]}
  return dict(
      runs=runs, ms_per_step=ms, ratios=ratios, within_target=bool(ratios) and max(ratios.values()) <= COST_TARGET
  )


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  unknown = sorted(set(PARTS.value) - {"kernel", "server", "process", "cost"})
  if unknown:
    raise app.UsageError(f"unknown --parts {unknown}: use kernel, server, process, cost")
  launch.check_outputs(generate.JSON_OUT)
  # The processes it starts share the GPU with it: this one takes device memory as it needs it, not 75% at once.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  cli.setup_platform()
  import dataclasses  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top

  from jaxkv import run  # pylint: disable=g-import-not-at-top

  config = cli.resolved_config()
  out = dict(command=" ".join(sys.argv), jax=jax.__version__, devices=[str(d) for d in jax.devices()])
  t0 = time.perf_counter()

  def save():
    out["total_s"] = time.perf_counter() - t0
    launch.write_json(out, generate.JSON_OUT.value)

  with tempfile.TemporaryDirectory(prefix="jaxkv-invariance-") as tmp:
    for part in PARTS.value:
      if part == "kernel":
        out["kernel"] = part_kernel(config)
      elif part == "server":
        cfg = dataclasses.replace(config, model=dataclasses.replace(config.model, num_layers=LAYERS.value))
        mesh, params, _ = run.build(cfg, generate.SEED.value)
        out["server"] = part_server(cfg, mesh, params)
        del params
      elif part == "process":
        out["process"] = part_process(tmp)
      else:
        out["cost"] = part_cost(tmp)
      save()
  print("\nsummary")
  if "kernel" in out:
    k = out["kernel"]
    print(f"  kernel start-up check: {'PASS' if k['check'] is None else 'FAIL ' + k['check']}")
    for cell, ms in k["cells"].items():
      print(f"    {cell:>8}: " + "  ".join(f"{i} {v:7.3f} ms" for i, v in ms.items()))
  for variant, v in out.get("server", {}).items():
    want = not variant.startswith("legacy/")  # The legacy attention: the check must see it differ.
    verdict = "PASS" if v["same_logits"] == want else "FAIL"
    print(
        f"  server {variant:>18}: same tokens {v['same_tokens']}, same logits {v['same_logits']} (want {want}): {verdict}"
    )
  for choice, v in out.get("process", {}).items():
    ms = v["decode_ms_per_step"]
    print(f"  process {choice:>15}: {'PASS' if v['one_hash'] else 'FAIL'}, decode {ms or float('nan'):.2f} ms/step")
  if "cost" in out:
    c = out["cost"]
    a, b = COST_IMPLS.value[0], COST_IMPLS.value[-1]
    print(f"  cost {b} / {a} <= {COST_TARGET}: {'PASS' if c['within_target'] else 'FAIL'}")
    for cell, r in c["ratios"].items():
      print(f"    {cell:>28}: {c['ms_per_step'][a][cell]:8.3f} {c['ms_per_step'][b][cell]:8.3f} ms  {r:.3f}")
  print(f"  total {out['total_s']:.0f} s" + (f"; wrote {generate.JSON_OUT.value}" if generate.JSON_OUT.value else ""))


if __name__ == "__main__":
  cli.run(main, {}, __doc__)
