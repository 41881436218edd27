"""Check (GPU): speculative decoding in the server (jaxkv.serving.Server with speculate.mode lookup, what
`python3 -m jaxkv.serve --speculate=lookup` runs) against the same server without it.

Per --placements (kv.placement) one jaxkv.serving.Server of --parallel slots serves --requests requests (random bf16
weights of --config with --layers layers; prompts of 1/4 to all of --prompt_len tokens, --prompts says which repeat a
short random phrase; --new_tokens each, greedy) without and with speculation (--config.speculate.k), then checks

  tokens:  every request's greedy tokens equal without and with speculation,
  logits:  and its logits hash (a verify pass runs its rows in blocks of a step's shapes: docs/design.md, "What is
           bitwise"),

and reports each arm's tokens/s (the fastest of --repeats timed serves, the arms alternating, after one that
compiles) and decode steps, and the lookup's drafted and accepted tokens, verify passes and plain steps (random weights
follow their prompts' repeats only where they fall into loops: how many drafts are accepted, and so the speed, is the
model's). Prints the pass/fail table last; writes the details to --json_out ($OUT/check_serve_speculate.json by
default). Run from the repo root:

  python3 tools/check_serve_speculate.py --cpu_devices=0 --config=experiments/llama3_8b.py

A try of the plumbing on the CPU: python3 tools/check_serve_speculate.py --config=experiments/tiny.py --cpu_devices=2
--layers=2 --prompt_len=40 --new_tokens=24 --requests=6 --parallel=4

The CPU figures of docs/design.md: drafts that fail (the random model's output over 4096 ids does not loop),
python3 tools/check_serve_speculate.py --config=experiments/tiny.py --cpu_devices=2 --layers=2 --prompt_len=40
--new_tokens=200 --requests=8 --parallel=4 --config.engine.capacity=256 --config.model.vocab_size=4096
--prompts=random --repeats=3; and without the vocab_size override, --prompts=random and --prompts=repeating.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

from absl import app
from absl import flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jaxkv.apps import cli  # pylint: disable=g-import-not-at-top,wrong-import-position
from jaxkv.apps import launch  # pylint: disable=g-import-not-at-top,wrong-import-position

LAYERS = flags.DEFINE_integer("layers", 8, "model.num_layers (random weights).")
PLACEMENTS = flags.DEFINE_list("placements", ["device", "host"], "kv.placement of each server.")
PARALLEL = flags.DEFINE_integer("parallel", 8, "Slots.")
REQUESTS = flags.DEFINE_integer("requests", 16, "Requests per serve (more than the slots: some join a running batch).")
PROMPT_LEN = flags.DEFINE_integer("prompt_len", 2048, "The longest prompt's tokens.")
NEW_TOKENS = flags.DEFINE_integer("new_tokens", 64, "Tokens per request.")
PROMPTS = flags.DEFINE_enum(
    "prompts",
    "mixed",
    ["mixed", "repeating", "random"],
    "mixed: every other prompt a short random phrase repeated, the others random; repeating: every prompt such a"
    " phrase (lookup drafts its continuation); random: no prompt repeats a phrase (drafts fail, unless the model's"
    " output loops).",
)
REPEATS = flags.DEFINE_integer(
    "repeats", 1, "Timed serves of each arm, alternating; the fastest counts (a shared machine only slows a serve)."
)
JSON_OUT = flags.DEFINE_string(
    "json_out", os.path.join(os.environ.get("OUT", "."), "check_serve_speculate.json"), "Where the details go."
)


def _requests(vocab: int):
  """--prompts: a random phrase of 8 tokens repeated (lookup drafts its continuation) or random tokens."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  from jaxkv import serving  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(0)
  out = []
  for i in range(REQUESTS.value):
    n = int(rng.integers(max(1, PROMPT_LEN.value // 4), PROMPT_LEN.value + 1))
    repeats = PROMPTS.value == "repeating" or (PROMPTS.value == "mixed" and i % 2 == 0)
    prompt = np.resize(rng.integers(0, vocab, 8), n) if repeats else rng.integers(0, vocab, n)
    out.append(serving.Request(tuple(prompt.tolist()), NEW_TOKENS.value, seed=i))
  return out


def _arm(config, mesh, params, placement: str, mode: str, requests) -> dict:
  from jaxkv import engine as engine_lib  # pylint: disable=g-import-not-at-top
  from jaxkv import serving  # pylint: disable=g-import-not-at-top

  cfg = dataclasses.replace(
      config,
      kv=dataclasses.replace(config.kv, placement=placement),
      speculate=dataclasses.replace(config.speculate, mode=mode),
  )
  res = serving.Server(engine_lib.Engine(cfg, mesh, params), PARALLEL.value).serve(requests)
  errors = [r.error for r in res.results if r.error]
  if errors:
    raise ValueError(f"{placement}/{mode}: rejected requests: {errors[0]}")
  spec = res.transport.get("speculate", {})
  return dict(
      tokens=[r.tokens for r in res.results],
      logits_sha256=[r.logits_sha256 for r in res.results],
      tok_s=res.timing["tokens"] / res.timing["wall_s"],
      decode_steps=res.timing["decode_steps"],
      drafted=spec.get("drafted", 0),
      accepted=spec.get("accepted", 0),
      verify_passes=spec.get("verify_passes", 0),
      plain_steps=spec.get("plain_steps", 0),
  )


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  launch.check_outputs(JSON_OUT)
  cli.setup_platform()
  import jax  # pylint: disable=g-import-not-at-top

  from jaxkv import run  # pylint: disable=g-import-not-at-top

  config = cli.resolved_config()
  config = dataclasses.replace(config, model=dataclasses.replace(config.model, num_layers=LAYERS.value))
  mesh, params, _ = run.build(config, 0)
  requests = _requests(config.model.vocab_size)
  out = dict(command=" ".join(sys.argv), jax=jax.__version__, devices=[str(d) for d in jax.devices()], arms={})
  t0 = time.perf_counter()
  checks = []
  for placement in PLACEMENTS.value:
    timed = {"off": [], "lookup": []}
    for i in range(REPEATS.value + 1):  # The first serve of each arm compiles; the others are timed.
      for mode, runs in timed.items():
        arm = _arm(config, mesh, params, placement, mode, requests)
        if i:
          runs.append(arm)
    plain, spec = (
        dict(max(runs, key=lambda a: a["tok_s"]), all_tok_s=[a["tok_s"] for a in runs]) for runs in timed.values()
    )
    out["arms"][placement] = dict(plain=plain, lookup=spec)
    same = [a == b for a, b in zip(plain["tokens"], spec["tokens"])]
    same_logits = [a == b for a, b in zip(plain["logits_sha256"], spec["logits_sha256"])]
    checks.append((f"{placement} tokens", all(same), f"{sum(same)}/{len(same)} equal"))
    checks.append((f"{placement} logits", all(same_logits), f"{sum(same_logits)}/{len(same_logits)} hashes equal"))
    print(
        f"{placement}: plain {plain['tok_s']:.1f} tok/s ({plain['decode_steps']} steps), lookup "
        f"{spec['tok_s']:.1f} tok/s ({spec['decode_steps']} token steps, {spec['accepted']} of {spec['drafted']} drafts "
        f"accepted; {spec['verify_passes']} verify passes, {spec['plain_steps']} plain steps), "
        f"x{spec['tok_s'] / plain['tok_s']:.2f}",
        flush=True,
    )
  out["checks"] = {name: dict(ok=ok, detail=detail) for name, ok, detail in checks}
  out["total_s"] = time.perf_counter() - t0
  launch.write_json(out, JSON_OUT.value)
  print(f"\n{'check':<18} {'result':<6} detail")
  for name, ok, detail in checks:
    print(f"{name:<18} {'PASS' if ok else 'FAIL':<6} {detail}")
  print(f"wrote {JSON_OUT.value}")


if __name__ == "__main__":
  cli.run(main, {}, __doc__)
