"""The engine with kv.host_attention: rows [0, r1) of every streamed window attended on the host CPU during decode.

Greedy tokens equal the device placement's; logits agree to 1e-5 (the tiny model is f32 and its logits are of
magnitude <= ~4: the split sums each softmax in another order, host blocks of 256 rows merged by exp(lse - max),
which changes each attention output by a few f32 ulps, ~1e-7 relative, carried through 6 layers and the head;
observed <= 3e-6). The mode is deterministic (two runs bitwise equal) and delivers only the tails; the devices
waiting for the host's partials themselves (kv.host_attention_wait "device") gives the same bits.
"""

import dataclasses
import importlib.util
import pathlib
import threading

import helpers
import jax
import numba
import numpy as np
import pytest

from jaxkv import cache as cache_lib
from jaxkv import config as config_lib
from jaxkv import mesh as mesh_lib
from jaxkv import serving
from jaxkv.host import attention as host_attention
from jaxkv.host import decode as host_decode
from jaxkv.host import split as host_split
from jaxkv.host import wait as host_wait
from jaxkv.kv_quant import KVFormat

ROOT = pathlib.Path(__file__).absolute().parent.parent
PROMPTS = helpers.prompts((40, 33, 17, 1))  # Windows of 40..56 rows (block 8): splits at 16 and 24 with f = 0.5.
NEW = 20
FRACTION = 0.5


def split_engine(tensor, **kw):
  kw = dict(placement="host", depth=1, host_attention=True, host_attention_fraction=FRACTION) | kw
  return helpers.engine(tensor, **kw)


def decode_h2d(result):
  """Bytes delivered during decode (the steps after prefill)."""
  return sum(s["h2d_bytes"] for s in result.transport["steps"] if s["kind"] == "decode")


@pytest.mark.parametrize("chunked, attention", [(False, "auto"), (False, "legacy"), (True, "auto")])
def test_tails_grow_into_one_buffer_with_the_bits_of_the_window_split_again(monkeypatch, chunked, attention):
  """Where the open pages fill, a split layer's tail grows into one buffer from its delivery (whole, or 256-row
  chunks of a tail of about 600 rows), and the rows that pass the new split row join the head in pinned host memory
  (KVCache.store_split_tail), the whole window never on the devices: the bits of the window grown whole, moved to
  the devices with its head and split again (HostDecode._growth None); with either decode attention that whole
  tails allow (the legacy one too)."""
  if chunked:  # Windows of 784-840 rows (block 8), split at 200-208 with f = 0.25.
    eng = split_engine(2, depth=2, capacity=864, chunk=256, host_attention_fraction=0.25)
    row = helpers.layer_bytes(eng, 2) // 864
    eng = helpers.with_kv(eng, delivery_chunk_mib=256 * row / 2**20)
    run = lambda: eng.generate(helpers.prompts((800, 790)), 40, keep_logits=True, zero_rows=768)
  else:
    eng = split_engine(2)
    run = lambda: eng.generate(PROMPTS, NEW, keep_logits=True)
  config = dataclasses.replace(eng.config, engine=dataclasses.replace(eng.config.engine, decode_attention=attention))
  eng = type(eng)(config, eng.mesh, eng.params, eng.layout)
  joined, whole = [], []
  store_split_tail, store_tail = cache_lib.KVCache.store_split_tail, cache_lib.KVCache.store_tail
  monkeypatch.setattr(
      cache_lib.KVCache, "store_split_tail", lambda c, l, t, j: joined.append(j) or store_split_tail(c, l, t, j)
  )
  monkeypatch.setattr(cache_lib.KVCache, "store_tail", lambda c, l, t: whole.append(l) or store_tail(c, l, t))
  got = run()
  assert max(joined) > 0 and not whole, (joined, whole)
  assert not chunked or got.transport["delivery_chunk_rows"] == 256
  monkeypatch.setattr(host_decode.HostDecode, "_growth", lambda self, l: None)
  want = run()
  assert whole
  np.testing.assert_array_equal(got.logits, want.logits)
  assert got.tokens == want.tokens


