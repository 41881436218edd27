"""Eight simulated CPU devices for every test, and one persistent compilation cache for every test process; set
before JAX is imported anywhere."""

import os
import tempfile

import pytest

os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "force_host_platform_device_count" not in f]
    + ["--xla_force_host_platform_device_count=8"]
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Two XLA:CPU threads per device at least, as jaxkv.cli.setup_platform sets for the apps: with one per device a
# program's collective and the next program's launch can deadlock (seen as an all-reduce rendezvous timeout).
os.environ.setdefault("PJRT_NPROC", str(max(os.cpu_count() or 1, 16)))
# JAX's persistent compilation cache, shared by every test process: both pytest-xdist workers and the apps that tests
# start (they inherit the environment). A program that one of them compiled, the others load: on 2 cores a tiny-model
# generate that took 27 s to compile took 7.5 s with its programs cached. The cache key covers the program, the
# devices, the flags and the jax version, so entries are never stale; a half-written entry read by another process is
# recompiled, with a warning.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "jaxkv-tests-jax-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# The apps that tests start use the same cache (jaxkv.compile_cache reads this before the user's default folder).
os.environ.setdefault("JAXKV_COMPILATION_CACHE_DIR", os.environ["JAX_COMPILATION_CACHE_DIR"])
