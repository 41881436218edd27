"""Check (GPU): speculative decoding over the streamed cache at 32k, batch 1, with the Llama-3-8B geometry.

One `python3 -m jaxkv.bench` process (random bf16 weights, --synthetic_context, --config.speculate.k=K) runs host_d2
(the --plain arm, written host_d2 below; host_d2_ha: through host attention) and its speculative arms: host_d2_spec<M>
for each M of --rights (an oracle drafter of K tokens whose first M are the plain run's, so that each verify pass
accepts M where the page leaves room: tokens per pass M + 1), host_d2_spec (the lookup drafter on random prompt ids:
drafts that fail, and its switch) and host_d2_self (self-speculation: the same model drafts over an int4 copy of the
KV resident on the device, jaxkv.self_draft), then checks:

  verify:  host_d2_spec0's time per pass (every pass verifies K drafts, accepts none) <= --verify_target (1.15) x
           host_d2's time per step;
  speed:   host_d2_spec<M>'s tokens/s >= --speed_target (2.5) x host_d2's wherever M >= 3.5 accepted per pass;
  fail:    host_d2_spec's tokens/s >= --fail_target (0.97) x host_d2's (drafts that fail cost at most 3%);
  tokens:  every speculative arm generates host_d2's tokens (greedy; one tokens hash);
  self:    host_d2_self generates host_d2's tokens and states its draft cache's device bytes (the bench JSON's
           transport.speculate.draft); its accepted tokens per verify and tokens/s against host_d2's are reported
           (random weights: what they accept says little about a trained model's).

Prints the table of tokens/s against accepted tokens per pass, then the pass/fail table last; writes the summary and
the bench's JSON to --json_out ($OUT/check_speculate.json by default) and the plot to --plot_out. Run from the repo
root:

  python3 tools/check_speculate.py

The issue's 128k target: --context=131072 (its streamed windows come in chunks of kv.delivery_chunk_mib, jaxkv.chunked,
at the defaults). Through host attention: --plain=host_d2_ha.

A try of the plumbing on the CPU (the speed checks mean nothing there; head_dim 32, which int4 quantizes):
python3 tools/check_speculate.py --config=experiments/tiny.py --context=64 --new_tokens=24 --rounds=1
--bench_args="--cpu_devices=2 --config.model.head_dim=32"
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from absl import app
from absl import flags

import bench_child  # tools/bench_child.py, beside this script.

CONFIG = flags.DEFINE_string("config", "experiments/llama3_8b.py", "The bench's experiment config.")
CONTEXT = flags.DEFINE_integer("context", 32768, "Prompt tokens (a synthetic context but its last chunk).")
NEW_TOKENS = flags.DEFINE_integer("new_tokens", 64, "Tokens generated per run.")
ROUNDS = flags.DEFINE_integer("rounds", 2, "Timed runs per arm.")
K = flags.DEFINE_integer("k", 8, "Draft tokens per verify pass (speculate.k).")
RIGHTS = flags.DEFINE_list("rights", ["0", "1", "2", "3", "4", "6", "8"], "The oracle arms' right tokens.")
VERIFY_TARGET = flags.DEFINE_float("verify_target", 1.15, "A verify pass of k drafts over one step, at most.")
SPEED_TARGET = flags.DEFINE_float("speed_target", 2.5, "Speculative over host_d2 tokens/s at >= 3.5 accepted.")
FAIL_TARGET = flags.DEFINE_float("fail_target", 0.97, "The lookup drafter on random ids over host_d2, at least.")
TIMEOUT_S = flags.DEFINE_float("timeout_s", 570, "The bench process's time limit.")
PLAIN = flags.DEFINE_string("plain", "host_d2", "The plain arm (jaxkv.bench.arms), e.g. host_d2_ha: host attention.")
BENCH_ARGS = flags.DEFINE_string("bench_args", "", "More flags for the bench, e.g. '--cpu_devices=2' (a CPU try).")
JSON_OUT = flags.DEFINE_string("json_out", os.path.join(os.environ.get("OUT", "."), "check_speculate.json"), "")
PLOT_OUT = flags.DEFINE_string("plot_out", os.path.join(os.environ.get("OUT", "."), "check_speculate.png"), "")


def _plain() -> str:
  return PLAIN.value


def _lookup() -> str:
  return f"{PLAIN.value}_spec"


def _oracle(m: int) -> str:
  return f"{PLAIN.value}_spec{m}"


def _self() -> str:
  return f"{PLAIN.value}_self"


def _bench(arms: list[str], json_out: str) -> dict:
  """The bench process; its JSON, or {"error": why there is none}."""
  cmd = [
      sys.executable,
      "-m",
      "jaxkv.bench",
      "--cpu_devices=0",
      f"--config={CONFIG.value}",
      "--nopeer",
      "--synthetic_context",
      f"--contexts={CONTEXT.value}",
      "--batches=1",
      f"--arms={','.join(arms)}",
      f"--new_tokens={NEW_TOKENS.value}",
      f"--rounds={ROUNDS.value}",
      f"--config.speculate.k={K.value}",
      f"--json_out={json_out}",
      *BENCH_ARGS.value.split(),
  ]
  out, _, wall = bench_child.run(cmd, json_out, TIMEOUT_S.value)
  out.update(check_command=" ".join(cmd), check_wall_s=wall)
  return out


def curve(cell: dict, rights: list[int]) -> list[dict]:
  """Per oracle arm that ran: m, accepted and tokens per pass (measured), tokens/s and its ratio to host_d2's."""
  arms = cell["arms"]
  plain = arms[_plain()]["tok_s"]["median"] if arms.get(_plain(), {}).get("status") == "ok" else None
  rows = []
  for m in rights:
    rec = arms.get(_oracle(m), {})
    if rec.get("status") != "ok":
      continue
    s = rec["transport"]["speculate"]
    tok_s = rec["tok_s"]["median"]
    rows.append(
        dict(
            right=m,
            accepted_per_pass=s["tokens_per_pass"] - 1,
            tokens_per_pass=s["tokens_per_pass"],
            tok_s=tok_s,
            ms_per_pass=rec["ms_per_step"]["median"] * s["tokens_per_pass"],
            x_plain=tok_s / plain if plain else None,
        )
    )
  return rows