@pytest.mark.parametrize("tensor, depth", [(1, 0), (2, 1), (2, 2), (4, 2)])
def test_split_decoding_matches_the_device_placement(tensor, depth):
  want = helpers.engine(tensor).generate(PROMPTS, NEW, keep_logits=True)
  got = split_engine(tensor, depth=depth).generate(PROMPTS, NEW, keep_logits=True)
  assert got.tokens == want.tokens
  np.testing.assert_allclose(got.logits, want.logits, rtol=0, atol=1e-5)
  split = got.transport["host_attention"]
  assert {k: split[k] for k in ("fraction", "source", "cpu_gbps", "link_gbps")} == dict(
      fraction=FRACTION, source="override", cpu_gbps=None, link_gbps=None
  )
  # The dispatching thread's and the kernel worker's time, per part.
  assert all(split[f"{p}_ms_per_step"] > 0 for p in host_decode.HOST_THREAD_PARTS), split


def test_split_decoding_is_deterministic_and_delivers_the_tails(monkeypatch):
  a, b = split_engine(1, debug=1).generate(PROMPTS, NEW), split_engine(1, debug=1).generate(PROMPTS, NEW)
  assert a.logits_sha256 == b.logits_sha256 and a.tokens == b.tokens
  with monkeypatch.context() as m:  # Polled waits, as where cores are spare (host_decode._poll): the same bits.
    m.setattr(numba.config, "NUMBA_DEFAULT_NUM_THREADS", 1024)
    assert split_engine(1, debug=1).generate(PROMPTS, NEW).logits_sha256 == a.logits_sha256
  # The setting reaches the kernel (the split measurement and decode), and the bits do not depend on it.
  threads = min(2, numba.config.NUMBA_NUM_THREADS)
  c = helpers.with_kv(split_engine(1), host_attention_threads=threads).generate(PROMPTS, NEW)
  assert a.transport["host_attention"]["threads"] == host_attention.ENGINE_THREADS <= 16
  assert c.transport["host_attention"]["threads"] == threads and c.logits_sha256 == a.logits_sha256
  over = helpers.with_kv(split_engine(1), host_attention_threads=numba.config.NUMBA_NUM_THREADS + 1)
  with pytest.raises(ValueError, match="over numba's pool"):
    over.generate(PROMPTS, NEW)
  # Host attention keeps exact windows (jaxkv.cache.window_rows): the rows it saves are counted against exact ones.
  plain = helpers.engine(1, placement="host", depth=1, debug=1)
  plain = helpers.with_kv(plain, window_buckets=0).generate(PROMPTS, NEW)
  assert plain.tokens == a.tokens
  # r1 = floor(f W / 8) 8 <= f W, so at most the fraction is saved; W = 40..56 rows round it to 0.43..0.5.
  saved = 1 - decode_h2d(a) / decode_h2d(plain)
  assert FRACTION - 0.1 < saved <= FRACTION, saved


@pytest.mark.parametrize("cores, polls", [(4, 3), (3, 0)])
def test_the_engine_polls_its_waits_only_with_a_core_to_spare(monkeypatch, cores, polls):
  """Two kernel threads, the dispatching thread and the feeder fit 4 cores: _poll polls until ready (the third
  poll). On 3 it does not poll and leaves the wait to the caller's blocking call."""
  monkeypatch.setattr(numba.config, "NUMBA_DEFAULT_NUM_THREADS", cores)
  calls = []

  def ready():
    calls.append(None)
    return len(calls) == 3

  host_decode._poll(ready, threads=2)
  assert len(calls) == polls


def test_the_split_is_the_models_optimum_and_off_under_its_min_gain():
  """t(f) = max((1 - f) s, c + f k): f* = (s - c) / (s + k); a window whose gain s / t(f*) is under MIN_GAIN streams
  alone (f = 0)."""
  split = host_split.Split("measured", 4, cpu_gbps=40.0, link_gbps=50.0, fixed_ms=0.5)
  w = 100 * 10**6  # s = 2 ms, k = 2.5 ms: f* = 1.5 / 4.5, t = 4/3 ms.
  assert split.share(w) == pytest.approx(1 / 3) and split.gain(w) == pytest.approx(1.5)
  assert split.gain(w, 0.5) == pytest.approx(2 / 1.75)  # Past f*, the kernel's side sets the time.
  assert split.share(25 * 10**6) == 0 and split.gain(25 * 10**6) == 1  # s = c: nothing to gain.
  assert split.share(26 * 10**6) == 0  # s = 0.52 ms: f* = 0.017 > 0, but a gain of 1.017.
  two = dataclasses.replace(split, local=2)  # Two local head shards: the CPU reads both, k doubles.
  assert two.share(w) == pytest.approx(1.5 / 7)
  assert host_split.Split("override", 4, 0.3).share(w) == 0.3


