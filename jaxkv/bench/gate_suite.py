"""The exactness and memory gates: every delivery arm must decode a fixed set of tasks to the same bits.

A task is one prompt (a length; ids drawn from the seed) decoded greedily for `new_tokens`. Its hash is the
sha256 of the tokens hash and the logits hash of its generate; the exactness gate passes when every arm gives
every task the same hash. The memory gate passes when, in every arm and task, the ring's high-water bytes per device
stay within the ring that the task's windows need: its slots (depth + 2) times the largest window the task delivers
(the configured ring, sized for windows at full capacity, is far larger for short windows and is reported beside it,
with the process's device memory peak where the backend reports one: GPU).

The parallel gate serves `sequences` requests (prompt lengths and max_new_tokens drawn from the seed) on
`parallel` slots with slot reuse (jaxkv.serving) and passes when every arm gives the same transcript hash.

With `python -m jaxkv.gates --separate_processes` each arm runs in a process of its own (`child_args` are the flags
it passes on) and `merge` compares their reports as `run` compares arms: the bits must not depend on the process
either.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import jax
import numpy as np

from jaxkv import cache as cache_lib
from jaxkv import distributed
from jaxkv import mesh as mesh_lib
from jaxkv import run as run_lib
from jaxkv import serving
from jaxkv.bench import arms as arms_lib
from jaxkv.bench import benchmark
from jaxkv.config import Config, SamplingConfig
from jaxkv.engine import Engine

# Host arms of one call per layer (_g1) and of groups of 2 (_g2) keep the pipeline deep on a small model, whose layers
# would otherwise form one group (depth capped at 0).
ARMS = ("device", "host_d0", "host_d1_g1", "host_d2_g2", "host_d4_g1")


def task_lengths(config: Config, new_tokens: int) -> list[int]:
  """At least 8 prompt lengths: 1, the block boundaries, past a prefill chunk, and the longest that fits."""
  block, chunk, cap = config.kv.block, config.engine.prefill_chunk, config.engine.capacity
  near_capacity = cap - new_tokens + 1
  lengths = [1, block - 1, block, block + 1, 2 * block + 3, chunk + 1, near_capacity - 1, near_capacity]
  bad = [n for n in lengths if not 1 <= n <= near_capacity]
  if bad or len(set(lengths)) < 8:
    raise ValueError(
        f"engine.capacity {cap} is too small for the gate tasks with kv.block {block}, prefill_chunk {chunk} "
        f"and {new_tokens} new tokens (lengths {lengths}); raise engine.capacity"
    )
  return lengths


def parallel_requests(config: Config, sequences: int, new_tokens: int, seed: int) -> list[serving.Request]:
  """Requests of the parallel gate: prompt lengths in [1, capacity / 4], max_new_tokens in [2, new_tokens]."""
  rng = np.random.default_rng(seed + 1)
  top = max(config.engine.capacity // 4, 1)
  lengths = rng.integers(1, top + 1, size=sequences).tolist()
  news = rng.integers(2, max(new_tokens, 2) + 1, size=sequences).tolist()
  prompts = run_lib.random_prompts(config.model.vocab_size, lengths, seed)
  return [serving.Request(tuple(p), n, seed=i) for i, (p, n) in enumerate(zip(prompts, news))]


def window_rows(config: Config, prompt_length: int, new_tokens: int) -> int:
  """Rows of the largest window that a task of one prompt delivers: the last decode step's (full blocks below the row
  it writes), or with no decode step the last prefill chunk's."""
  prefill = (prompt_length - 1) // config.engine.prefill_chunk * config.engine.prefill_chunk
  return max([prefill, *benchmark.decode_window_rows(prompt_length, new_tokens - 1, config.kv.block)])


def row_bytes_per_device(config: Config, mesh) -> int:
  """Bytes of one cache row of one sequence on each device of layer 0's stage (its share of the KV heads)."""
  first = run_lib.make_layout(config, mesh).first
  return cache_lib.row_bytes(config.model, config.kv.dtype, 1, mesh_lib.tensor_size(first))


def _task_hash(res) -> str:
  return hashlib.sha256(f"{res.tokens_sha256}:{res.logits_sha256}".encode()).hexdigest()