def checks(cell: dict, rows: list[dict]) -> list[dict]:
  """[{name, passed, detail}] for the bench cell and its curve."""
  arms = cell["arms"]
  ok = lambda name: arms.get(name, {}).get("status") == "ok"
  med = lambda name, key: arms[name][key]["median"]
  out = []
  if not ok(_plain()):
    return [dict(name=_plain(), passed=False, detail=f"not run: {arms.get(_plain(), {}).get('reason')}")]
  step_ms = med(_plain(), "ms_per_step")
  zero = next((r for r in rows if r["right"] == 0), None)
  out.append(
      dict(
          name=f"verify: a pass of {K.value} drafts <= {VERIFY_TARGET.value}x a step",
          passed=zero is not None and zero["ms_per_pass"] <= VERIFY_TARGET.value * step_ms,
          detail="not run"
          if zero is None
          else f"{zero['ms_per_pass']:.2f} / {step_ms:.2f} ms = {zero['ms_per_pass'] / step_ms:.3f}x",
      )
  )
  fast = [r for r in rows if r["accepted_per_pass"] >= 3.5]
  slow = [r for r in fast if r["x_plain"] < SPEED_TARGET.value]
  out.append(
      dict(
          name=f"speed: >= {SPEED_TARGET.value}x {_plain()} at >= 3.5 accepted per pass",
          passed=bool(fast) and not slow,
          detail=", ".join(f"{r['accepted_per_pass']:.2f} accepted: {r['x_plain']:.2f}x" for r in fast) or "none ran",
      )
  )
  if ok(_lookup()):
    s = arms[_lookup()]["transport"]["speculate"]
    ratio = med(_lookup(), "tok_s") / med(_plain(), "tok_s")
    out.append(
        dict(
            name=f"fail: {_lookup()} (random ids) >= {FAIL_TARGET.value}x {_plain()}",
            passed=ratio >= FAIL_TARGET.value,
            detail=f"{ratio:.3f}x; {s['verify_passes']} of {s['passes']} passes verified, "
            f"{s['accepted_per_verify']:.2f} accepted per verify, switched off {s['switched_off']} times",
        )
    )
  else:
    out.append(
        dict(name=f"fail: {_lookup()}", passed=False, detail=f"not run: {arms.get(_lookup(), {}).get('reason')}")
    )
  out.append(self_check(arms))
  spec = [n for n in arms if n.startswith(_lookup()) and ok(n)]
  want = {s["tokens_sha256"] for s in arms[_plain()]["samples"]}
  differ = [n for n in spec if {s["tokens_sha256"] for s in arms[n]["samples"]} != want]
  out.append(
      dict(
          name=f"tokens: every speculative arm gives {_plain()}'s",
          passed=len(want) == 1 and not differ and len(spec) == len(rows) + 1,
          detail=f"{len(spec)} arms ran; differ: {differ or 'none'}",
      )
  )
  return out


