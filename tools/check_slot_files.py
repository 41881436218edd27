"""Check (GPU): a saved slot restored into another server continues with the tokens and logits hash of a server that
never saved, on the accelerator's pinned host memory (jaxkv.serving.slot_files).

Llama-3-8B geometry with --layers layers and random weights (the tiny config with --cpu, on 4 simulated CPU
devices), prefix cache on, in each placement of --placements: one request served (a conversation of a few blocks,
its last block holding generated tokens), its slot saved (the prompt's blocks from the prefix cache, the last one
prefilled alone), written to a file, read back and restored into a fresh server, then the next turn (the
conversation and a new tail) served there and on a server with the prefix cache off. Passes when the restored
server's tokens and logits hash equal the cold server's, its prompt took every saved block from the prefix cache,
and the saved blocks' bits equal those a cold prefill of the next turn stores.

  python3 tools/check_slot_files.py --json_out=slots.json          # pass/fail table last
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile


def _args(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--json_out", required=True, help="Write the details here.")
  p.add_argument("--cpu", action="store_true", help="4 simulated CPU devices and the tiny config.")
  p.add_argument("--layers", type=int, default=2, help="Layers of the 8B geometry on the GPU.")
  p.add_argument("--placements", default="device,host", help="Comma-separated kv placements to check.")
  return p.parse_args(argv)


def check(cpu: bool, layers: int, placement: str) -> dict:
  import numpy as np  # pylint: disable=g-import-not-at-top  (after the platform is set)

  from experiments import llama3_8b, tiny  # pylint: disable=g-import-not-at-top
  from jaxkv import config as config_lib  # pylint: disable=g-import-not-at-top
  from jaxkv import engine as engine_lib  # pylint: disable=g-import-not-at-top
  from jaxkv import run as run_lib  # pylint: disable=g-import-not-at-top
  from jaxkv import serving  # pylint: disable=g-import-not-at-top
  from jaxkv.serving import slot_files  # pylint: disable=g-import-not-at-top

  cd = (tiny if cpu else llama3_8b).get_config().unlock()
  if not cpu:
    cd.model.num_layers = layers
  cd.engine.capacity, cd.engine.prefill_chunk, cd.kv.block = (128, 16, 8) if cpu else (4096, 512, 256)
  cd.kv.placement = placement
  config = config_lib.from_config_dict(cd)
  mesh, params, base = run_lib.build(config, 0)
  eng = engine_lib.Engine(config, mesh, params, base.layout)
  chunk, vocab = config.engine.prefill_chunk, config.model.vocab_size
  rng = np.random.default_rng(0)
  prompt = tuple(rng.integers(0, vocab, 2 * chunk + chunk // 4).tolist())  # 2 blocks cached at its prefill.
  new = chunk  # The third block holds generated tokens: Save prefills it.
  first = serving.Server(eng, 2, prefix_cache_bytes=2**30)
  tokens = first.serve([serving.Request(prompt, new)]).results[0].tokens
  conversation = prompt + tuple(tokens)
  saved = first.work(slot_files.Save(conversation))
  fp = slot_files.fingerprint(config)
  with tempfile.TemporaryDirectory() as folder:
    path = os.path.join(folder, "conversation.bin")
    written = slot_files.write(path, saved, fp)
    loaded, read = slot_files.read(path, fp, chunk)
  restored = serving.Server(eng, 2, prefix_cache_bytes=2**30)
  assert restored.work(slot_files.Restore(loaded, "conversation.bin")) == conversation
  turn = serving.Request(conversation + tuple(rng.integers(0, vocab, chunk // 2).tolist()), 8)
  hit = restored.serve([turn])
  cold_server = serving.Server(eng, 2, prefix_cache_bytes=2**30)
  cold = cold_server.serve([turn])
  off = serving.Server(eng, 2).serve([turn])
  blocks_equal = all(
      np.array_equal(np.asarray(mine).view(np.uint8), np.asarray(want).view(np.uint8))
      for i, key in enumerate(cold_server.prefix_cache.keys(conversation, len(saved.blocks)))
      for mine, want in zip(saved.blocks[i], cold_server.prefix_cache.entry(key).rows)
  )
  a, b, c = hit.results[0], cold.results[0], off.results[0]
  return dict(
      blocks=len(saved.blocks),
      bytes_written=written,
      bytes_read=read,
      hit_tokens=hit.transport["prefix_cache"]["hit_tokens"],
      tokens_equal=a.tokens == b.tokens == c.tokens,
      hash_equal=a.logits_sha256 == b.logits_sha256 == c.logits_sha256,
      blocks_equal=blocks_equal,
      passed=bool(
          a.tokens == b.tokens == c.tokens
          and a.logits_sha256 == b.logits_sha256 == c.logits_sha256
          and hit.transport["prefix_cache"]["hit_tokens"] == len(saved.blocks) * chunk
          and blocks_equal
      ),
  )


def main(argv) -> int:
  args = _args(argv)
  if args.cpu:
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
  results = {p: check(args.cpu, args.layers, p) for p in args.placements.split(",")}
  import jax  # pylint: disable=g-import-not-at-top

  with open(args.json_out, "w") as f:
    json.dump(dict(results=results, devices=[str(d) for d in jax.devices()], jax=jax.__version__), f, indent=1)
  print(f"{'placement':<12} {'blocks':>6} {'hit tokens':>10} {'tokens':>7} {'hash':>6} {'blocks':>7} result")
  for p, r in results.items():
    flags = ["same" if r[k] else "DIFF" for k in ("tokens_equal", "hash_equal", "blocks_equal")]
    print(
        f"{p:<12} {r['blocks']:>6} {r['hit_tokens']:>10} {flags[0]:>7} {flags[1]:>6} {flags[2]:>7} "
        f"{'pass' if r['passed'] else 'FAIL'}"
    )
  return 0 if all(r["passed"] for r in results.values()) else 1


if __name__ == "__main__":
  raise SystemExit(main(sys.argv[1:]))
