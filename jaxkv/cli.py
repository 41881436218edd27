"""Flags shared by the absl apps (generate, bench, gates), their resolution, and how the apps start and fail.

`--cpu_devices=N`, the jax.distributed settings and `--compilation_cache_dir` must act before JAX creates its
backends and compiles: apps call `setup_platform()` first thing in main(), before any JAX call.

Apps start with `cli.run(main, help_groups)` instead of absl's `app.run`: `--help` lists the app's own flags in
groups (`--helpfull` keeps absl's full list), and an error in the user's input (a bad flag, config, checkpoint,
capacity, mesh or budget: jaxkv.preflight.InputError, absl's UsageError and flag errors) prints one line, and a hint
line where one helps, with no traceback: exit status 2 for usage errors, 1 for runtime failures. Programming errors
keep their traceback.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from jaxkv import compile_cache
from jaxkv import config as config_lib
from jaxkv import distributed
from jaxkv import preflight

_DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments", "tiny.py")

CONFIG = config_flags.DEFINE_config_file(
    "config",
    _DEFAULT_CONFIG,
    "Experiment config file, e.g. experiments/llama3_8b.py; override fields " "with --config.model.num_layers=2.",
    lock_config=True,
)
CPU_DEVICES = flags.DEFINE_integer(
    "cpu_devices", 4, "Simulate N CPU devices (forces the CPU backend). 0 = use the real accelerators."
)
COORDINATOR_ADDRESS = flags.DEFINE_string(
    "coordinator_address",
    None,
    "Multi-process: host:port of process 0's coordinator, the same in every process (default: "
    "$JAX_COORDINATOR_ADDRESS). Setting any of the three distributed flags or their variables starts "
    "jax.distributed.",
)
NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "Multi-process: number of processes, one per host (default: $JAX_NUM_PROCESSES)."
)
PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "Multi-process: this process's id in [0, num_processes) (default: $JAX_PROCESS_ID)."
)
COMPILATION_CACHE_DIR = flags.DEFINE_string(
    "compilation_cache_dir",
    None,
    "Persistent compilation cache (compiled programs and GPU autotuning, which separate processes then share: the "
    f"same bits in each), in a subfolder per jax version. Default: ${compile_cache.ENV}, else $XDG_CACHE_HOME/jaxkv "
    "or ~/.cache/jaxkv ($JAX_COMPILATION_CACHE_DIR as it is, when set). Empty = off.",
)
CAPACITY = flags.DEFINE_integer(
    "capacity",
    None,
    "Cache rows per sequence: the longest prompt plus its new tokens must fit (default: config engine.capacity). "
    "E.g. 131328 for a 128k context with experiments/llama3_8b.py:3.1.",
    lower_bound=1,
)
KV_PLACEMENT = flags.DEFINE_enum(
    "kv_placement", None, list(config_lib.PLACEMENTS), "KV cache placement (default: config kv.placement)."
)
KV_DEPTH = flags.DEFINE_integer(
    "kv_pipeline_depth", None, "0 = ordered; N >= 1 = deliver layer l+N before computing layer l."
)
KV_BLOCK = flags.DEFINE_integer("kv_block", None, "Rows per KV page (default: config kv.block).")
KV_BUDGET = flags.DEFINE_integer(
    "kv_pipeline_budget_mib", None, "Cap on the delivery ring per device, MiB " "(0 = none)."
)
KV_HEADROOM = flags.DEFINE_integer("kv_headroom_mib", None, "Device memory kept free when sizing the ring.")
KV_DTYPE = flags.DEFINE_enum(
    "kv_dtype",
    None,
    list(config_lib.KV_DTYPES),
    "KV cache storage (default: config kv.dtype, 'model' = the model dtype). int8 / int4: blocks of 32 values "
    "along head_dim with a float16 scale each (head_dim % 32 == 0; 136 / 72 B per 128 values, bf16 256); "
    "float8_e4m3fn: a float16 scale per head row.",
)
KV_DEVICE_BUDGET = flags.DEFINE_float(
    "kv_device_budget_gib",
    None,
    "With --kv_placement=auto: device memory per device for the KV, GiB (default: the free device memory).",
)
KV_HOST_ATTENTION = flags.DEFINE_bool(
    "kv_host_attention",
    None,
    "With --kv_placement=host or auto: attend a share of each streamed window on the host CPU during decode and "
    "deliver only the rest (not bit-identical to the other modes).",
)
KV_HOST_ATTENTION_FRACTION = flags.DEFINE_float(
    "kv_host_attention_fraction",
    None,
    "With --kv_host_attention: the host's share of each window's full-block rows, in (0, 1) (default: chosen for "
    "each window from the CPU's and the link's rates and a split layer's fixed cost, measured at start; off where "
    "that predicts under 3% gain).",
)
KV_HOST_ATTENTION_THREADS = flags.DEFINE_integer(
    "kv_host_attention_threads",
    None,
    "With --kv_host_attention: the CPU kernel's threads (default: config kv.host_attention_threads, 0 = chosen at "
    "start among numba's pool, by default the cores, minus two (at most 16), and two and four fewer).",
)
KV_HOST_ATTENTION_WAIT = flags.DEFINE_enum(
    "kv_host_attention_wait",
    None,
    list(config_lib.HOST_ATTENTION_WAITS),
    "With --kv_host_attention: what waits for the host's partial before the device merges it: thread (the "
    "dispatching thread) or device (the devices wait in pinned host memory and decode passes run ahead of the "
    "host's kernels; a C++ op built at first use; faster on the H200); auto: device on one GPU in one process where "
    "the op builds, else thread. Default: config kv.host_attention_wait, auto.",
)
SPLIT_MODE = flags.DEFINE_enum(
    "split_mode",
    None,
    list(config_lib.SPLIT_MODES),
    "How layers map to the devices (default: config split.mode, 'tensor'): tensor = heads split over the tensor "
    "axis; layer = contiguous layer ranges per device; none = one device.",
)
LAYER_SPLIT = flags.DEFINE_string(
    "layer_split", None, "With --split_mode=layer: proportions per device, e.g. 55,45 (default even)."
)
KV_DEBUG = flags.DEFINE_integer(
    "kv_transport_debug", None, "Transport telemetry: 0 totals, 1 per step, 2 per layer, 3 log per step."
)
DISTRIBUTED_TIMEOUT = flags.DEFINE_integer(
    "distributed_timeout_s",
    60,
    "Multi-process: seconds to wait for every process to join the coordinator before failing, naming them.",
)

# --help's groups of the shared flags; each app adds its own (see run()).
CONFIG_GROUP = [CONFIG, CPU_DEVICES, CAPACITY, COMPILATION_CACHE_DIR]
KV_GROUP = [
    KV_PLACEMENT,
    KV_DTYPE,
    KV_DEPTH,
    KV_BLOCK,
    KV_BUDGET,
    KV_HEADROOM,
    KV_DEVICE_BUDGET,
    KV_HOST_ATTENTION,
    KV_HOST_ATTENTION_FRACTION,
    KV_HOST_ATTENTION_THREADS,
    KV_HOST_ATTENTION_WAIT,
    KV_DEBUG,
]
SPLIT_GROUP = [SPLIT_MODE, LAYER_SPLIT]
MULTIHOST_GROUP = [COORDINATOR_ADDRESS, NUM_PROCESSES, PROCESS_ID, DISTRIBUTED_TIMEOUT]

_KV_FLAGS = {
    "placement": KV_PLACEMENT,
    "pipeline_depth": KV_DEPTH,
    "block": KV_BLOCK,
    "budget_mib": KV_BUDGET,
    "headroom_mib": KV_HEADROOM,
    "transport_debug": KV_DEBUG,
    "dtype": KV_DTYPE,
    "device_budget_gib": KV_DEVICE_BUDGET,
    "host_attention": KV_HOST_ATTENTION,
    "host_attention_fraction": KV_HOST_ATTENTION_FRACTION,
    "host_attention_threads": KV_HOST_ATTENTION_THREADS,
    "host_attention_wait": KV_HOST_ATTENTION_WAIT,
}


def setup_platform() -> None:
  """Applies --cpu_devices (per process) and --compilation_cache_dir, and joins jax.distributed when it is set up.
  Must run before the first JAX call. InputError when --cpu_devices=0 finds no accelerator, or when processes do
  not join in time."""
  n = CPU_DEVICES.value
  if n < 0:
    raise preflight.InputError(f"--cpu_devices must be >= 0, got {n}", "0 = the real accelerators, N = simulate N")
  with preflight.input_errors():
    args = distributed.settings(COORDINATOR_ADDRESS.value, NUM_PROCESSES.value, PROCESS_ID.value)
  if n:
    os.environ["JAX_PLATFORMS"] = "cpu"
    xla = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(xla + [f"--xla_force_host_platform_device_count={n}"])
    # XLA:CPU launches and runs every device's part of a program on one thread pool, one thread per core but at
    # least one per device. A program with collectives holds a thread per device until all its devices run it,
    # and the launch of the next program can hold one more per device: with fewer than two threads per device
    # the two can deadlock (seen on 2 cores).
    os.environ.setdefault("PJRT_NPROC", str(max(os.cpu_count() or 1, 2 * n)))
    import jax  # pylint: disable=g-import-not-at-top

    jax.config.update("jax_platforms", "cpu")
  compile_cache.configure(compile_cache.resolve(COMPILATION_CACHE_DIR.value))
  if args is not None:
    distributed.initialize(args, cpu=bool(n), timeout_s=DISTRIBUTED_TIMEOUT.value)
  if not n:
    import jax  # pylint: disable=g-import-not-at-top

    if jax.default_backend() == "cpu":
      raise preflight.InputError(
          "--cpu_devices=0 runs on the accelerators, and JAX finds none (only the CPU)",
          "install jax with CUDA (pip install -e '.[cuda13]'), or simulate devices with --cpu_devices=N",
      )


def check_outputs(*holders) -> None:
  """Each output path flag that is set names a file in an existing folder (checked before any work)."""
  for h in holders:
    if h.value:
      folder = os.path.dirname(os.path.abspath(h.value))
      if not os.path.isdir(folder):
        raise preflight.InputError(f"--{h.name}={h.value}: the folder {folder} does not exist", "create it first")


def write_json(obj: dict, path: str | None) -> None:
  """Writes an app's JSON output where --json_out says (nothing when it is unset)."""
  if path:
    with open(path, "w") as f:
      json.dump(obj, f, indent=1)
    logging.info("wrote %s", path)