def run(
    config: Config,
    mesh,
    params,
    arms=ARMS,
    new_tokens: int = 12,
    seed: int = 0,
    parallel: int = 8,
    sequences: int = 16,
) -> dict:
  """Runs the gates; returns a JSON-ready report with `passed` (exactness, parallel and memory gates passed)."""
  config = dataclasses.replace(config, sampling=SamplingConfig(eos_id=config.sampling.eos_id))  # Greedy.
  lengths = task_lengths(config, new_tokens)
  prompts = run_lib.random_prompts(config.model.vocab_size, lengths, seed)
  hashes: dict[str, list[str]] = {}
  memory: dict[str, dict] = {}
  requests = parallel_requests(config, sequences, new_tokens, seed)
  transcripts: dict[str, str] = {}
  for arm in arms:
    engine = Engine(arms_lib.arm_config(config, arm), mesh, params, run_lib.make_layout(config, mesh))
    results = [engine.generate([p], new_tokens, seed=seed) for p in prompts]
    hashes[arm] = [_task_hash(r) for r in results]
    served = serving.Server(engine, parallel).serve(requests)
    transcripts[arm] = served.transcript_sha256
    high = [r.transport["ring_high_water_bytes_per_device"] for r in results]
    row = row_bytes_per_device(engine.config, mesh)
    needed = [
        r.transport["ring_slots"] * r.transport["ring_slot_layers"] * window_rows(config, n, new_tokens) * row
        for r, n in zip(results, lengths)
    ]
    configured = results[0].transport["ring_bytes_per_device_configured"]
    memory[arm] = dict(
        ring_high_water_bytes_per_device=max(high),
        ring_bytes_per_device_needed=max(needed),
        ring_bytes_per_device_configured=configured,
        device_peak_bytes_in_use_process=distributed.device_stat(mesh),
        over_needed_prompt_lengths=[n for n, h, w in zip(lengths, high, needed) if h > w],  # Tasks that fail.
    )
    memory[arm]["passed"] = not memory[arm]["over_needed_prompt_lengths"] and max(high) <= configured
  tasks = [
      dict(prompt_length=n, hashes={arm: hashes[arm][i] for arm in arms}, passed=len({hashes[a][i] for a in arms}) == 1)
      for i, n in enumerate(lengths)
  ]
  exact = all(t["passed"] for t in tasks)
  mem = all(m["passed"] for m in memory.values())
  par = len(set(transcripts.values())) == 1
  return dict(
      arms=list(arms),
      new_tokens=new_tokens,
      devices=[str(d) for d in jax.devices()][: mesh.devices.size],
      exactness=dict(passed=exact, tasks=tasks),
      memory=dict(passed=mem, arms=memory),
      parallel=dict(
          passed=par,
          parallel=parallel,
          sequences=sequences,
          prompt_lengths=[len(r.prompt) for r in requests],
          max_new_tokens=[r.max_new_tokens for r in requests],
          insertions=served.transport.get("insertions", 0),  # Absent: no slot was reused.
          epochs=served.transport["epochs"],
          transcripts=transcripts,
      ),
      passed=exact and mem and par,
  )


def merge(reports: dict[str, dict]) -> dict:
  """One report from per-arm reports of separate processes ({arm: run(..., arms=(arm,))}), the gates applied across
  them: a task's hash, and the transcript, must be the same in every process."""
  arms = list(reports)
  first = reports[arms[0]]
  tasks = []
  for i, t in enumerate(first["exactness"]["tasks"]):
    hashes = {arm: reports[arm]["exactness"]["tasks"][i]["hashes"][arm] for arm in arms}
    tasks.append(dict(prompt_length=t["prompt_length"], hashes=hashes, passed=len(set(hashes.values())) == 1))
  memory = {arm: reports[arm]["memory"]["arms"][arm] for arm in arms}
  transcripts = {arm: reports[arm]["parallel"]["transcripts"][arm] for arm in arms}
  exact = all(t["passed"] for t in tasks)
  mem = all(m["passed"] for m in memory.values())
  par = len(set(transcripts.values())) == 1
  return dict(
      {k: v for k, v in first.items() if k not in ("compilation", "wall_s")},
      arms=arms,
      separate_processes=True,
      processes={arm: dict(compilation=r.get("compilation"), wall_s=r.get("wall_s")) for arm, r in reports.items()},
      exactness=dict(passed=exact, tasks=tasks),
      memory=dict(passed=mem, arms=memory),
      parallel=dict(first["parallel"], passed=par, transcripts=transcripts),
      passed=exact and mem and par,
  )


def child_args(argv: Sequence[str]) -> list[str]:
  """The gates' command-line flags to pass on to a per-arm process: all but --separate_processes, --arms and
  --json_out (in their `--f=v` and `--f v` forms)."""
  drop = ("arms", "json_out")
  out, skip = [], False
  for a in argv:
    if skip:
      skip = False
      continue
    name = a.lstrip("-").split("=", 1)[0]
    if name in ("separate_processes", "noseparate_processes"):
      continue
    if name in drop:
      skip = "=" not in a
      continue
    out.append(a)
  return out
