"""tests/conftest.py releases a test process's compiled programs before XLA:CPU's kernels use up its memory mappings
(vm.max_map_count), where jaxlib dies with a segmentation fault inside a compile."""

import conftest
import jax
import jax.numpy as jnp
import pytest

PROGRAMS = 40


@pytest.fixture
def maps():
  if conftest.memory_maps() is None:
    pytest.skip("this system does not list a process's memory mappings in /proc/self/maps (Linux does)")
  return conftest.memory_maps


def _compiled_programs(n: int, first: int = 0) -> list:
  """n jitted functions, each compiled (k is a constant of its program); kept alive, as jaxkv's functions are."""
  x = jnp.arange(64.0)
  fns = [jax.jit(lambda a, k=k: jnp.sin(a * k) + jnp.cumsum(a) / (k + 1)) for k in range(first, first + n)]
  for f in fns:
    f(x).block_until_ready()
  return fns


def test_compiled_programs_hold_mappings_that_the_release_returns(maps):
  warm = _compiled_programs(1, PROGRAMS)  # The runtime's own first mappings (thread pools), before counting.
  before = maps()
  fns = _compiled_programs(PROGRAMS)
  grown = maps() - before
  assert grown >= PROGRAMS  # At least one mapping per compiled program.
  assert conftest.release_compiled_programs_over(limit=10**9) is None  # Far under the cap: nothing released.
  assert maps() - before >= grown - 4
  note = conftest.release_compiled_programs_over(limit=2 * before)  # Over half of this cap: released.
  assert note is not None and "released the compiled programs" in note
  assert maps() - before < grown / 2
  assert [f(jnp.arange(64.0)).shape for f in warm + fns[:1]] == [(64,), (64,)]  # They recompile when called.
