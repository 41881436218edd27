"""Eight simulated CPU devices for every test, set before JAX is imported anywhere, one persistent compilation cache
for the test processes and the apps that tests run, a test process that never runs out of memory mappings, and garbage
collections that skip the objects alive before each module's tests."""

import gc
import os
import tempfile
import warnings

import pytest

os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "force_host_platform_device_count" not in f]
    + ["--xla_force_host_platform_device_count=8"]
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Two XLA:CPU threads per device at least, as jaxkv.apps.cli.setup_platform sets for the apps: with one per device a
# program's collective and the next program's launch can deadlock (seen as an all-reduce rendezvous timeout).
os.environ.setdefault("PJRT_NPROC", str(max(os.cpu_count() or 1, 16)))
# Every test process shares one persistent compilation cache: the pytest workers of a run and of later runs, and the
# apps that tests start in processes of their own (jaxkv.compile_cache reads this folder before the user's default
# one). A program that one of them compiled, the next loads, and so does a worker whose compiled programs were released
# (below). JAX writes an entry in place: an entry read half-written fails to decompress, which JAX reports as a
# warning, and the program compiles.
os.environ.setdefault("JAXKV_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "jaxkv-tests-jax-cache"))

from jaxkv import compile_cache  # pylint: disable=g-import-not-at-top,wrong-import-position

compile_cache.configure(compile_cache.resolve(None))


# XLA:CPU maps the code and data of every kernel it compiles into memory mappings of their own, and a test process keeps
# its compiled programs alive, so its mappings only grow (tests/test_transport.py alone: 25,700 in one process) up to
# Linux's cap per process, vm.max_map_count (65,530 by default). There XLA's LLVM fails ("Cannot allocate memory") and
# jaxlib 0.10.2 dies with a segmentation fault inside the compile instead of raising: in a full run on 2 cores (28
# minutes), a pytest-xdist worker at 64,645 mappings died so 20 s later, in a decode group's compile; with 45,000
# mappings held, tests/test_transport.py dies so at its 13th test. After a test that leaves the process over half the
# cap, its compiled programs are released (jax.clear_caches; they recompile when next called).


def memory_maps() -> int | None:
  """Memory mappings of this process, or None where /proc does not list them (not Linux)."""
  try:
    with open("/proc/self/maps", "rb") as f:
      return sum(1 for _ in f)
  except OSError:
    return None


def _max_memory_maps() -> int | None:
  try:
    with open("/proc/sys/vm/max_map_count", encoding="ascii") as f:
      return int(f.read())
  except (OSError, ValueError):
    return None


MAX_MEMORY_MAPS = _max_memory_maps()


def release_compiled_programs_over(limit: int | None = None) -> str | None:
  """Releases every compiled program (jax.clear_caches) once the process holds over half of `limit` memory mappings
  (default: MAX_MEMORY_MAPS); returns what it did, or None."""
  limit = MAX_MEMORY_MAPS if limit is None else limit
  before = memory_maps()
  if not limit or before is None or before <= limit // 2:
    return None
  import jax  # pylint: disable=g-import-not-at-top

  jax.clear_caches()
  gc.unfreeze()
  gc.collect()
  gc.freeze()
  return f"{before} memory mappings of vm.max_map_count {limit}: released the compiled programs ({memory_maps()} left)"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
  result = yield
  note = release_compiled_programs_over()
  if note:
    warnings.warn(note)
  return result


# A full collection of the garbage collector walks every object that it tracks: in a test process that holds jax's,
# torch's and the compiled programs' objects, 10^5 to 10^6 of them, a quarter of a second or more each time (the
# benchmark's tests collect between arms, dozens of times). The objects alive when the tests are collected, then when
# each module's tests start (after one collection), move to the permanent generation, which collections skip; what
# became garbage in them is freed by reference counting still, and release_compiled_programs_over unfreezes them all
# before its collection.


def _freeze() -> None:
  gc.collect()
  gc.freeze()


def pytest_collection_finish(session):
  del session
  _freeze()


_MODULE = [None]  # The module of the test that ran last.


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
  module = getattr(item, "module", None)
  if module is not _MODULE[0]:
    _MODULE[0] = module
    _freeze()


@pytest.hookimpl(tryfirst=True)  # Before pytest-xdist reads the groups.
def pytest_collection_modifyitems(items):
  """The tests that use a module-scoped fixture of their own module run on one pytest-xdist worker (--dist=loadgroup,
  pyproject.toml), which builds the fixture once; spread over the workers, each would build it."""
  for item in items:
    info, module = getattr(item, "_fixtureinfo", None), getattr(item, "module", None)
    if info is None or module is None:
      continue
    defs = [d[-1] for d in info.name2fixturedefs.values() if d]
    if any(d.scope == "module" and getattr(d.func, "__module__", None) == module.__name__ for d in defs):
      item.add_marker(pytest.mark.xdist_group(module.__name__))
