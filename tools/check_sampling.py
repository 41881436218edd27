"""Check (GPU): per-row sampling and shaping (jaxkv.sampling, issue 51) on the accelerator, and what they cost.

  boundary  logits log([0.5, 0.25, 0.25]): top_p 0.5 draws only token 0 and min_p 0.5 all three, over --draws
            token indices in one jitted call with the settings as traced arguments.
  shaping   shape() of --batch rows of --vocab random logits (presence, frequency and repetition penalties, a
            logit bias, held ids, and a row without any) against the rules written out in numpy: the row without
            shaping bit for bit, the others within 1e-5 (a division's rounding); greedy tokens of unshaped
            rows equal argmax bit for bit.
  logprobs  jaxkv.sampling.logprobs of device logits against a float64 log-softmax, within 1e-5.
  cost      median ms of one head's sampling part (shape, sample, count) at --batch x --vocab: greedy without
            shaping (the common case) against plain argmax, and with every row shaped but one.
Prints a pass/fail table and the ms table last; writes everything to --json_out. From the repository root:

  python3 tools/check_sampling.py --json_out=check_sampling.json
"""

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app
from absl import flags

from jaxkv import reference
from jaxkv import sampling
from jaxkv.config import SamplingConfig

VOCAB = flags.DEFINE_integer("vocab", 128256, "Vocabulary (Llama-3's by default).")
BATCH = flags.DEFINE_integer("batch", 8, "Rows.")
DRAWS = flags.DEFINE_integer("draws", 4096, "boundary: token indices drawn.")
REPEATS = flags.DEFINE_integer("repeats", 50, "cost: timed calls per variant.")
JSON_OUT = flags.DEFINE_string("json_out", None, "Where the details go (JSON).")


def boundary() -> dict:
  logits = np.log(np.array([[0.5, 0.25, 0.25]] * 2)).astype(np.float32)
  out = {}
  for name, cfg, want in (
      ("top_p", SamplingConfig(temperature=1.0, top_p=0.5), [0]),
      ("min_p", SamplingConfig(temperature=1.0, min_p=0.5), [0, 1, 2]),
  ):
    params = sampling.SamplingParams.rows([cfg] * 2, [5, 6], [0, 1])
    draw = jax.jit(jax.vmap(lambda i, p: sampling.sample(logits, p, jnp.full(2, i, jnp.int32)), in_axes=(0, None)))
    got = sorted(set(np.asarray(draw(jnp.arange(DRAWS.value), params)).ravel().tolist()))
    out[name] = dict(drawn=got, want=want, ok=got == want)
  return out


def _setup(shaped: bool):
  b, v = BATCH.value, VOCAB.value
  rng = np.random.default_rng(0)
  logits = (rng.standard_normal((b, v)) * 3).astype(np.float32)
  counts = (rng.integers(0, 3, (b, v)) * (rng.random((b, v)) < 0.01)).astype(np.int32)
  prompt = rng.random((b, v)) < 0.01
  cfgs = [SamplingConfig(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)] * b
  rules = [sampling.Rules({i: 2.0 for i in range(0, min(3000, v), 10)}, min_tokens=4, held=(1, 2, 3))] * b
  if not shaped:
    cfgs, rules = [SamplingConfig()] * b, [None] * b
  else:
    cfgs[0], rules[0] = SamplingConfig(), None  # One row without shaping among shaped ones.
  params = sampling.SamplingParams.rows(cfgs, list(range(b)), [0] * b, rules)
  return logits, counts, prompt, cfgs, rules, params


def shaping() -> dict:
  logits, counts, prompt, cfgs, rules, params = _setup(shaped=True)
  index = np.zeros(BATCH.value, np.int32)
  got = np.asarray(jax.jit(sampling.shape)(logits, params, counts, prompt, index))
  rows = []
  for b in range(BATCH.value):
    want = reference.shaped_logits(logits[b], counts[b], prompt[b], cfgs[b], rules[b] or sampling.Rules(), 0)
    finite = np.isfinite(want)
    err = float(np.max(np.abs(got[b][finite] - want[finite])))
    rows.append(
        dict(
            row=b,
            max_abs_err=err,
            inf_equal=bool((np.isinf(got[b]) == ~finite).all()),
            exact=bool((got[b] == want).all()),
        )
    )
  plain = sampling.SamplingParams.rows([SamplingConfig()] * BATCH.value, [0] * BATCH.value, [0] * BATCH.value)
  greedy = np.asarray(
      jax.jit(lambda lg, p: sampling.sample(sampling.shape(lg, p, counts, prompt, index), p, index))(logits, plain)
  )
  ok = rows[0]["exact"] and all(r["max_abs_err"] <= 1e-5 and r["inf_equal"] for r in rows)
  return dict(rows=rows, greedy_is_argmax=bool((greedy == logits.argmax(-1)).all()), ok=ok)


def logprobs() -> dict:
  logits = np.asarray(jax.device_get(jax.random.normal(jax.random.key(3), (VOCAB.value,)) * 4))
  x = logits.astype(np.float64)
  want = x - x.max() - np.log(np.exp(x - x.max()).sum())
  lp, top = sampling.logprobs(logits, 7, 20)
  err = max(abs(lp - want[7]), max(abs(l - want[i]) for i, l in top))
  return dict(max_abs_err=float(err), top_ids_ok=[i for i, _ in top] == np.argsort(-want, kind="stable")[:20].tolist())


def cost() -> dict:
  out = {}
  index = jnp.zeros(BATCH.value, jnp.int32)
  head = jax.jit(
      lambda lg, p, c, pr: (
          sampling.sample(sampling.shape(lg, p, c, pr, index), p, index),
          sampling.count(c, jnp.zeros(BATCH.value, jnp.int32)),
      )
  )
  argmax = jax.jit(lambda lg: jnp.argmax(lg, -1))
  for name, shaped in (("argmax", None), ("greedy_unshaped", False), ("all_shaped", True)):
    logits, counts, prompt, _, _, params = _setup(bool(shaped))
    args = jax.device_put((logits,) if shaped is None else (logits, params, counts, prompt))
    fn = argmax if shaped is None else head
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(REPEATS.value):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times.append(1e3 * (time.perf_counter() - t0))
    out[name] = float(np.median(times))
  return out


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  results = dict(device=str(jax.devices()[0]), jax=jax.__version__, boundary=boundary(), shaping=shaping())
  results["logprobs"] = logprobs()
  results["cost_ms"] = cost()
  if JSON_OUT.value:
    with open(JSON_OUT.value, "w") as f:
      json.dump(results, f, indent=1)
  checks = [
      ("boundary top_p 0.5 draws only token 0", results["boundary"]["top_p"]["ok"]),
      ("boundary min_p 0.5 keeps all three", results["boundary"]["min_p"]["ok"]),
      ("shaping equals the rules (unshaped row exact)", results["shaping"]["ok"]),
      ("unshaped greedy equals argmax", results["shaping"]["greedy_is_argmax"]),
      (
          "logprobs within 1e-5 of float64",
          results["logprobs"]["max_abs_err"] <= 1e-5 and results["logprobs"]["top_ids_ok"],
      ),
  ]
  print(f"{'ms (median)':<40} " + "  ".join(f"{k} {v:.3f}" for k, v in results["cost_ms"].items()))
  for name, ok in checks:
    print(f"{'PASS' if ok else 'FAIL':<6}{name}")


if __name__ == "__main__":
  app.run(main)
