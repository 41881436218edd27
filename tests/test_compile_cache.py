"""The persistent compilation cache: where it lives, what it sets, its counters, and a second process served by it."""

import json
import os
import subprocess
import sys
from unittest import mock

import helpers
import jax
import jaxlib
import numpy as np
import pytest

from jaxkv import compile_cache

VERSIONS = f"jax-{jax.__version__}-jaxlib-{jaxlib.__version__}"
_OPTIONS = (
    "jax_compilation_cache_dir",
    "jax_enable_compilation_cache",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes",
    "jax_persistent_cache_enable_xla_caches",
)


def test_the_folder_is_per_user_per_version_and_the_flag_moves_or_disables_it():
  home = os.path.expanduser("~")
  assert compile_cache.resolve(None, {}) == os.path.join(home, ".cache", "jaxkv", VERSIONS)
  assert compile_cache.resolve(None, {"XDG_CACHE_HOME": "/x"}) == os.path.join("/x", "jaxkv", VERSIONS)
  assert compile_cache.resolve(None, {compile_cache.ENV: "/e", "XDG_CACHE_HOME": "/x"}) == os.path.join("/e", VERSIONS)
  assert compile_cache.resolve("/f", {compile_cache.ENV: "/e"}) == os.path.join("/f", VERSIONS)
  assert compile_cache.resolve("", {compile_cache.ENV: "/e"}) is None
  assert compile_cache.resolve(None, {compile_cache.ENV: ""}) is None
  # A user's own JAX_COMPILATION_CACHE_DIR is kept as it is, unless the flag (or jaxkv's variable) says otherwise.
  assert compile_cache.resolve(None, {"JAX_COMPILATION_CACHE_DIR": "/j"}) == "/j"
  assert compile_cache.resolve("/f", {"JAX_COMPILATION_CACHE_DIR": "/j"}) == os.path.join("/f", VERSIONS)
  assert compile_cache.resolve("", {"JAX_COMPILATION_CACHE_DIR": "/j"}) is None


@pytest.fixture
def jax_options():
  """Restores the cache options after a test that configures them (nothing compiles meanwhile)."""
  before = {k: jax.config.values[k] for k in _OPTIONS}
  xla_flags = os.environ.get("XLA_FLAGS")
  yield
  for k, v in before.items():
    jax.config.update(k, v)
  assert os.environ.get("XLA_FLAGS") == xla_flags  # configure never touches XLA_FLAGS.


