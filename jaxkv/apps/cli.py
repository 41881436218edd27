"""Flags shared by the apps (generate, bench, gates, serve) and their resolution.

`--cpu_devices=N`, the jax.distributed settings and `--compilation_cache_dir` must act before JAX creates its
backends and compiles: apps call `setup_platform()` first thing in main(), before any JAX call.

The shorthand flags (`--capacity`, `--kv_*`, `--split_mode`, `--layer_split`) are derived from the config fields they
set (jaxkv.config: type, choices and help), and win over `--config`'s values. `--config` defaults to
experiments/tiny.py; a run whose model comes from a checkpoint or GGUF file and that names no `--config` takes the
library's defaults (experiments/common.py, derived from jaxkv.config) with the `--config.*` overrides given.

These apps start with `cli.run(main, help_groups, doc)`: jaxkv.apps.launch (one-line input errors, Ctrl-C) with
the --config default put on the command line where none is given.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import typing

from absl import flags
from absl import logging
from ml_collections import config_flags

from experiments import common
from jaxkv import compile_cache
from jaxkv import config as config_lib
from jaxkv import distributed
from jaxkv import preflight
from jaxkv.apps import launch
from jaxkv.host import startup

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # Holds jaxkv and experiments.
DEFAULT_CONFIG = os.path.join(_ROOT, "experiments", "tiny.py")
_DEFAULT_REL = os.path.relpath(DEFAULT_CONFIG, _ROOT)

# Its default is set at parse time (run()), not here: absl would load the file, and any --config.x override with
# it, when this module is imported, where an error cannot be reported as one line.
CONFIG = config_flags.DEFINE_config_file(
    "config",
    None,
    "Experiment config file, e.g. experiments/llama3_8b.py (path:variant passes the variant to its get_config); "
    "override fields with --config.model.num_layers=2.",
    lock_config=True,
)
CPU_DEVICES = flags.DEFINE_integer(
    "cpu_devices",
    4,
    "Simulate N CPU devices (forces the CPU backend); 0 = the real accelerators. Left out, a model whose KV heads "
    "(or MLP width or vocabulary) 4 does not divide runs on the most devices up to 4 that divide them.",
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
DISTRIBUTED_TIMEOUT = flags.DEFINE_integer(
    "distributed_timeout_s",
    60,
    "Multi-process: seconds to wait for every process to join the coordinator before failing, naming them.",
    lower_bound=1,
)

# Shorthand flag -> the config field it sets (section, field). Its type, choices and help are the field's.
SHORTHANDS = {
    "capacity": ("engine", "capacity"),
    "kv_placement": ("kv", "placement"),
    "kv_dtype": ("kv", "dtype"),
    "kv_pipeline_depth": ("kv", "pipeline_depth"),
    "kv_block": ("kv", "block"),
    "kv_pipeline_budget_mib": ("kv", "budget_mib"),
    "kv_headroom_mib": ("kv", "headroom_mib"),
    "kv_device_budget_gib": ("kv", "device_budget_gib"),
    "kv_host_attention": ("kv", "host_attention"),
    "kv_host_attention_fraction": ("kv", "host_attention_fraction"),
    "kv_host_attention_threads": ("kv", "host_attention_threads"),
    "kv_host_attention_wait": ("kv", "host_attention_wait"),
    "kv_transport_debug": ("kv", "transport_debug"),
    "kv_delivery_chunk_mib": ("kv", "delivery_chunk_mib"),
    "split_mode": ("split", "mode"),
    "layer_split": ("split", "layer_split"),
    "speculate": ("speculate", "mode"),
}


def _define_shorthand(name: str, section: str, field: str):
  """The flag `name` for config field section.field: unset (None) unless given, then it wins over the config."""
  cls = config_lib.SECTIONS[section]
  f = next(f for f in dataclasses.fields(cls) if f.name == field)
  kind = typing.get_type_hints(cls)[field]
  text = f"config {section}.{field}: {f.metadata['help']}"
  if f.metadata["choices"]:
    return flags.DEFINE_enum(name, None, list(f.metadata["choices"]), text)
  define = {bool: flags.DEFINE_bool, int: flags.DEFINE_integer, str: flags.DEFINE_string}.get(kind, flags.DEFINE_float)
  return define(name, None, text)


SHORTHAND_FLAGS = {name: _define_shorthand(name, *field) for name, field in SHORTHANDS.items()}

# --help's groups of the shared flags; each app adds its own (see run()).
CONFIG_GROUP = [CONFIG, CPU_DEVICES, SHORTHAND_FLAGS["capacity"], COMPILATION_CACHE_DIR]
KV_GROUP = [h for name, h in SHORTHAND_FLAGS.items() if name.startswith("kv_")]
SPLIT_GROUP = [SHORTHAND_FLAGS["split_mode"], SHORTHAND_FLAGS["layer_split"]]
SPECULATE_FLAG = SHORTHAND_FLAGS["speculate"]
MULTIHOST_GROUP = [COORDINATOR_ADDRESS, NUM_PROCESSES, PROCESS_ID, DISTRIBUTED_TIMEOUT]

_CONFIG_GIVEN = [False]  # Whether the command line names --config (run() sets it).


def setup_platform(model: config_lib.ModelConfig | None = None, needs=()) -> None:
  """Applies --cpu_devices (per process; left out, as many devices up to its default as `model` divides over) and
  --compilation_cache_dir, and joins jax.distributed when it is set up; on the accelerators, sizes JAX's memory
  fraction and the pinned pool for the caches the app may make (`needs`: jaxkv.host.startup.CacheNeed, startup_env).
  Must run before the first JAX call. InputError when --cpu_devices=0 finds no accelerator, for bad distributed
  settings, when processes do not join in time, or when the host's RAM cannot hold a host placement's cache."""
  n = CPU_DEVICES.value
  if n < 0:
    raise preflight.InputError(f"--cpu_devices must be >= 0, got {n}", "0 = the real accelerators, N = simulate N")
  if n and model is not None and not flags.FLAGS["cpu_devices"].present:
    fit = preflight.cpu_devices(model, n)
    if fit != n:
      logging.info("simulating %d CPU devices: the model's %d KV heads split over them", fit, model.num_kv_heads)
    n = fit
  hint = "--coordinator_address=host:port --num_processes=N --process_id=I (or their JAX_* variables)"
  with preflight.input_errors(hint=hint):
    args = distributed.settings(COORDINATOR_ADDRESS.value, NUM_PROCESSES.value, PROCESS_ID.value)
  if not n and model is not None and needs:
    with preflight.input_errors():
      for name, value in startup.startup_env(model, list(needs), startup.device_memory_bytes()).items():
        logging.info("%s=%s (jaxkv.host.startup.startup_env)", name, value)
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
  with preflight.input_errors():  # $JAXKV_GPU_KERNELS.
    compile_cache.configure(compile_cache.resolve(COMPILATION_CACHE_DIR.value))
  if args is not None:
    with preflight.input_errors(hint=hint):
      distributed.initialize(args, cpu=bool(n), timeout_s=DISTRIBUTED_TIMEOUT.value)
  if not n:
    import jax  # pylint: disable=g-import-not-at-top

    if jax.default_backend() == "cpu":
      raise preflight.InputError(
          "--cpu_devices=0 runs on the accelerators, and JAX finds none (only the CPU)",
          "install jax with CUDA (pip install -e '.[cuda13]'), or simulate devices with --cpu_devices=N",
      )


def resolved_config_dict(checkpoint: bool = False):
  """The experiment ConfigDict with --capacity and the other shorthand flags applied. `checkpoint`: the model comes
  from a checkpoint or GGUF file; without --config, every section but the model (which the checkpoint replaces) then
  takes the library's defaults, not the tiny model's sizes, with the --config.* overrides given."""
  cd = CONFIG.value.unlock()
  if checkpoint and not _CONFIG_GIVEN[0]:
    base = common.base_config()
    base.model = cd.model
    for path, value in config_flags.get_override_values(flags.FLAGS["config"]).items():
      *parents, leaf = path.split(".")
      node = base
      for p in parents:
        node = node[p]
      node[leaf] = value
    cd = base
  for name, (section, field) in SHORTHANDS.items():
    if SHORTHAND_FLAGS[name].value is not None:
      cd[section][field] = SHORTHAND_FLAGS[name].value
  return cd.lock()


def resolved_config() -> config_lib.Config:
  with preflight.input_errors():
    return config_lib.from_config_dict(resolved_config_dict())


def model_of(config_dict, checkpoint_dir: str | None = None, gguf: str | None = None, dtype: str | None = None):
  """The model that will run: a checkpoint folder's or GGUF file's (jaxkv.preflight.checkpoint_model), else the
  config's. Starts no JAX backend (setup_platform sizes the simulated devices by it)."""
  if checkpoint_dir or gguf:
    return preflight.checkpoint_model(checkpoint_dir, dtype, gguf)[0]
  with preflight.input_errors():
    return config_lib.from_config_dict(config_dict).model