def resolved_config_dict():
  """The experiment ConfigDict with --capacity and the --kv_* flags applied."""
  path = config_flags.get_config_filename(flags.FLAGS["config"]).split(":")[0]  # file.py:args -> file.py
  if not os.path.isfile(path):
    raise preflight.InputError(
        f"--config={path}: no such file", f"configs are Python files, e.g. --config={os.path.relpath(_DEFAULT_CONFIG)}"
    )
  cd = CONFIG.value.unlock()
  if CAPACITY.value is not None:
    cd.engine.capacity = CAPACITY.value
  for field, flag in _KV_FLAGS.items():
    if flag.value is not None:
      cd.kv[field] = flag.value
  for field, flag in (("mode", SPLIT_MODE), ("layer_split", LAYER_SPLIT)):
    if flag.value is not None:
      cd.split[field] = flag.value
  return cd.lock()


def resolved_config() -> config_lib.Config:
  with preflight.input_errors():
    return config_lib.from_config_dict(resolved_config_dict())


def run(main, help_groups: dict[str, list]) -> None:
  """absl's app.run(main) with jaxkv's --help (the flags of `help_groups`, {group title: [flag holders]}) and
  one-line input errors (module docstring)."""
  prog = f"python3 -m {_main_module()}"

  def parse(argv):
    if any(a in ("--help", "-h", "-?", "--helpshort") for a in argv[1:]):
      print(help_text(prog, help_groups))
      sys.exit(0)
    try:
      return flags.FLAGS(argv)
    except flags.Error as e:
      _fail(prog, str(e), f"{prog} --help lists the flags", preflight.USAGE)

  def guarded(argv):
    try:
      return main(argv)
    except preflight.InputError as e:
      _fail(prog, str(e), e.hint, e.status)
    except (app.UsageError, flags.Error) as e:
      _fail(prog, str(e), None, preflight.USAGE)

  app.run(guarded, flags_parser=parse)


