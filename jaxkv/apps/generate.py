"""Generate: `python3 -m jaxkv.generate` (tiny random model, random prompt ids, 4 CPU devices).

With --checkpoint_dir the model and weights come from a Hugging Face checkpoint folder (jaxkv.checkpoint), with
--gguf from a GGUF file (jaxkv.gguf_loader), and --prompt (repeatable) gives text prompts that its tokenizer encodes
(in its chat template with --chat); the new tokens are printed decoded. A checkpoint brings its own settings: its
end-of-sequence ids stop a sequence (unless --ignore_eos), the simulated CPU devices adapt to its KV heads, and
without --config the engine's default sizes apply (not the tiny model's).
Without --prompt, prompts are random token ids of --prompt_len. Prints the tokens and the tokens/logits hashes;
--json_out writes them with the resolved config and the transport telemetry.

With --sequences=N, N random requests (prompt lengths up to the largest --prompt_len, max_new_tokens between
half and all of --max_new_tokens) are served on --parallel slots, a slot taking the next request when its
sequence ends (jaxkv.serving); results are printed in request order with the transcript hash.

In a multi-process run (--coordinator_address, --num_processes, --process_id) every process decodes; process 0
prints and writes.
"""

from __future__ import annotations

import time

from absl import app
from absl import flags

from jaxkv import config as config_lib
from jaxkv import distributed
from jaxkv import preflight
from jaxkv.apps import cli
from jaxkv.apps import launch
from jaxkv.host import startup

BATCH = flags.DEFINE_integer("batch", None, "Sequences; default = number of --prompt_len values.")
PROMPT_LEN = flags.DEFINE_list(
    "prompt_len", ["5", "12", "1", "9"], "Prompt lengths, one per sequence (or one for all of --batch)."
)
MAX_NEW = flags.DEFINE_integer("max_new_tokens", 16, "Tokens to generate per sequence.")
SEQUENCES = flags.DEFINE_integer("sequences", 0, "Serve this many random requests on --parallel slots (0 = off).")
PARALLEL = flags.DEFINE_integer("parallel", 8, "Slots for --sequences.")
PREFIX_CACHE_GIB = flags.DEFINE_float(
    "prefix_cache_gib",
    0.0,
    "Serving (--sequences, jaxkv.serve): host memory for the KV rows of prompt prefixes, reused by later prompts that "
    "start with them (jaxkv.serving.prefix_cache); 0 = off.",
    lower_bound=0.0,
)
SEED = flags.DEFINE_integer("seed", 0, "Seeds the weights, the prompt ids and sampling.", lower_bound=0)
JSON_OUT = flags.DEFINE_string("json_out", None, "Write tokens, hashes, config and telemetry here.")
CHECKPOINT_DIR = flags.DEFINE_string(
    "checkpoint_dir",
    None,
    "Hugging Face checkpoint folder (config.json, safetensors weights, tokenizer.json for --prompt): its model "
    "replaces --config's model section; --config still gives the kv, engine, sampling and mesh settings.",
)
GGUF = flags.DEFINE_string(
    "gguf",
    None,
    "A GGUF file (llama.cpp's format) of the llama or qwen3 architecture, instead of --checkpoint_dir: its model "
    "replaces --config's model section, its weights are dequantized to --checkpoint_dtype, and its metadata gives "
    "the tokenizer and chat template for --prompt (the gguf extra).",
)
PROMPT = flags.DEFINE_multi_string(
    "prompt",
    None,
    "Text prompt, one sequence each time the flag is given; needs --checkpoint_dir's tokenizer.json or --gguf.",
)
CHAT = flags.DEFINE_bool(
    "chat", False, "Apply the checkpoint's chat template to each --prompt (a user turn, then the assistant's)."
)
IGNORE_EOS = flags.DEFINE_bool(
    "ignore_eos",
    False,
    "With --checkpoint_dir or --gguf: run past the checkpoint's end-of-sequence ids (its eos_token_id and its chat "
    "template's end of turn), to --max_new_tokens; --config.sampling.eos_id still ends a sequence.",
)
CHECKPOINT_DTYPE = flags.DEFINE_enum(
    "checkpoint_dtype",
    None,
    ["bfloat16", "float16", "float32"],
    "With --checkpoint_dir or --gguf: weights, activations and KV dtype (default: config.json's torch_dtype, else "
    "bfloat16; for --gguf float32 on simulated CPU devices, bfloat16 on accelerators).",
)