def test_the_measured_split_decides_the_engines_path():
  res = split_engine(2, host_attention_fraction=0.0).generate(PROMPTS, NEW)
  split = res.transport["host_attention"]
  assert split["source"] == "measured" and split["cpu_gbps"] > 0 and split["link_gbps"] > 0 and split["fixed_ms"] > 0
  assert split["local"] == 2 and split["threads"] >= 1  # Two head shards on this process's two devices.
  model = host_split.Split(**{k: split[k] for k in ("source", "threads", "cpu_gbps", "link_gbps", "fixed_ms", "local")})
  assert split["fraction"] == model.share(split["window_bytes"])
  assert split.get("off", False) == (split["fraction"] == 0)
  assert res.tokens == helpers.engine(2).generate(PROMPTS, NEW).tokens


@pytest.mark.parametrize("fixed_ms, on", [(1e3, False), (0.0, True)])
def test_host_attention_turns_itself_off_where_the_model_predicts_no_gain(monkeypatch, fixed_ms, on):
  """A split layer's fixed cost of 1 s: no window gains, host attention is off (streaming's decode groups, streaming's
  bits, `off` in the telemetry). None: the windows split, f* by the model."""
  rates = host_split.Split("measured", 1, cpu_gbps=1.0, link_gbps=1.0, fixed_ms=fixed_ms, local=2)
  monkeypatch.setattr(host_split, "measure", lambda *args: rates)
  stream = helpers.engine(2, placement="host", depth=1, debug=1).generate(PROMPTS, NEW, keep_logits=True)
  got = split_engine(2, host_attention_fraction=0.0, debug=1).generate(PROMPTS, NEW, keep_logits=True)
  split = got.transport["host_attention"]
  assert split.get("off", False) == (not on) and split["fixed_ms"] == fixed_ms
  assert split["fraction"] == (pytest.approx(1 / 3) if on else 0)  # s = k / 2: f* = s / (s + 2 s).
  if on:
    assert got.tokens == stream.tokens and decode_h2d(got) < 0.8 * decode_h2d(stream)
  else:
    assert got.transport["decode_groups"] == stream.transport["decode_groups"]
    assert got.logits_sha256 == stream.logits_sha256 and decode_h2d(got) == decode_h2d(stream)


def test_the_split_is_measured_on_the_kernels_thread(monkeypatch):
  """Only host_attention.WORKER runs the kernel: another thread starting numba's parallel loops would keep a second
  team of threads beside the engine's."""
  threads = []
  attend = host_attention.attend_array

  def recorded(*args, **kw):
    threads.append(threading.current_thread().name)
    return attend(*args, **kw)

  monkeypatch.setattr(host_attention, "attend_array", recorded)
  monkeypatch.setattr(host_split, "SAMPLE_BYTES", 2**20)
  mesh = mesh_lib.make_mesh((("tensor", 2),), jax.devices()[:2])
  host, device = (mesh_lib.sharding(mesh, mesh_lib.CACHE_AXES, kind) for kind in ("pinned_host", "device"))
  split = host_split.measure.__wrapped__(host, device, KVFormat("bfloat16", 64, "float32"), 4, 1)
  assert split.source == "measured" and threads
  assert all(name.startswith("jaxkv-host-attention") for name in threads), threads


def test_auto_placement_splits_only_the_streamed_layers():
  want = helpers.engine(2).generate(PROMPTS, NEW)
  streamed = helpers.engine(2, placement="auto", depth=1, debug=1, group_layers=1)  # Residency by layer.
  # A budget of 0 keeps every layer streamed...
  auto = lambda **kw: helpers.with_kv(streamed, device_budget_gib=0.0, **kw).generate(PROMPTS, NEW)
  plain, split = auto(), auto(host_attention=True, host_attention_fraction=FRACTION)
  assert split.tokens == want.tokens and split.transport["residency"]["resident_layers"] == 0
  assert decode_h2d(split) < 0.6 * decode_h2d(plain)
  # ... and with 3.5 layers' worth, 3 of 6 are resident: only the streamed half moves, split.
  half = helpers.with_kv(streamed, device_budget_gib=helpers.layer_bytes(streamed, len(PROMPTS)) * 3.5 / 2**30)
  plain_half = half.generate(PROMPTS, NEW)
  split_half = helpers.with_kv(half, host_attention=True, host_attention_fraction=FRACTION).generate(PROMPTS, NEW)
  assert split_half.transport["residency"]["resident_layers"] == 3 and split_half.tokens == want.tokens
  assert decode_h2d(split_half) < 0.6 * decode_h2d(plain_half)


