"""Generate from random prompt token ids: `python -m jaxkv.generate` (tiny model, 4 CPU devices).

Prints the tokens and the tokens/logits hashes; --json_out writes them with the resolved config and the
transport telemetry.
"""

from __future__ import annotations

import json
import time

from absl import app
from absl import flags
from absl import logging

from jaxkv import cli

BATCH = flags.DEFINE_integer("batch", None, "Sequences; default = number of --prompt_len values.")
PROMPT_LEN = flags.DEFINE_list(
    "prompt_len", ["5", "12", "1", "9"], "Prompt lengths, one per sequence (or one for all of --batch)."
)
MAX_NEW = flags.DEFINE_integer("max_new_tokens", 16, "Tokens to generate per sequence.")
SEED = flags.DEFINE_integer("seed", 0, "Seeds the weights, the prompt ids and sampling.")
JSON_OUT = flags.DEFINE_string("json_out", None, "Write tokens, hashes, config and telemetry here.")


def prompt_lengths(values, batch):
  try:
    lens = [int(v) for v in values]
  except ValueError as e:
    raise app.UsageError(f"--prompt_len must be comma-separated integers, got {values}") from e
  if any(n <= 0 for n in lens):
    raise app.UsageError(f"--prompt_len values must be positive, got {lens}")
  if batch is None:
    return lens
  if len(lens) == 1:
    return lens * batch
  if len(lens) != batch:
    raise app.UsageError(f"--batch={batch} but {len(lens)} --prompt_len values; give one or {batch}")
  return lens


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  cli.setup_platform()
  from jaxkv import run  # pylint: disable=g-import-not-at-top  (after the platform is set)

  cd = cli.resolved_config_dict()
  lens = prompt_lengths(PROMPT_LEN.value, BATCH.value)
  t0 = time.perf_counter()
  out = run.generate_random(cd, lens, MAX_NEW.value, SEED.value)
  out["wall_s"] = time.perf_counter() - t0
  for i, toks in enumerate(out["tokens"]):
    print(f"sequence {i} (prompt {lens[i]} tokens): {toks}")
  print(f"tokens_sha256 {out['tokens_sha256']}")
  print(f"logits_sha256 {out['logits_sha256']}")
  t = out["transport"]
  print(
      f"kv placement {t['placement']}, depth {t['depth']}, h2d {t['h2d_bytes']} B, d2h {t['d2h_bytes']} B, "
      f"compiled shapes {t['compiled_shapes']}"
  )
  if JSON_OUT.value:
    with open(JSON_OUT.value, "w") as f:
      json.dump(out, f, indent=1)
    logging.info("wrote %s", JSON_OUT.value)


if __name__ == "__main__":
  app.run(main)
