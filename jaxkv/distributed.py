"""Multi-process runs through JAX's own distributed runtime (`jax.distributed`): one process per host, SPMD.

Every process runs the same program; the mesh spans the devices of all processes. The cache is sharded by KV head
and moved between memory kinds with the same sharding, so each process keeps in its pinned host memory, and
delivers to its devices, only its own devices' heads: no KV crosses processes, only the layers' all-reduces do.
Tokens and logits come out replicated, and a process reads its local copy of them.

`move` and `put_host` are `jax.device_put` within one process. Over processes, device_put would compile a copy
program for a move between memory kinds, and would check with a collective that every process passes the same
host value; they do the same transfers process by process instead.
"""

from __future__ import annotations

import functools
import os
import re
import sys
import threading
from collections.abc import Sequence

import jax
import numpy as np

ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def settings(coordinator_address: str | None, num_processes: int | None, process_id: int | None, environ=None):
  """The `jax.distributed.initialize` arguments: each given value, else its ENV variable.

  Returns None when none is set (a single-process run). A value left None is for JAX to detect (Slurm, Open MPI).
  """
  environ = os.environ if environ is None else environ
  values = [coordinator_address, num_processes, process_id]
  for i, name in enumerate(ENV):
    if values[i] is None and environ.get(name):
      values[i] = environ[name] if i == 0 else _int(name, environ[name])
  if all(v is None for v in values):
    return None
  address, n, me = values
  if address is not None and not re.fullmatch(r"\[?[\w.:-]+\]?:\d{1,5}", address):
    raise ValueError(f"the coordinator address {address!r} is not host:port")
  if n is not None and n < 1:
    raise ValueError(f"the number of processes must be >= 1, got {n}")
  if me is not None and not 0 <= me < (n if n is not None else me + 1):
    raise ValueError(f"the process id must be in [0, {n}), got {me}")
  return dict(coordinator_address=address, num_processes=n, process_id=me)


def _int(name: str, value: str) -> int:
  try:
    return int(value)
  except ValueError as e:
    raise ValueError(f"{name} must be an integer, got {value!r}") from e


def initialize(args: dict, cpu: bool, timeout_s: int = 60) -> None:
  """Joins the processes given by `settings(...)`; must run before any other JAX call.

  cpu: the CPU backend is forced; its cross-process collectives then run over gloo (TCP).
  timeout_s: when the processes have not all joined by then, prints which did not (as far as this process can
  tell) and the coordinator's address, and ends the process with status 1. JAX's own timeout
  (`initialization_timeout`) aborts the process with a C++ stack trace, so it is set later than this one.
  """
  if cpu:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  watchdog = threading.Timer(timeout_s, _not_joined, (args, timeout_s))
  watchdog.daemon = True
  watchdog.start()
  try:
    jax.distributed.initialize(**args, initialization_timeout=timeout_s + 60)
  finally:
    watchdog.cancel()


def _not_joined(args: dict, timeout_s: int) -> None:
  n, me, address = args["num_processes"], args["process_id"], args["coordinator_address"]
  if not me:  # Process 0 (or an id left for JAX to detect).
    others = {None: "the other processes", 2: "process 1"}.get(n, f"processes 1..{n - 1} (one or more of them)")
    what = f"{others} did not join the coordinator at {address} within {timeout_s} s"
    hint = f"start every process with --coordinator_address={address} --num_processes={n} and its --process_id"
  else:
    what = f"process {me} could not join process 0's coordinator at {address} within {timeout_s} s"
    hint = f"start process 0 there (--process_id=0), or check the address; --num_processes={n} in every process"
  print(f"error: jax.distributed: {what}\n  hint: {hint}; --distributed_timeout_s waits longer", file=sys.stderr)
  sys.stderr.flush()
  os._exit(1)  # The main thread is blocked in JAX's C++ connect.


def move(x: jax.Array, sharding: jax.sharding.Sharding) -> jax.Array:
  """x copied into `sharding`, which differs from x's sharding only in its memory kind: each process copies the
  shards on its own devices, eagerly."""
  return move_many([x], [sharding])[0]


def move_many(xs: Sequence[jax.Array], shardings: Sequence[jax.sharding.Sharding]) -> list[jax.Array]:
  """move() of several arrays, issued as one `jax.device_put` of their list (one call into the runtime)."""
  if all(x.is_fully_addressable for x in xs):
    return jax.device_put(list(xs), list(shardings))
  shards = [x.addressable_shards for x in xs]
  moved = jax.device_put(
      [s.data for ss in shards for s in ss],
      [_single(s.device, sh.memory_kind) for ss, sh in zip(shards, shardings) for s in ss],
  )
  out, i = [], 0
  for x, sh, ss in zip(xs, shardings, shards):
    out.append(jax.make_array_from_single_device_arrays(x.shape, sh, moved[i : i + len(ss)]))
    i += len(ss)
  return out


@functools.lru_cache(maxsize=None)
def _single(device: jax.Device, memory_kind: str | None) -> jax.sharding.SingleDeviceSharding:
  return jax.sharding.SingleDeviceSharding(device, memory_kind=memory_kind)


def put_host(x: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
  """Host data that every process holds whole (the same value), placed in `sharding`: each process places the
  parts its devices hold."""
  if sharding.is_fully_addressable:
    return jax.device_put(x, sharding)
  return jax.make_array_from_callback(np.shape(x), sharding, lambda index: x[index])


def is_main() -> bool:
  """True in the process that prints and writes the outputs (process 0)."""
  return jax.process_index() == 0


def device_stat(mesh: jax.sharding.Mesh, stat: str = "peak_bytes_in_use") -> int | None:
  """Largest memory_stats()[stat] of this process's devices of the mesh, or None where there are no stats (CPU)."""
  values = [(d.memory_stats() or {}).get(stat) for d in mesh.local_devices]
  return None if None in values else max(values)


def process_bytes(arrays) -> int:
  """Bytes of the shards of `arrays` (jax.Arrays or None) that this process holds."""
  return sum(s.data.nbytes for a in arrays if a is not None for s in a.addressable_shards)