def test_the_host_path_makes_the_kernel_views_once_per_head():
  eng = split_engine(2)
  cfg = eng.config
  kv, split = host_decode.plan(cfg.model, cfg.kv, eng.mesh, 2, cfg.engine.capacity)
  cache = helpers.kv_cache(cfg.model, kv, eng.mesh, 2, cfg.engine.capacity, head_share=split.share)
  host = host_decode.HostDecode(eng, cache, split)
  pointers = lambda: [s.data.unsafe_buffer_pointer() for s in cache.heads[0].addressable_shards]

  def store(rows):  # Layer 0's window of `rows` rows, split at r1 = floor(0.5 rows / 8) 8.
    shape = (2, 2, cfg.model.num_kv_heads, rows, cache.row_width)
    cache.store(0, jax.device_put(np.ones(shape, cache.dtype), cache.device_sharding))

  store(32)
  views = host.views(0)
  assert host.views(0) is views  # Made once, then read every decode step.
  assert [raw.ctypes.data for _, raw in views] == pointers() and views[0][1].shape[3] == 16
  store(48)  # r1 moves: a new head, new views.
  moved = host.views(0)
  assert moved is not views and [raw.ctypes.data for _, raw in moved] == pointers() and moved[0][1].shape[3] == 24
  host.forget_views(0)  # Let go (before a slot insert donates the head): made again at the next use.
  assert host.views(0) is not moved and [raw.ctypes.data for _, raw in host.views(0)] == pointers()


@helpers.NEEDS_CXX
@pytest.mark.parametrize("tensor, depth", [(1, 0), (2, 1), (4, 2)])
def test_device_waits_give_the_bits_of_thread_waits(tensor, depth):
  """The devices wait for the host's partial and publish q themselves (jaxkv.host.wait): the same values reach the
  same computations."""
  thread = split_engine(tensor, depth=depth)
  want = thread.generate(PROMPTS, NEW)
  got = helpers.with_kv(thread, host_attention_wait="device").generate(PROMPTS, NEW)
  assert got.logits_sha256 == want.logits_sha256 and got.tokens == want.tokens
  split = got.transport["host_attention"]
  assert all(split[f"{p}_ms_per_step"] > 0 for p in host_decode.HOST_THREAD_PARTS), split
  assert (want.transport["host_attention"]["wait"], split["wait"]) == ("thread", "device")  # "auto" on CPU: thread.


class _Device:

  def __init__(self, platform):
    self.platform = platform


def test_the_auto_wait_is_the_devices_on_one_gpu_in_one_process(monkeypatch):
  gpu = _Device("gpu")
  monkeypatch.setattr(host_wait, "available", lambda: True)
  assert host_decode.devices_wait("auto", {gpu})
  assert not host_decode.devices_wait("auto", {gpu, _Device("gpu")})  # Not measured on several GPUs.
  assert not host_decode.devices_wait("auto", {_Device("cpu")})
  assert not host_decode.devices_wait("thread", {gpu}) and host_decode.devices_wait("device", {_Device("cpu")})
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  assert not host_decode.devices_wait("auto", {gpu})
  monkeypatch.setattr(jax, "process_count", lambda: 1)
  monkeypatch.setattr(host_wait, "available", lambda: False)  # The ops did not build (no C++ compiler).
  assert not host_decode.devices_wait("auto", {gpu})
  with pytest.raises(ValueError, match="did not build"):
    host_decode.devices_wait("device", {gpu})


@helpers.NEEDS_CXX
def test_with_device_waits_generate_waits_for_the_kernels_once(monkeypatch):
  """A pass returns without waiting for its host kernels, so the dispatching thread runs on into the next pass;
  generate waits for them at its end. The thread's wait waits for each layer's kernel."""
  waits, collect = [], host_decode.HostDecode.collect

  def counted(host, raise_error=True):
    waits.append(len(host.pending))
    collect(host, raise_error)

  monkeypatch.setattr(host_decode.HostDecode, "collect", counted)
  thread = split_engine(2)
  want = thread.generate(PROMPTS, NEW)
  assert len(waits) > NEW
  waits.clear()
  got = helpers.with_kv(thread, host_attention_wait="device").generate(PROMPTS, NEW)
  assert len(waits) == 1 and got.logits_sha256 == want.logits_sha256


