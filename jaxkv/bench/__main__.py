"""Decode benchmark: `python3 -m jaxkv.bench` (tiny model, 4 simulated CPU devices by default).

Times tokens/s and ms/step per arm ("device", "host_d<depth>", either with an optional KV dtype suffix such as
"host_d2_int8", and the Hugging Face offloaded-cache peer)
over contexts and batches in alternating rounds, with the link and transfer ceilings measured in the same run;
see jaxkv/bench/benchmark.py. Over several processes (--coordinator_address, --num_processes, --process_id) every
process runs the same arms and process 0 writes the outputs. --sweep picks the contexts, arms, new tokens and rounds
that are not given: "cpu" (the default) a run of a few minutes on the CPU, "gpu" the long-context sweep, e.g.:

  python3 -m jaxkv.bench --cpu_devices=0 --sweep=gpu --config=experiments/llama3_8b.py --batches=1,4 \
      --json_out=bench.json --md_out=bench.md --plot_out=bench.png

--synthetic_context stores each prompt's rows below its last prefill chunk as zeros instead of prefilling them:
the decode steps do the same work, and a long context of a large model costs one chunk of prefill per sample.
"""

from __future__ import annotations

import shlex
import sys

from absl import app
from absl import flags

from jaxkv import distributed
from jaxkv.apps import cli
from jaxkv.apps import launch

# --sweep's values of the flags left unset: (contexts, arms, new_tokens, rounds).
SWEEPS = {
    "cpu": (("256", "1024"), ("device", "host_d0", "host_d2"), 16, 2),
    "gpu": (("4096", "16384", "32768"), ("device", "host_d0", "host_d1", "host_d2", "host_d4"), 128, 3),
}
SWEEP = flags.DEFINE_enum(
    "sweep",
    "cpu",
    list(SWEEPS),
    "Defaults of --contexts, --arms, --new_tokens and --rounds: "
    + "; ".join(f"{k}: {','.join(c)}, {','.join(a)}, {n}, {r}" for k, (c, a, n, r) in SWEEPS.items())
    + " (cpu: a few minutes on the CPU with the tiny model).",
)
CONTEXTS = flags.DEFINE_list(
    "contexts", None, "Prompt tokens per sequence (the decode starts at this context); default from --sweep."
)
BATCHES = flags.DEFINE_list("batches", ["1"], "Sequences per generate.")
ARMS = flags.DEFINE_list(
    "arms",
    None,
    "KV arms: 'device', 'host_d<depth>' (host_d0 = ordered) or 'auto_d<depth>' (residency planner), optionally "
    "with a KV dtype suffix: '_bfloat16', '_float32', '_int8', '_int4', '_float8_e4m3fn' (e.g. host_d2_int4; none = "
    "config "
    "kv.dtype), then for host and auto arms '_ha' (host attention, share measured) or '_ha<NN>' (share NN/100), "
    "then '_g<N>': at most N layers per decode call (kv.group_layers; device_g1 = one call per layer); default "
    "from --sweep.",
)
NEW_TOKENS = flags.DEFINE_integer("new_tokens", None, "Tokens generated per sequence per sample; default from --sweep.")
ROUNDS = flags.DEFINE_integer(
    "rounds", None, "Timed samples per arm; arm order alternates between rounds; default from --sweep."
)
PEER = flags.DEFINE_bool(
    "peer",
    True,
    "Add the Hugging Face offloaded-cache arm (needs torch, transformers and "
    "a CUDA device beside a JAX GPU run; else reported skipped).",
)
SYNTHETIC_CONTEXT = flags.DEFINE_bool(
    "synthetic_context",
    False,
    "Store each prompt's rows below its last prefill chunk as zeros instead of prefilling them through the model "
    "(jaxkv arms; the peer prefills in full): the same decode work for a fraction of the prefill time; the tokens "
    "differ from a full prefill's.",
)
CEILINGS = flags.DEFINE_bool(
    "ceilings",
    True,
    "Measure each cell's link and transfer-only ceilings (each fills a whole host cache, which at 1M tokens may not "
    "fit the host: --noceilings).",
)
PEAK_MIB = flags.DEFINE_integer(
    "peak_mib", 0, "Per-device size of the link peak transfer, MiB; 0 = the largest decode step's KV, 1 MiB to 1 GiB."
)
SEED = flags.DEFINE_integer("seed", 0, "Seeds the weights and the prompt ids.", lower_bound=0)
JSON_OUT = flags.DEFINE_string("json_out", None, "Write every raw sample, the ceilings and the stats here.")
MD_OUT = flags.DEFINE_string("md_out", None, "Write the markdown report here.")
PLOT_OUT = flags.DEFINE_string("plot_out", None, "Write a PNG of tokens/s against context here (matplotlib).")


HELP_GROUPS = {
    "model and config": cli.CONFIG_GROUP,
    "bench": [SWEEP, CONTEXTS, BATCHES, ARMS, NEW_TOKENS, ROUNDS, PEER, SYNTHETIC_CONTEXT, CEILINGS, PEAK_MIB, SEED],
    "speculative decoding": [cli.SPECULATE_FLAG],
    "KV cache": cli.KV_GROUP,
    "split": cli.SPLIT_GROUP,
    "multi-host": cli.MULTIHOST_GROUP,
    "output": [JSON_OUT, MD_OUT, PLOT_OUT],
}


def _ints(name: str, values) -> tuple[int, ...]:
  try:
    return tuple(int(v) for v in values)
  except ValueError as e:
    raise app.UsageError(f"--{name} must be comma-separated integers, got {values}") from e


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  contexts, arms, new_tokens, rounds = SWEEPS[SWEEP.value]
  launch.check_outputs(JSON_OUT, MD_OUT, PLOT_OUT)
  # pylint: disable=g-import-not-at-top  (no JAX call before setup_platform)
  from jaxkv import preflight
  from jaxkv.bench import arms as arms_lib
  from jaxkv.bench import benchmark
  from jaxkv.bench import report
  from jaxkv.host import startup

  with preflight.input_errors():
    spec = benchmark.BenchSpec(
        contexts=_ints("contexts", CONTEXTS.value or contexts),
        batches=_ints("batches", BATCHES.value),
        arms=tuple(ARMS.value or arms),
        new_tokens=new_tokens if NEW_TOKENS.value is None else NEW_TOKENS.value,
        rounds=rounds if ROUNDS.value is None else ROUNDS.value,
        peer=PEER.value,
        seed=SEED.value,
        peak_bytes=PEAK_MIB.value * 2**20,
        synthetic_context=SYNTHETIC_CONTEXT.value,
        ceilings=CEILINGS.value,
    )
    config = cli.resolved_config()
    for arm in spec.arms:  # An unknown arm, or a KV dtype that does not fit the model.
      arms_lib.arm_config(config, arm)
  needs = [
      startup.CacheNeed(arms_lib.arm_config(config, arm).kv, batch, cap.engine.capacity, cap.engine.prefill_chunk)
      for arm in spec.arms
      for batch in spec.batches
      for cap in [benchmark.cell_config(config, context, spec.new_tokens) for context in spec.contexts]
  ]
  cli.setup_platform(config.model, needs)
  main_process = distributed.is_main()  # Every process runs the arms; process 0 writes and prints.
  out = benchmark.run(
      config,
      spec,
      command=shlex.join(sys.argv),
      json_out=JSON_OUT.value if main_process else None,
      md_out=MD_OUT.value if main_process else None,
      plot_out=PLOT_OUT.value if main_process else None,
  )
  if main_process:
    print(report.markdown(out))


if __name__ == "__main__":
  cli.run(main, HELP_GROUPS, __doc__)