_FIELDS_HINT = "docs/reference.md lists the config fields"


def run(main, help_groups: dict[str, list], doc: str) -> None:
  """launch.run for an app with --config: its default file is put on the command line when none is given, and an
  override of a field the config lacks, or a config file that does not load, is a one-line error."""
  launch.run(main, help_groups, doc, _parse, {CONFIG.name: _DEFAULT_REL})


def _parse(argv: list[str]):
  given = [i for i, a in enumerate(argv) if re.match(r"^--?config(=|$)", a)]
  _CONFIG_GIVEN[0] = bool(given)
  if given:  # ml_collections defers a missing file's error to the config's first use.
    i = given[-1]
    path = (argv[i].partition("=")[2] if "=" in argv[i] else argv[i + 1] if i + 1 < len(argv) else "").split(":")[0]
    if not os.path.isfile(path):
      launch.fail(f"--config={path}: no such file", f"configs are Python files, e.g. --config={_DEFAULT_REL}")
  else:
    argv = [argv[0], f"--config={DEFAULT_CONFIG}", *argv[1:]]
  original = list(sys.argv)
  sys.argv[:] = argv  # ml_collections reads the --config.* overrides from sys.argv while it parses.
  try:
    return flags.FLAGS(argv)
  except (KeyError, AttributeError) as e:  # An override of a field that the config does not have.
    text = str(e)
    path = re.search(r"Attempting to lookup: ([\w.]+)", text)  # A field under a leaf: kv.block.x.
    key = path.group(1) if path else re.findall(r"(\w+)\W*'", text)[0]  # The name, quoted (and escaped).
    bad = [a.split("=")[0] for a in argv if re.match(rf"^--?(no)?config\.(\w+\.)*{re.escape(key)}(\.|=|$)", a)]
    guess = re.search(r'Did you mean "(\w+)"', text)
    hint = f"did you mean {guess.group(1)}? " if guess else ""
    launch.fail(f"{bad[0] if bad else '--config'}: the config has no field {key}", hint + _FIELDS_HINT)
  except (OSError, SyntaxError) as e:  # The config file does not load.
    launch.fail(f"--config: {launch.flag_error(str(e))}", f"e.g. --config={_DEFAULT_REL}")
  finally:
    sys.argv[:] = original  # As given: a bench records it, gates --separate_processes passes it on.


def config_table() -> str:
  """docs/reference.md's table of config fields: each field of jaxkv.config's sections with its shorthand flag,
  default and help (tests/test_docs.py checks that the page holds exactly this)."""
  shorthand = {field: name for name, field in SHORTHANDS.items()}
  rows = ["| field | shorthand | default | meaning |", "| --- | --- | --- | --- |"]
  for section, cls in config_lib.SECTIONS.items():
    for f in dataclasses.fields(cls):
      flag = shorthand.get((section, f.name))
      default = "none" if f.default is None else f"`{f.default!r}`" if f.default in ("", ()) else f"`{f.default}`"
      rows.append(
          f"| `--config.{section}.{f.name}` | {f'`--{flag}`' if flag else ''} | {default} | {f.metadata['help']} |"
      )
  return "\n".join(rows)