HELP_GROUPS = {
    "model and config": [*cli.CONFIG_GROUP, CHECKPOINT_DIR, GGUF, CHECKPOINT_DTYPE],
    "prompts": [PROMPT_LEN, BATCH, PROMPT, CHAT, MAX_NEW, IGNORE_EOS, SEED, cli.SPECULATE_FLAG],
    "KV cache": cli.KV_GROUP,
    "split": cli.SPLIT_GROUP,
    "serving": [SEQUENCES, PARALLEL, PREFIX_CACHE_GIB],
    "multi-host": cli.MULTIHOST_GROUP,
    "output": [JSON_OUT],
}


def prompt_lengths(values, batch):
  try:
    lens = [int(v) for v in values]
  except ValueError as e:
    raise app.UsageError(f"--prompt_len must be comma-separated integers, got {values}") from e
  if any(n <= 0 for n in lens):
    raise app.UsageError(f"--prompt_len values must be positive, got {lens}")
  if batch is None:
    return lens
  if batch < 1:
    raise app.UsageError(f"--batch must be >= 1, got {batch}")
  if len(lens) == 1:
    return lens * batch
  if len(lens) != batch:
    raise app.UsageError(f"--batch={batch} but {len(lens)} --prompt_len values; give one or {batch}")
  return lens


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  texts = PROMPT.value or []
  checkpoint = CHECKPOINT_DIR.value or GGUF.value
  if CHECKPOINT_DIR.value and GGUF.value:
    raise app.UsageError("give --checkpoint_dir or --gguf, not both")
  if texts and not checkpoint:
    raise app.UsageError("--prompt needs --checkpoint_dir or --gguf (the model and its tokenizer)")
  if CHAT.value and not texts:
    raise app.UsageError("--chat applies the chat template to --prompt: give --prompt")
  if texts and BATCH.value not in (None, len(texts)):
    raise app.UsageError(f"--batch={BATCH.value} but {len(texts)} --prompt values")
  if CHECKPOINT_DTYPE.value and not checkpoint:
    raise app.UsageError("--checkpoint_dtype needs --checkpoint_dir or --gguf (else set --config.model.dtype)")
  if SEQUENCES.value and (checkpoint or BATCH.value is not None):
    raise app.UsageError("--sequences serves random requests: it does not take --checkpoint_dir, --gguf or --batch")
  if SEQUENCES.value < 0 or PARALLEL.value < 1:
    raise app.UsageError(f"--sequences must be >= 0 and --parallel >= 1, got {SEQUENCES.value}, {PARALLEL.value}")
  if IGNORE_EOS.value and not checkpoint:
    raise app.UsageError("--ignore_eos is for a checkpoint's end-of-sequence ids: give --checkpoint_dir or --gguf")
  lens = [] if texts else prompt_lengths(PROMPT_LEN.value, BATCH.value)
  launch.check_outputs(JSON_OUT)
  cd = cli.resolved_config_dict(checkpoint=bool(checkpoint))
  batch = PARALLEL.value if SEQUENCES.value else len(texts) or len(lens)
  with preflight.input_errors():
    kv = config_lib.KVConfig(**cd.kv.to_dict())
    need = startup.CacheNeed(kv, batch, cd.engine.capacity, cd.engine.prefill_chunk)
  cli.setup_platform(cli.model_of(cd, CHECKPOINT_DIR.value, GGUF.value, checkpoint_dtype()), [need])
  from jaxkv.apps import runs  # pylint: disable=g-import-not-at-top  (after the platform is set)

  # Each run checks its input (jaxkv.preflight) before it builds or reads any weights.
  t0 = time.perf_counter()
  if SEQUENCES.value:
    out = runs.serve_random(
        cd, SEQUENCES.value, PARALLEL.value, max(lens), MAX_NEW.value, SEED.value, prefix_cache_bytes()
    )
    out["wall_s"] = time.perf_counter() - t0
    if distributed.is_main():
      _report_served(out, JSON_OUT.value)
    return
  if checkpoint:
    out = runs.generate_checkpoint(
        cd,
        CHECKPOINT_DIR.value,
        prompts=texts,
        lengths=lens,
        max_new_tokens=MAX_NEW.value,
        seed=SEED.value,
        dtype=checkpoint_dtype(),
        gguf=GGUF.value,
        chat=CHAT.value,
        eos=not IGNORE_EOS.value,
    )
  else:
    out = runs.generate_random(cd, lens, MAX_NEW.value, SEED.value)
  out["wall_s"] = time.perf_counter() - t0
  if distributed.is_main():
    _report(out, JSON_OUT.value)