def test_configure_caches_every_program_with_the_autotuning_beside_it(tmp_path, jax_options):
  path = str(tmp_path / "cache")
  compile_cache.configure(path, {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
  v = jax.config.values
  assert v["jax_compilation_cache_dir"] == path and v["jax_enable_compilation_cache"] and os.path.isdir(path)
  assert v["jax_persistent_cache_min_compile_time_secs"] == 0 and v["jax_persistent_cache_min_entry_size_bytes"] == -1
  # JAX sets XLA's per-fusion autotuning cache to a subfolder of the cache (a compile option, not an XLA_FLAGS entry,
  # so nothing GPU-only reaches XLA_FLAGS on the CPU).
  assert v["jax_persistent_cache_enable_xla_caches"] == "xla_gpu_per_fusion_autotune_cache_dir"


def test_a_users_own_autotune_cache_flag_wins(tmp_path, jax_options):
  compile_cache.configure(str(tmp_path), {"XLA_FLAGS": f"{compile_cache.AUTOTUNE_FLAG}=/mine"})
  assert jax.config.values["jax_persistent_cache_enable_xla_caches"] == ""  # JAX leaves the user's flag alone.


def test_off_disables_the_cache(jax_options):
  compile_cache.configure(None)
  assert jax.config.values["jax_compilation_cache_dir"] is None
  assert not jax.config.values["jax_enable_compilation_cache"]


def test_the_kernel_choice_adds_its_xla_flags_before_the_backend_starts():
  assert compile_cache.kernel_flags("timed") == []
  assert compile_cache.kernel_flags("untimed") == ["--xla_gpu_autotune_level=0"]
  assert compile_cache.kernel_flags("table:/t/a.textproto") == [
      "--xla_gpu_load_autotune_results_from=/t/a.textproto",
      "--xla_gpu_require_complete_aot_autotune_results=true",
  ]
  assert compile_cache.kernel_flags("record:/t/a.textproto") == ["--xla_gpu_dump_autotune_results_to=/t/a.textproto"]
  for bad in ("fast", "table:", "record", "untimed:/x"):
    with pytest.raises(ValueError, match=f"JAXKV_GPU_KERNELS='{bad}' is not a kernel choice"):
      compile_cache.kernel_flags(bad)
  assert compile_cache.choose_kernels({}) == []  # Nothing to add: fine with the backend up.
  env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", compile_cache.KERNELS_ENV: "cublas_untimed"}
  with mock.patch.object(compile_cache.xla_bridge, "backends_are_initialized", lambda: True):
    with pytest.raises(ValueError, match="must be set before JAX starts its backend"):
      compile_cache.choose_kernels(env)
  with mock.patch.object(compile_cache.xla_bridge, "backends_are_initialized", lambda: False):
    assert compile_cache.choose_kernels(env) == list(compile_cache.KERNEL_CHOICES["cublas_untimed"])
  assert env["XLA_FLAGS"].split() == [
      "--xla_force_host_platform_device_count=8",
      *compile_cache.KERNEL_CHOICES["cublas_untimed"],
  ]


def test_an_app_applies_the_kernel_choice_and_rejects_a_bad_one_in_one_line(cold_and_warm):
  for _, out in cold_and_warm[1]:  # Run with $JAXKV_GPU_KERNELS=untimed.
    assert [len(t) for t in out["tokens"]] == [6, 6]  # The GPU flags reach XLA, which the CPU ignores.
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  proc = subprocess.run(
      [sys.executable, "-m", "jaxkv.generate", "--cpu_devices=1"],
      cwd=helpers.ROOT,
      env=dict(env, JAXKV_GPU_KERNELS="fast"),
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert proc.returncode == 2 and "error: JAXKV_GPU_KERNELS='fast' is not a kernel choice" in proc.stderr, proc.stderr


def test_the_counter_counts_compiles_while_open_and_after_a_time():
  x = jax.device_put(np.arange(5.0))
  with compile_cache.CompileCounter() as counter:
    jax.jit(lambda a: a * 3 + 1)(x).block_until_ready()
    import time  # pylint: disable=g-import-not-at-top

    t = time.perf_counter()
    jax.jit(lambda a: a - 7)(x).block_until_ready()
    jax.jit(lambda a: a - 7)  # Traced nowhere: no compile.
  jax.jit(lambda a: a / 2)(x).block_until_ready()  # Closed: not counted.
  # Each program is compiled here or loaded from the tests' shared cache (tests/conftest.py), once.
  total = lambda c: c["programs_compiled"] + c["programs_from_cache"]
  assert total(counter.counts()) == 2 and total(counter.counts(since=t)) == 1


@pytest.fixture(scope="module")
def cold_and_warm(tmp_path_factory):
  """Two runs of the generate app, one after the other, each a process of its own (helpers.fork_apps: forked from one
  that compiled nothing), with a compilation cache of their own and the kernel choice "untimed" ($JAXKV_GPU_KERNELS):
  the cache's folder, and (stdout, JSON output) of each."""
  tmp = tmp_path_factory.mktemp("compile_cache")
  cache = tmp / "cache"
  flags = ("--cpu_devices=2", "--prompt_len=5,12", "--max_new_tokens=6", "--kv_placement=host")
  runs = {
      n: ["-m", "jaxkv.generate", *flags, f"--compilation_cache_dir={cache}", f"--json_out={tmp / n}.json"]
      for n in ("cold", "warm")
  }
  done = helpers.fork_apps(tmp / "runs", runs, parallel=1, env={compile_cache.KERNELS_ENV: "untimed"})
  out = []
  for n in runs:
    status, stdout, stderr, _ = done[n]
    assert status == 0, stderr[-3000:]
    out.append((stdout, json.loads((tmp / f"{n}.json").read_text())))
  return cache, out


def test_a_second_process_loads_every_program_from_the_cache(cold_and_warm):
  cache, [(_, cold), (out, warm)] = cold_and_warm
  c, w = cold["compilation"], warm["compilation"]
  assert c["cache_dir"] == w["cache_dir"] == str(cache / VERSIONS) and os.listdir(c["cache_dir"])
  assert c["programs_compiled"] > 0 and c["programs_from_cache"] == 0
  assert w == dict(c, programs_compiled=0, programs_from_cache=c["programs_compiled"], during_decode=w["during_decode"])
  assert w["during_decode"]["programs_compiled"] == 0
  assert sum(w["during_decode"].values()) == sum(c["during_decode"].values())  # The same programs, the same place.
  assert (cold["tokens_sha256"], cold["logits_sha256"]) == (warm["tokens_sha256"], warm["logits_sha256"])
  assert f"programs compiled 0, from the cache {c['programs_compiled']}" in out
