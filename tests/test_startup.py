"""What jaxkv sets before JAX's backend starts (jaxkv.host.startup): JAX's memory fraction and the pinned pool's cap."""

import pytest

from experiments import llama3_8b
from jaxkv import cache as cache_lib
from jaxkv import config as config_lib
from jaxkv import residency
from jaxkv.host import memory
from jaxkv.host import startup

GIB = 2**30
H100, H200 = [81559 * 2**20], [143771 * 2**20]  # Their memory as NVML reports it.


def test_the_pinned_pool_is_capped_at_what_the_plan_streams_on_the_devices_found(monkeypatch):
  """The memory fraction for auto, CUDA's stream-ordered allocator where it streams, and the pinned pool's cap to
  the layers that the 8B's 1M bf16 cache streams on the device found (its plan, a layer more), not the whole cache:
  on an 80 GiB H100 24 of 32 layers and one in flight (100 GiB), under a 128 GiB host's RAM; on an H200 under the
  64 GiB default (no cap set). Unknown devices: the whole cache (134 GiB). What the user set is kept."""
  c = config_lib.from_config_dict(llama3_8b.get_config())
  cfg = c.model
  auto = startup.CacheNeed(config_lib.KVConfig(placement="auto"), 1, 2**20, c.engine.prefill_chunk)
  layer = 4 * GIB + cache_lib.row_bytes(cfg, "model", 1) * 256
  assert auto.layer_bytes(cfg) == layer and -(-25 * layer // GIB) + 1 == 102
  monkeypatch.setattr(memory, "available_host_bytes", lambda: 120 * GIB)
  env = {}
  auto_env = {startup.MEM_FRACTION_ENV: "0.95", startup.ALLOCATOR_ENV: "cuda_async"}
  assert startup.startup_env(cfg, [auto], H100, env) == dict(auto_env, **{memory.POOL_ENV: "102"}) == env
  assert startup.startup_env(cfg, [auto], H200, {}) == auto_env
  assert startup.startup_env(cfg, [auto], H200, {startup.ALLOCATOR_ENV: "bfc"}) == {startup.MEM_FRACTION_ENV: "0.95"}
  env = {startup.MEM_FRACTION_ENV: "0.9"}
  assert startup.startup_env(cfg, [auto], None, env) == {memory.POOL_ENV: "134"}
  assert env[startup.MEM_FRACTION_ENV] == "0.9"
  budget = startup.CacheNeed(config_lib.KVConfig(placement="auto", device_budget_gib=100.0), 1, 2**20)
  assert budget.streamed_layers(cfg, H100, 0.95) == 32 - 24 + 1  # 100 GiB hold 24 windows; the device is not asked.
  fits = startup.CacheNeed(config_lib.KVConfig(placement="auto"), 1, 2**17, c.engine.prefill_chunk)  # 128k: 16 GiB.
  assert startup.startup_env(cfg, [fits], H200, {}) == {startup.MEM_FRACTION_ENV: "0.95"}  # XLA's allocator kept.
  device = startup.CacheNeed(config_lib.KVConfig(), 1, 2**20)
  small = startup.CacheNeed(config_lib.KVConfig(placement="host"), 1, 2**15)
  assert startup.startup_env(cfg, [device, small], H100, {}) == {}  # Nothing streamed; a pool under the default.


def test_the_early_plan_streams_a_layer_more_than_the_cache_s_own():
  """With up to EARLY_PLAN_MARGIN_BYTES of runtime arrays beside the weights when the cache is planned, its plan
  streams a layer less than the plan made before JAX starts, with and without host attention."""
  c = config_lib.from_config_dict(llama3_8b.get_config())
  cfg, chunk = c.model, c.engine.prefill_chunk
  for host_attention in (False, True):
    kv = config_lib.KVConfig(placement="auto", host_attention=host_attention)
    groups = residency.decode_groups((0,) * cfg.num_layers, 1)
    for total in H100 + H200:
      free = int(0.95 * total) - 2 * cfg.num_params() - startup.EARLY_PLAN_MARGIN_BYTES
      at_cache = residency.auto_plan(cfg, kv, 1, 2**20, chunk, groups, 1, free)
      early = startup.CacheNeed(kv, 1, 2**20, chunk).streamed_layers(cfg, [total], 0.95)
      assert early == cfg.num_layers - at_cache.resident_layers + 1 > 1


def test_a_cache_the_host_cannot_hold_is_refused_before_jax_starts(monkeypatch):
  """One line naming the GiB, the streamed layers and the RAM, where the early plan (known devices) or placement host
  streams more than MemAvailable; with unknown devices auto's cache checks its own plan later."""
  c = config_lib.from_config_dict(llama3_8b.get_config())
  auto = startup.CacheNeed(config_lib.KVConfig(placement="auto"), 1, 2**20, c.engine.prefill_chunk)
  host = startup.CacheNeed(config_lib.KVConfig(placement="host"), 1, 2**19)
  monkeypatch.setattr(memory, "available_host_bytes", lambda: 64 * GIB)
  with pytest.raises(
      ValueError, match=r"^the host KV cache needs 100\.02 GiB .*\(24 streamed layers .* 64\.00 GiB of RAM"
  ):
    startup.startup_env(c.model, [auto], H100, {})
  with pytest.raises(ValueError, match=r"needs 66\.03 GiB .*\(32 streamed layers .* 64\.00 GiB of RAM"):
    startup.startup_env(c.model, [host], None, {})
  assert startup.startup_env(c.model, [auto], None, {}) == {startup.MEM_FRACTION_ENV: "0.95", memory.POOL_ENV: "134"}
