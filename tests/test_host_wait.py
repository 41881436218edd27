"""jaxkv.host.wait on simulated CPU devices: calls that wait for the host's signal copy what the host wrote for them,
and calls that publish reach the host, each device its own shard; slots are checked, freed and reused.

The ops build with the system's C++ compiler: without one (no g++, no $CXX) these tests are skipped, saying so.
"""

import gc
import threading
import time

import helpers
import jax
import numpy as np
import pytest

from jaxkv.host import attention as host_attention
from jaxkv.host import wait as host_wait

P = jax.sharding.PartitionSpec
SHAPE = (2, 8, 3, 5)  # Sharded on axis 1 over 1, 2, 4 or 8 devices.
pytestmark = helpers.NEEDS_CXX


def shardings(n):
  mesh = jax.make_mesh((n,), ("k",), devices=jax.devices()[:n])
  return (
      jax.sharding.NamedSharding(mesh, P(None, "k"), memory_kind="pinned_host"),
      jax.sharding.NamedSharding(mesh, P(None, "k")),
  )


def host_array(pinned):
  arr = jax.device_put(np.zeros(SHAPE, np.float32), pinned)
  return arr, host_attention.shard_views(arr, writable=True)


def test_the_ops_build():
  assert host_wait.available()


@pytest.mark.parametrize("n", helpers.MESH_SIZES)
def test_a_waiting_call_copies_what_the_host_signalled_for_it(n):
  """Three calls are dispatched before their data exist; a host thread writes each call's data and signals it once
  the previous call is done. (The CPU may run a small call on the dispatching thread: it waits there.)"""
  pinned, on_devices = shardings(n)
  arr, views = host_array(pinned)
  slot = host_wait.Slot(arr)
  add = jax.jit(lambda x: host_wait.wait(slot.id, SHAPE, on_devices) + x, out_shardings=on_devices)
  x = jax.device_put(np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE), on_devices)
  data = [np.random.default_rng(k).random(SHAPE, np.float32) + 1 for k in range(3)]  # Never the zeros there first.
  calls = []

  def host():
    for k in range(3):
      time.sleep(0.05)
      for index, view in views:
        view[...] = data[k][index]
      slot.signal()
      while len(calls) <= k or not calls[k].is_ready():  # Call k has copied: the array may change.
        time.sleep(0.001)

  writer = threading.Thread(target=host)
  writer.start()
  for _ in range(3):
    calls.append(add(x))
  writer.join()
  for k, call in enumerate(calls):
    np.testing.assert_array_equal(np.asarray(call), data[k] + np.asarray(x))


@pytest.mark.parametrize("n", helpers.MESH_SIZES)
def test_a_publishing_call_reaches_the_host(n):
  pinned, on_devices = shardings(n)
  arr, views = host_array(pinned)
  slot = host_wait.Slot(arr)

  def double(x):
    return host_wait.publish(x * 2, slot.id, on_devices) + 1  # Returns its operand.

  double = jax.jit(double, out_shardings=on_devices)
  for k in range(3):
    data = np.random.default_rng(k).random(SHAPE, np.float32)
    out = double(jax.device_put(data, on_devices))
    slot.wait()
    np.testing.assert_array_equal(np.asarray(out), data * 2 + 1)
    got = np.zeros(SHAPE, np.float32)
    for index, view in views:
      got[index] = view
    np.testing.assert_array_equal(got, data * 2)
  with pytest.raises(TimeoutError, match="did not publish"):  # Nothing more was published.
    slot.wait(timeout_s=0.05)


def test_slots_are_checked_freed_and_reused():
  pinned, on_devices = shardings(2)
  a, b = host_wait.Slot(host_array(pinned)[0]), host_wait.Slot(host_array(pinned)[0])
  assert a.id != b.id
  freed = a.id
  del a
  gc.collect()
  c = host_wait.Slot(host_array(pinned)[0])
  assert c.id == min(freed, b.id)  # The lowest free id: the calls compiled for it are reused.
  wrong_shape = jax.jit(lambda: host_wait.wait(c.id, (2, 8, 3, 6), on_devices), out_shardings=on_devices)
  with pytest.raises(Exception, match="bytes"):
    jax.block_until_ready(wrong_shape())
  unset = max(set(range(64)) - {b.id, c.id})
  with pytest.raises(Exception, match="no entry"):
    jax.block_until_ready(jax.jit(lambda: host_wait.wait(unset, SHAPE, on_devices), out_shardings=on_devices)())