@pytest.mark.parametrize("wait", ["thread", pytest.param("device", marks=helpers.NEEDS_CXX)])
def test_a_failing_kernel_raises_and_the_next_run_is_clean(monkeypatch, wait):
  """With device waits the worker still signals a failed layer (the devices would wait forever otherwise), and the
  dispatching thread raises the kernel's error."""
  eng = helpers.with_kv(split_engine(2), host_attention_wait=wait)
  want = eng.generate(PROMPTS, 6)
  attend, calls = host_attention.attend_views, []

  def failing(*args, **kwargs):
    calls.append(None)
    if len(calls) == 9:
      raise RuntimeError("the kernel failed")
    return attend(*args, **kwargs)

  with monkeypatch.context() as m:
    m.setattr(host_attention, "attend_views", failing)
    with pytest.raises(RuntimeError, match="the kernel failed"):
      eng.generate(PROMPTS, 6)
  assert eng.generate(PROMPTS, 6).logits_sha256 == want.logits_sha256


@pytest.mark.parametrize("wait", ["thread", pytest.param("device", marks=helpers.NEEDS_CXX)])
def test_slots_serve_with_host_attention(wait):
  reqs = [serving.Request(tuple(p), n) for p, n in zip(helpers.prompts((5, 12, 20, 3, 9, 30)), (6, 3, 9, 4, 7, 5))]
  want = serving.Server(helpers.engine(2), 2).serve(reqs)
  got = serving.Server(helpers.with_kv(split_engine(2), host_attention_wait=wait), 2).serve(reqs)
  assert got.transport["insertions"] >= 1 and got.transport["host_attention"]["kernel_ms_per_step"] > 0
  assert [r.tokens for r in got.results] == [r.tokens for r in want.results]


def held_merge_probe():
  spec = importlib.util.spec_from_file_location("probe", ROOT / "tools" / "probe_held_merge.py")
  probe = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(probe)
  return probe


def test_a_carried_merge_gives_the_bits_of_merge_then_query(monkeypatch):
  """bf16, where fusing the merge into the query's program could otherwise keep x wider than the merge returns."""
  eng = split_engine(1, cfg=helpers.tiny_config(dtype="bfloat16"))
  carried = eng.generate(PROMPTS, NEW, keep_logits=True)
  monkeypatch.setattr(host_decode.HostDecode, "decode_layer", held_merge_probe()._alone)
  alone = eng.generate(PROMPTS, NEW, keep_logits=True)
  assert carried.logits_sha256 == alone.logits_sha256 and carried.tokens == alone.tokens


def test_the_held_merge_probe_compares_the_same_tokens():
  probe = held_merge_probe()
  rows = probe.run([(2, 0.5)], ctx=40, new=6, rounds=2, threads=0)
  assert [r["variant"] for r in rows] == ["carried", "alone", "alone", "carried"]
  assert len({r["tokens_sha256"] for r in rows}) == 1 and all(r["ms_per_step"] > 0 for r in rows)
  assert host_decode.HostDecode.decode_layer is probe._CARRIED  # Restored.


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(placement="device", host_attention=True), "needs kv.placement host or auto"),
        (dict(placement="host", host_attention_fraction=0.5), "set kv.host_attention too"),
        (dict(placement="host", host_attention=True, host_attention_fraction=1.0), r"must be in \[0, 1\)"),
        (dict(placement="host", host_attention=True, host_attention_fraction=-0.1), r"must be in \[0, 1\)"),
        (dict(placement="host", host_attention=True, host_attention_threads=-1), "must be >= 0"),
        (dict(placement="host", host_attention=True, host_attention_wait="gpu"), "must be one of"),
    ],
)
def test_bad_settings_are_refused(fields, message):
  with pytest.raises(ValueError, match=message):
    dataclasses.replace(helpers.tiny_config().kv, **fields)
  with pytest.raises(ValueError, match=message):
    config_lib.KVConfig(**fields)
