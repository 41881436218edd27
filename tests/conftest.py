"""Eight simulated CPU devices for every test, set before JAX is imported anywhere; one compilation cache a session."""

import os

import pytest

os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "force_host_platform_device_count" not in f]
    + ["--xla_force_host_platform_device_count=8"]
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Two XLA:CPU threads per device at least, as jaxkv.cli.setup_platform sets for the apps: with one per device a
# program's collective and the next program's launch can deadlock (seen as an all-reduce rendezvous timeout).
os.environ.setdefault("PJRT_NPROC", str(max(os.cpu_count() or 1, 16)))


@pytest.fixture(scope="session", autouse=True)
def _compilation_cache(tmp_path_factory):
  """The apps that tests run in subprocesses share one compilation cache per test session (jaxkv.compile_cache),
  not the user's: unless $JAXKV_COMPILATION_CACHE_DIR names one already."""
  os.environ.setdefault("JAXKV_COMPILATION_CACHE_DIR", str(tmp_path_factory.mktemp("compilation_cache")))