def _main_module() -> str:
  spec = getattr(sys.modules["__main__"], "__spec__", None)  # A package's app is its __main__ module.
  return spec.name.removesuffix(".__main__") if spec else os.path.basename(sys.argv[0])


def _fail(prog: str, message: str, hint: str | None, status: int):
  print(f"{prog}: error: {' '.join(message.split())}", file=sys.stderr)
  if hint:
    print(f"  hint: {hint}", file=sys.stderr)
  sys.exit(status)


def help_text(prog: str, groups: dict[str, list]) -> str:
  """--help: the main module's first docstring paragraph, then each group's flags with default and help."""
  doc = (sys.modules["__main__"].__doc__ or "").strip().split("\n\n")[0]
  lines = [f"usage: {prog} [--flag=value ...]", "", doc, ""]
  for title, holders in groups.items():
    lines.append(f"{title}:")
    for h in holders:
      f = flags.FLAGS[h.name]
      default = f.default_as_str if f.default is not None else ""
      lines.append(f"  --{f.name}" + (f"={default.strip(chr(39))}" if default else ""))
      lines += textwrap.wrap(" ".join(f.help.split()), 112, initial_indent=" " * 6, subsequent_indent=" " * 6)
    lines.append("")
  lines.append("--helpfull lists every flag, absl's logging flags too.")
  return "\n".join(lines)