def _report_served(out: dict, json_out: str | None) -> None:
  for i, r in enumerate(out["requests"]):
    if r["error"]:
      print(f"request {i} (prompt {r['prompt_length']}, {r['max_new_tokens']} new tokens): rejected: {r['error']}")
    else:
      print(f"request {i} (prompt {r['prompt_length']}, slot {r['slot']}, epoch {r['epoch']}): {r['tokens']}")
  print(f"transcript_sha256 {out['transcript_sha256']}")
  print(served_summary(out["transport"], out["timing"]))
  print(_compilation_line(out["compilation"]))
  print(_memory_line(out["memory"]))
  launch.write_json(out, json_out)


def checkpoint_dtype() -> str | None:
  """--checkpoint_dtype; left out with --gguf on simulated CPU devices, float32 (XLA:CPU has no native bfloat16
  matmul: SmolLM2's GGUF decoded at 11.7 steps/s in float32 against 2.9 in bfloat16); else None, the loaders'
  default (config.json's torch_dtype, else bfloat16)."""
  if CHECKPOINT_DTYPE.value or not GGUF.value:
    return CHECKPOINT_DTYPE.value
  return "float32" if cli.CPU_DEVICES.value else None


def prefix_cache_bytes() -> int:
  """--prefix_cache_gib in bytes, checked against the pinned host pool (after the platform is set)."""
  from jaxkv import serving  # pylint: disable=g-import-not-at-top  (imports JAX)

  nbytes = int(PREFIX_CACHE_GIB.value * 2**30)
  try:
    serving.check_prefix_cache_budget(nbytes)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  return nbytes


def served_summary(transport: dict, timing: dict) -> str:
  """The last line of a serving run's report, from its ServeResult's transport and timing."""
  t = transport
  return (
      f"kv placement {t['placement']}, {_delivery(t)}, {timing['decode_steps']} decode steps, "
      f"{t['insertions']} slot reuses, {t['epochs']} epochs"
  ) + _prefix_cache_summary(t.get("prefix_cache"))


def _prefix_cache_summary(c: dict | None) -> str:
  if c is None:
    return ""
  return (
      f"; prefix cache: {c['hits']} hits of {c['lookups']} prompts, {c['hit_tokens']} tokens reused, "
      f"{c['bytes']} B held, {c['evictions']} blocks evicted"
  )


def _report(out: dict, json_out: str | None) -> None:
  for i, toks in enumerate(out["tokens"]):
    print(f"sequence {i} (prompt {out['prompt_lengths'][i]} tokens): {toks}")
    if "text" in out:
      print(f"  prompt: {out['prompts'][i]}")
      print(f"  output: {out['text'][i]}")
  print(f"tokens_sha256 {out['tokens_sha256']}")
  print(f"logits_sha256 {out['logits_sha256']}")
  t = out["transport"]
  print(
      f"kv placement {t['placement']}, {_delivery(t)}, h2d {t['h2d_bytes']} B, d2h {t['d2h_bytes']} B, "
      f"compiled shapes {t['compiled_shapes']}"
  )
  if "speculate" in t:
    s = t["speculate"]
    print(
        f"speculate: {s['passes']} passes ({s['verify_passes']} verified), {s['tokens_per_pass']:.2f} tokens per "
        f"pass, {s['accepted_per_verify']:.2f} accepted per verify of up to {s['k']}"
    )
    if "draft" in s:
      d = s["draft"]
      print(
          f"draft cache: {d['kv_dtype']} on the device, {d['bytes_per_device'] / 2**20:.1f} MiB per device, filled in "
          f"{d['fill_s']:.2f} s, {d['steps']} draft steps"
      )
  print(_compilation_line(out["compilation"]))
  print(_memory_line(out["memory"]))
  launch.write_json(out, json_out)


def _memory_line(m: dict) -> str:
  device = "" if m["device_peak_bytes"] is None else f"device {m['device_peak_bytes'] / 2**30:.1f} GiB, "
  return f"peak memory: {device}host RSS {m['host_peak_rss_bytes'] / 2**30:.1f} GiB"


def _compilation_line(c: dict) -> str:
  line = f"programs compiled {c['programs_compiled']}, from the cache {c['programs_from_cache']}"
  if "during_decode" in c:
    d = c["during_decode"]
    line += f" (in the decode: {d['programs_compiled']} compiled, {d['programs_from_cache']} from the cache)"
  return line + f"; cache {c['cache_dir'] or 'off'}"


def _delivery(transport: dict) -> str:
  """The pipeline depth, where a ring delivers streamed layers; else that nothing is streamed."""
  return f"depth {transport['depth']}" if transport["ring_slots"] else "nothing streamed"


def run() -> None:
  """The app: `python3 -m jaxkv.generate`."""
  cli.run(main, HELP_GROUPS, __doc__)


if __name__ == "__main__":
  run()