def self_check(arms: dict) -> dict:
  """The self-speculation arm's check (module docstring)."""
  rec = arms.get(_self(), {})
  name = f"self: {_self()} gives {_plain()}'s tokens, its draft cache's bytes stated"
  if rec.get("status") != "ok":
    return dict(name=name, passed=False, detail=f"not run: {rec.get('reason')}")
  s = rec["transport"]["speculate"]
  draft = s.get("draft") or {}
  same = {x["tokens_sha256"] for x in rec["samples"]} == {x["tokens_sha256"] for x in arms[_plain()]["samples"]}
  ratio = rec["tok_s"]["median"] / arms[_plain()]["tok_s"]["median"]
  return dict(
      name=name,
      passed=same and draft.get("bytes_per_device", 0) > 0,
      detail=f"tokens {'equal' if same else 'DIFFER'}; draft cache {draft.get('bytes_per_device', 0) / 2**20:.1f} "
      f"MiB per device ({draft.get('kv_dtype')}), filled in {draft.get('fill_s', 0):.2f} s, {draft.get('steps')} draft "
      f"steps; {s['accepted_per_verify']:.2f} accepted per verify, {s['tokens_per_pass']:.2f} tokens per pass, "
      f"{ratio:.2f}x {_plain()}'s tokens/s",
  )


def plot(rows: list[dict], plain_tok_s: float, path: str) -> str | None:
  """tokens/s against accepted tokens per pass, host_d2's as a line; None, or why there is no plot."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    return f"no plot: {e}"
  fig, ax = plt.subplots(figsize=(6, 4))
  ax.plot([r["accepted_per_pass"] for r in rows], [r["tok_s"] for r in rows], "o-", label=f"{_lookup()} (oracle)")
  ax.axhline(plain_tok_s, color="gray", ls="--", label=_plain())
  ax.set_xlabel("accepted tokens per pass")
  ax.set_ylabel("tokens/s")
  ax.set_title(f"speculative decoding, k = {K.value}, {CONTEXT.value} context, batch 1")
  ax.legend()
  fig.savefig(path, dpi=120, bbox_inches="tight")
  return None


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  rights = [int(m) for m in RIGHTS.value]
  arms = [_plain(), *map(_oracle, rights), _lookup(), _self()]
  with tempfile.TemporaryDirectory() as tmp:
    out = _bench(arms, os.path.join(tmp, "bench.json"))
  cell = out["cells"][0] if out.get("cells") else None
  rows = curve(cell, rights) if cell else []
  results = checks(cell, rows) if cell else [dict(name="bench", passed=False, detail="no cell")]
  plain = cell and cell["arms"].get(_plain(), {}).get("tok_s")
  no_plot = plot(rows, plain["median"], PLOT_OUT.value) if rows and plain else "no plot: nothing ran"
  os.makedirs(os.path.dirname(os.path.abspath(JSON_OUT.value)), exist_ok=True)
  with open(JSON_OUT.value, "w") as f:
    json.dump(dict(checks=results, curve=rows, plot=no_plot or PLOT_OUT.value, bench=out), f, indent=1)
  print(f"wrote {JSON_OUT.value}" + (f" and {PLOT_OUT.value}" if not no_plot else f" ({no_plot})"))
  if "error" in out:
    print(out["error"])
  print(
      f"\n| right drafts | accepted per pass | tokens/s | x {_plain()} | ms per pass |\n| --- | --- | --- | --- | --- |"
  )
  for r in rows:
    x = "n/a" if r["x_plain"] is None else f"{r['x_plain']:.2f}"
    print(f"| {r['right']} | {r['accepted_per_pass']:.2f} | {r['tok_s']:.2f} | {x} | {r['ms_per_pass']:.2f} |")
  print("\n| check | result | detail |\n| --- | --- | --- |")
  for r in results:
    print(f"| {r['name']} | {'PASS' if r['passed'] else 'FAIL'} | {r['detail']} |")
  sys.exit(0 if all(r["passed"] for r in results) else 1)


if __name__ == "__main__":
  app.run(main)
