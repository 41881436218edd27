"""The persistent compilation cache, which makes separate processes compute the same bits, and its counters.

On the GPU, XLA autotunes some kernels (GEMM fusions, the emitter of reductions and transposes) by timing candidates
when it compiles a program, so two processes can compile the same program into kernels that sum in another order
and give other logits. With the JAX persistent compilation cache on, a process loads the executables that the first
process compiled, and JAX also points XLA's per-fusion autotuning cache (`xla_gpu_per_fusion_autotune_cache_dir`)
into the same folder (`jax_persistent_cache_enable_xla_caches`), so programs compiled afresh in a later process
(another window shape) reuse the first process's autotuning choices. Both are keyed by the program and the device;
the folder is keyed here by the jax and jaxlib versions, so an upgrade starts afresh. docs/design.md ("Determinism
across processes") says when bits can still differ.

Without a shared cache the kernels themselves can be chosen without timing, by one setting read before the GPU
backend starts: $JAXKV_GPU_KERNELS (`KERNEL_CHOICES`, `kernel_flags`), which adds XLA flags. Each option's effect on
the bits of separate processes and its cost are measured by tools/check_invariance.py.

`configure` must run before the first compilation (jaxkv.apps.cli.setup_platform calls it); `CompileCounter` counts the
programs compiled and the programs loaded from the cache, through jax.monitoring.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Mapping, MutableMapping

import jax
import jaxlib
from jax._src import xla_bridge

ENV = "JAXKV_COMPILATION_CACHE_DIR"
AUTOTUNE_FLAG = "--xla_gpu_per_fusion_autotune_cache_dir"
_AUTOTUNE_CACHE = "xla_gpu_per_fusion_autotune_cache_dir"  # JAX's value of jax_persistent_cache_enable_xla_caches.
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # Every compile, from the cache or not.
_HIT_EVENT = "/jax/compilation_cache/cache_hits"  # A compile served from the persistent cache.
KERNELS_ENV = "JAXKV_GPU_KERNELS"
# $JAXKV_GPU_KERNELS -> the XLA flags it adds (GPU only; the CPU ignores them). What XLA documents for each:
KERNEL_CHOICES = {
    # XLA's default: GEMM fusions' tilings, cuBLAS algorithms and some emitters picked by timing candidates.
    "timed": (),
    # No autotuning: every kernel takes its default or heuristic configuration.
    "untimed": ("--xla_gpu_autotune_level=0",),
    # GEMMs on cuBLAS (its own heuristic) instead of Triton fusions, and no autotuning.
    "cublas_untimed": ("--xla_gpu_enable_triton_gemm=false", "--xla_gpu_autotune_level=0"),
    # "Run-to-run determinism": deterministic implementations of scatter and of the ops that use atomics; autotuning
    # as by default.
    "deterministic": ("--xla_gpu_deterministic_ops=true",),
}
# "record:FILE" writes every autotuning result of the process to FILE; "table:FILE" loads them and fails a compile
# that would need another (XLA's persisted autotuning: a shipped, versioned choice table).
KERNEL_TABLE_CHOICES = {
    "record": ("--xla_gpu_dump_autotune_results_to={}",),
    "table": ("--xla_gpu_load_autotune_results_from={}", "--xla_gpu_require_complete_aot_autotune_results=true"),
}


def default_root(env: Mapping[str, str] = os.environ) -> str:
  """The per-user folder: $JAXKV_COMPILATION_CACHE_DIR, else $XDG_CACHE_HOME/jaxkv, else ~/.cache/jaxkv."""
  if env.get(ENV) is not None:
    return env[ENV]
  base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "jaxkv")


def resolve(flag: str | None, env: Mapping[str, str] = os.environ) -> str | None:
  """The cache folder for a --compilation_cache_dir value: None (unset) = default_root(), "" = off (None).

  A user's own JAX_COMPILATION_CACHE_DIR is used as it is when the flag and $JAXKV_COMPILATION_CACHE_DIR are unset;
  otherwise the folder is `<root>/jax-<version>-jaxlib-<version>`."""
  if flag is None and env.get(ENV) is None and env.get("JAX_COMPILATION_CACHE_DIR"):
    return env["JAX_COMPILATION_CACHE_DIR"]
  root = default_root(env) if flag is None else flag
  if not root:
    return None
  return os.path.join(os.path.expanduser(root), f"jax-{jax.__version__}-jaxlib-{jaxlib.__version__}")


def kernel_flags(choice: str) -> list[str]:
  """The XLA flags of a $JAXKV_GPU_KERNELS value: a KERNEL_CHOICES name, or record:FILE / table:FILE; ValueError
  for another."""
  name, colon, path = choice.partition(":")
  if colon and name in KERNEL_TABLE_CHOICES and path:
    return [f.format(os.path.abspath(os.path.expanduser(path))) for f in KERNEL_TABLE_CHOICES[name]]
  if choice in KERNEL_CHOICES:
    return list(KERNEL_CHOICES[choice])
  raise ValueError(
      f"{KERNELS_ENV}={choice!r} is not a kernel choice; use one of {', '.join(KERNEL_CHOICES)}, record:FILE or "
      "table:FILE"
  )


def choose_kernels(env: MutableMapping[str, str] = os.environ) -> list[str]:
  """Appends the flags of $JAXKV_GPU_KERNELS (unset: "timed", none) to $XLA_FLAGS, which XLA reads when the backend
  starts: ValueError when flags are due and it has started. Returns the flags added."""
  flags = kernel_flags(env.get(KERNELS_ENV) or "timed")
  if flags and xla_bridge.backends_are_initialized():
    raise ValueError(f"{KERNELS_ENV} must be set before JAX starts its backend (it adds XLA flags)")
  if flags:
    env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), *flags]).strip()
  return flags


def configure(path: str | None, env: MutableMapping[str, str] = os.environ) -> None:
  """Applies $JAXKV_GPU_KERNELS (`choose_kernels`), then turns the persistent compilation cache on in `path` (every
  program, however small or quick to compile), with XLA's autotuning cache in its subfolder, or off (None). XLA_FLAGS
  is otherwise left as it is; when it names its own --xla_gpu_per_fusion_autotune_cache_dir, that one is used instead
  of the subfolder."""
  choose_kernels(env)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_enable_compilation_cache", path is not None)
  if path is None:
    return
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # -1: every entry, no filesystem override.
  own = AUTOTUNE_FLAG in env.get("XLA_FLAGS", "")
  jax.config.update("jax_persistent_cache_enable_xla_caches", "" if own else _AUTOTUNE_CACHE)


@dataclasses.dataclass
class _Event:
  t: float  # time.perf_counter() when the compile ended.
  from_cache: bool
  seconds: float  # Its duration.
  name: str  # The program's (the jitted function's) name.


class CompileCounter:
  """Counts, while open, the programs that JAX compiles and those it loads from the persistent cache.

  with CompileCounter() as counter:
    ...
  counter.counts()  # {programs_compiled, programs_from_cache}; counts(since=t): of the compiles ending after t.
  counter.names()  # Their programs' names (names(since=t) likewise).
  counter.seconds()  # Their time (seconds(since=t) likewise).
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._events: list[_Event] = []
    self._hit = threading.local()  # Whether the compile under way on this thread was a cache hit.

  def _on_event(self, event: str, **_) -> None:
    if event == _HIT_EVENT:
      self._hit.value = True

  def _on_duration(self, event: str, duration: float, fun_name: str = "", **_) -> None:
    if event == _COMPILE_EVENT:  # On the compiling thread, after its hit event, if any.
      hit, self._hit.value = getattr(self._hit, "value", False), False
      with self._lock:
        self._events.append(_Event(time.perf_counter(), hit, duration, fun_name))

  def __enter__(self) -> CompileCounter:
    jax.monitoring.register_event_listener(self._on_event)
    jax.monitoring.register_event_duration_secs_listener(self._on_duration)
    return self

  def __exit__(self, *exc) -> None:
    jax.monitoring.unregister_event_listener(self._on_event)
    jax.monitoring.unregister_event_duration_listener(self._on_duration)

  def _since(self, since: float | None) -> list[_Event]:
    with self._lock:
      return [e for e in self._events if since is None or e.t > since]

  def counts(self, since: float | None = None) -> dict:
    """{programs_compiled, programs_from_cache}: of every compile, or of those ending after `since` (a
    time.perf_counter() value)."""
    events = self._since(since)
    hits = sum(e.from_cache for e in events)
    return dict(programs_compiled=len(events) - hits, programs_from_cache=hits)

  def names(self, since: float | None = None) -> list[str]:
    """The programs' names, in the order their compiles ended (of every compile or of those ending after `since`)."""
    return [e.name for e in self._since(since)]

  def seconds(self, since: float | None = None) -> float:
    """The seconds XLA took to compile (or load from the persistent cache) the programs, of every compile or of those
    ending after `since`; tracing and lowering are not counted."""
    return sum(e.seconds for e in self._since(since))
