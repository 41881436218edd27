"""The benchmark (jaxkv.bench.benchmark) end to end on the tiny model over 2 CPU devices, and its skip paths."""

import dataclasses
import json
import os
import statistics
import subprocess
import sys

import helpers
import jax
import pytest
from absl import flags

from experiments import tiny
from jaxkv import chunked
from jaxkv import decode_attention
from jaxkv import mesh as mesh_lib
from jaxkv import residency
from jaxkv import run as run_lib
from jaxkv import transport as transport_lib
from jaxkv.bench import arms
from jaxkv.bench import benchmark
from jaxkv.bench import ceilings
from jaxkv.bench import peer_hf
from jaxkv.bench import report
from jaxkv.config import SplitConfig, from_config_dict
from jaxkv.host import memory

# host_d4_g1: one decode call per layer (the tiny model's 6 layers are one group otherwise, which caps the depth at 0).
ARMS = ("device", "host_d0", "host_d1", "host_d2", "host_d4_g1", "host_d2_int8", "host_d2_int4", "host_d1_ha")
# Bytes per head row at head_dim 32: int8 or int4 values + an f16 scale; f32.
PACKED_ROWS, F32_ROW = {"int8": 32 + 32 // 32 * 2, "int4": 32 // 2 + 32 // 32 * 2}, 32 * 4
ROUNDS = 2
TOP_FIELDS = {
    "command",
    "hardware",
    "config",
    "spec",
    "tensor",
    "h2d_peak",
    "h2d_peak_one_device",
    "peer",
    "complete",
    "cells",
    "plot",
}
CELL_FIELDS = {
    "context",
    "batch",
    "capacity",
    "decode_window_rows",
    "kv_dtype",
    "kv_bytes_per_step_per_device",
    "ceilings_kv_dtype",
    "link_bound_tok_s",
    "ceilings",
    "order",
    "arms",
    "compute_only_ms",
    "transfer_only_ms",
    "tokens_match_across_arms",
}
ARM_FIELDS = {
    "status",
    "reason",
    "samples",
    "warmup",
    "transport",
    "ms_per_step",
    "tok_s",
    "gain_vs_ordered",
    "overlap_ratio",
    "link_efficiency",
    "device_peak_bytes_in_use_process",
    "ring_bytes_per_device_configured",
    "kv_dtype",
    "kv_bytes_per_step_per_device",
    "link_bound_tok_s",
    "x_link_bound",
    "prefill_s",
}
SAMPLE_FIELDS = {
    "round",
    "decode_s",
    "decode_steps",
    "prefill_s",
    "ms_per_step",
    "tok_s",
    "tokens_sha256",
    "device_peak_bytes_in_use_process",
}


def _config():
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8 (tests/conftest.py)")
  cd = tiny.get_config()
  cd.mesh.tensor = 2
  cd.model.head_dim = 32  # int8 and int4 KV need a multiple of 32.
  return from_config_dict(cd)


def _spec(**kw):
  args = dict(
      contexts=(16, 40),
      batches=(2,),
      arms=ARMS,
      new_tokens=8,
      rounds=ROUNDS,
      peer=True,
      peak_bytes=2**20,
      ceiling_reps=2,
  )
  return benchmark.BenchSpec(**dict(args, **kw))


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
  d = tmp_path_factory.mktemp("bench")
  paths = {k: str(d / f"bench.{k}") for k in ("json", "md", "png")}
  benchmark.run(_config(), _spec(), command="pytest", json_out=paths["json"], md_out=paths["md"], plot_out=paths["png"])
  with open(paths["json"]) as f:
    return json.load(f), paths


def test_json_has_every_field(bench):
  out, _ = bench
  assert TOP_FIELDS <= set(out)
  assert out["tensor"] == 2
  assert out["h2d_peak"]["gbps_median"] > 0 and len(out["h2d_peak"]["gbps"]) == 2
  one = out["h2d_peak_one_device"]
  assert one["status"] == "ok" and one["device"] == out["hardware"]["devices"][0] and one["gbps_median"] > 0
  assert out["complete"] is True
  assert out["hardware"]["jax"] == jax.__version__ and out["hardware"]["devices"]
  assert [(c["context"], c["batch"]) for c in out["cells"]] == [(16, 2), (40, 2)]
  for cell in out["cells"]:
    assert CELL_FIELDS <= set(cell)
    assert cell["ceilings"]["window_rows"] == cell["context"]  # Both are multiples of kv.block (8).
    assert cell["ceilings"]["h2d_layer"]["gbps_median"] > 0
    assert cell["ceilings"]["transfer_only"]["ms_median"] > 0
    assert cell["tokens_match_across_arms"] is True
    assert len(cell["order"]) == ROUNDS and cell["order"][1] == cell["order"][0][::-1]
    assert list(cell["arms"]) == [*ARMS, arms.PEER_ARM]


def test_each_arm_has_numbers(bench):
  out, _ = bench
  for cell in out["cells"]:
    for name in ARMS:
      a = cell["arms"][name]
      assert ARM_FIELDS <= set(a), name
      assert a["status"] == "ok", a["reason"]
      assert len(a["samples"]) == ROUNDS and all(SAMPLE_FIELDS <= set(s) for s in a["samples"])
      assert all(s["decode_steps"] == 7 for s in a["samples"])
      assert 0 < a["tok_s"]["min"] <= a["tok_s"]["median"] <= a["tok_s"]["max"]
      check_derived(cell, name)
      assert 0 < a["prefill_s"]["min"] <= a["prefill_s"]["median"] <= a["prefill_s"]["max"]  # Time to first token.
      assert (a["x_link_bound"] is None) == (name == "device")
      assert (a["overlap_ratio"] is None) == name.endswith("_ha")  # Host attention: no plain overlap bound.
      assert (a["link_efficiency"] is None) == (name == "device")
      assert a["kv_dtype"] == next((d for d in PACKED_ROWS if name.endswith(f"_{d}")), "model")
      assert (a["ring_bytes_per_device_configured"] > 0) == (name != "device")
      assert a["transport"]["dispatches_per_step"] >= 4
    # The tiny config's 3 decode groups, the head, and the copies of the tokens and the logits.
    assert cell["arms"]["device"]["transport"]["dispatches_per_step"] == 6
    assert cell["arms"]["host_d2"]["transport"]["depth"] == 2  # Its 3 groups: depth 2 uncapped.
    assert cell["arms"]["host_d4_g1"]["transport"]["depth"] == 4
    assert cell["arms"]["host_d0"]["gain_vs_ordered"] == 1.0
    split = cell["arms"]["host_d1_ha"]["transport"]["host_attention"]
    assert split["source"] == "measured" and cell["arms"]["host_d1_ha"]["delivered_fraction"] == 1 - split["fraction"]
    peer = cell["arms"][arms.PEER_ARM]
    assert peer["status"] == "skipped" and "cpu" in peer["reason"] and not peer["samples"]


@pytest.mark.parametrize("kv_dtype", sorted(PACKED_ROWS))
def test_quantized_arms_move_and_report_the_packed_bytes(bench, kv_dtype):
  """host_d2_int8 streams 34 B per head row (32 int8 + one f16 scale), host_d2_int4 18 B (16 bytes of 4-bit values
  + one f16 scale), where host_d2 streams 128 (f32): their telemetry, bytes per step and link efficiency all use the
  packed bytes."""
  out, _ = bench
  row = PACKED_ROWS[kv_dtype]
  for cell in out["cells"]:
    f32, packed = cell["arms"]["host_d2"], cell["arms"][f"host_d2_{kv_dtype}"]
    assert packed["transport"]["h2d_bytes"] * F32_ROW == f32["transport"]["h2d_bytes"] * row
    assert packed["transport"]["d2h_bytes"] * F32_ROW == f32["transport"]["d2h_bytes"] * row
    assert packed["kv_bytes_per_step_per_device"] * F32_ROW == cell["kv_bytes_per_step_per_device"] * row
    assert f32["kv_bytes_per_step_per_device"] == cell["kv_bytes_per_step_per_device"]
    ceil = cell["ceilings_kv_dtype"][kv_dtype]
    assert ceil["kv_bytes_per_step_per_device"] == packed["kv_bytes_per_step_per_device"]
    assert ceil["transfer_only"]["ms_median"] > 0
    assert ceil["h2d_layer"]["bytes_per_device"] * F32_ROW == cell["ceilings"]["h2d_layer"]["bytes_per_device"] * row
    ms = packed["ms_per_step"]["median"]
    want = packed["kv_bytes_per_step_per_device"] / (ms * 1e-3) / (cell["link_peak_gbps"] * 1e9)
    assert packed["link_efficiency"] == pytest.approx(want)


def check_derived(cell: dict, name: str) -> None:
  """An arm's figures, recomputed from its raw samples and the cell's ceilings (jaxkv.benchmark's module docstring)."""
  a = cell["arms"][name]
  tok_s = statistics.median(cell["batch"] * s["decode_steps"] / s["decode_s"] for s in a["samples"])
  ms = statistics.median(1e3 * s["decode_s"] / s["decode_steps"] for s in a["samples"])
  assert a["tok_s"]["median"] == pytest.approx(tok_s) and a["ms_per_step"]["median"] == pytest.approx(ms)
  ordered = cell["arms"][arms.ORDERED_ARM]["tok_s"]["median"]
  assert a["gain_vs_ordered"] == pytest.approx(tok_s / ordered)
  peak = cell["link_peak_gbps"]
  if name == "device":
    return
  assert a["link_bound_tok_s"] == pytest.approx(cell["batch"] * peak * 1e9 / a["kv_bytes_per_step_in_sequence"])
  assert a["x_link_bound"] == pytest.approx(tok_s / a["link_bound_tok_s"])
  if "residency" in a["transport"]:  # auto: against the planner's prediction, the streamed bytes only.
    plan = a["transport"]["residency"]
    streamed = (
        a["kv_bytes_per_step_per_device"]
        * plan["streamed_layers"]
        / (plan["streamed_layers"] + plan["resident_layers"])
    )
    predicted = residency.predict_step_ms(streamed, peak, cell["compute_only_ms"])
    assert a["streamed_bytes_per_step_per_device"] == pytest.approx(streamed)
    assert a["predicted_ms_per_step"] == pytest.approx(predicted)
    assert a["overlap_ratio"] == pytest.approx(ms / predicted)
    assert a["link_efficiency"] == pytest.approx(streamed / (ms * 1e-3) / (peak * 1e9))
    return
  efficiency = a["kv_bytes_per_step_in_sequence"] / (ms * 1e-3) / (peak * 1e9)
  if "host_attention" in a["transport"]:
    assert a["link_efficiency"] == pytest.approx((1 - a["transport"]["host_attention"]["fraction"]) * efficiency)
    return
  transfer_ms = (cell["ceilings_kv_dtype"].get(a["kv_dtype"]) or cell["ceilings"])["transfer_only"]["ms_median"]
  assert a["overlap_ratio"] == pytest.approx(ms / max(cell["compute_only_ms"], transfer_ms))
  assert a["link_efficiency"] == pytest.approx(efficiency)


def test_markdown_and_plot(bench):
  out, paths = bench
  with open(paths["md"]) as f:
    md = f.read()
  for name in ARMS:
    assert f"| 40 | 2 | {name} |" in md
  row = next(l for l in md.splitlines() if l.startswith("| 40 | 2 | host_d2 |")).split(" | ")
  assert float(row[7]) == round(out["cells"][1]["arms"]["host_d2"]["prefill_s"]["median"], 3)  # The prefill s column.
  assert f"| 16 | 2 | {arms.PEER_ARM} | 0.2 | skipped" in md  # KV MiB/step/device, then the reason.
  assert "| 40 | 2 | int8 | 40 |" in md and "| 40 | 2 | int4 | 40 |" in md  # The packed arms' transfer ceilings.
  assert "| 40 | 2 | host_d1_ha | " in md.split("## Host attention")[1]
  helpers.import_extra("matplotlib", "plot")
  assert out["plot"] == dict(status="ok", path=paths["png"])
  with open(paths["png"], "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_the_bench_app_with_an_auto_arm(tmp_path):
  """python -m jaxkv.bench end to end: an auto arm whose budget holds 3 of the 6 layers, its prediction against its
  measurement, the markdown on stdout and in --md_out, and the PNG."""
  helpers.import_extra("matplotlib", "plot")
  # One layer of the cell's cache on each of 2 devices: K and V x batch 1 x 4 heads x 64 B (16 f32) x 32 rows (the
  # capacity, 16 + 4 rounded up to a block of 8, plus a block).
  layer = 2 * 1 * 4 * 64 * 32
  paths = {k: tmp_path / f"bench.{k}" for k in ("json", "md", "png")}
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  flags = [
      "--cpu_devices=2",
      "--contexts=16",
      "--batches=1",
      "--arms=device,host_d0,auto_d1_g1",  # Residency by layer: the tiny model's automatic group holds all.
      "--new_tokens=4",
      "--rounds=1",
      "--peak_mib=1",
      f"--kv_device_budget_gib={3.5 * layer / 2**30!r}",
      *(f"--{k}_out={p}" for k, p in (("json", paths["json"]), ("md", paths["md"]), ("plot", paths["png"]))),
  ]
  proc = subprocess.run(
      [sys.executable, "-m", "jaxkv.bench", *flags],  # Not imported here: its flags would clash with other apps'.
      cwd=os.path.dirname(os.path.dirname(os.path.abspath(run_lib.__file__))),
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(paths["json"].read_text())
  md = paths["md"].read_text()
  assert out["complete"] and out["tensor"] == 2 and out["plot"]["status"] == "ok" and md.strip() in proc.stdout
  cell = out["cells"][0]
  assert cell["tokens_match_across_arms"] is True
  auto = cell["arms"]["auto_d1_g1"]
  plan = auto["transport"]["residency"]
  assert plan["layer_bytes_per_device"] == layer and plan["budget_source"] == "kv.device_budget_gib"
  assert plan["resident_layers"] == plan["streamed_layers"] == 3 and auto["transport"]["depth"] == 1
  for name in ("device", "host_d0", "auto_d1_g1"):
    check_derived(cell, name)
  assert "## Residency planner (auto arms)" in md
  assert f"| {auto['predicted_ms_per_step']:.2f} | {auto['ms_per_step']['median']:.2f} |" in md
  with open(paths["png"], "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_arm_that_does_not_fit_is_skipped(monkeypatch):
  monkeypatch.setenv(memory.POOL_ENV, "0.000001")  # A ~1 KiB pinned pool: no host cache fits.
  out = benchmark.run(_config(), _spec(contexts=(16,), arms=("device", "host_d1"), new_tokens=3, rounds=1, peer=False))
  cell = out["cells"][0]
  assert "pinned" in cell["ceilings"]["skipped"]
  assert cell["arms"]["device"]["status"] == "ok" and cell["arms"]["device"]["gain_vs_ordered"] is None
  host = cell["arms"]["host_d1"]
  assert host["status"] == "skipped" and "warm-up" in host["reason"] and "pinned" in host["reason"]
  assert host["tok_s"] is None and not host["samples"]
  assert host["device_memory_at_skip"] is None  # The CPU reports no memory stats.
  assert arms.PEER_ARM not in cell["arms"]


_GIB = 2**30


def _auto_arm(resident: int, streamed: int, c_rows: int = 0) -> dict:
  """A finished auto arm of 1M tokens of the 8B (128 GiB of KV) at 1 s a step, `streamed` layers streamed."""
  sample = dict(ms_per_step=1000.0, tok_s=1.0, prefill_s=2.0, tokens_sha256="t")
  return dict(
      status="ok",
      samples=[sample],
      kv_dtype="model",
      kv_bytes_per_step_in_sequence=128 * _GIB,
      kv_bytes_per_step_per_device=128 * _GIB,
      transport=dict(residency=dict(resident_layers=resident, streamed_layers=streamed), delivery_chunk_rows=c_rows),
  )


def _auto_cell(**arms_by_name) -> dict:
  """A cell of those arms alone (no device arm, no ceilings)."""
  return dict(
      arms=arms_by_name,
      batch=1,
      kv_dtype="model",
      kv_bytes_per_step_per_device=128 * _GIB,
      kv_bytes_per_step_in_sequence=128 * _GIB,
      ceilings=dict(skipped="host RAM"),
      ceilings_kv_dtype={},
  )


def test_auto_prediction_without_a_device_arm_is_the_links_term():
  """An auto arm alone in its cell (the device arm does not fit: 1M tokens of bf16 KV on one H200) is predicted
  from its streamed bytes over the link alone, and says that no compute time entered."""
  auto = _auto_arm(20, 12)
  benchmark._summarize(_auto_cell(auto_d2=auto), 50.0)  # pylint: disable=protected-access
  streamed = 48 * _GIB
  assert auto["streamed_bytes_per_step_per_device"] == streamed and auto["predicted_compute_ms"] is None
  assert auto["predicted_ms_per_step"] == pytest.approx(1e3 * streamed / 50e9)
  assert auto["overlap_ratio"] == pytest.approx(1000.0 / auto["predicted_ms_per_step"])


def test_a_chunked_auto_arm_is_predicted_at_the_chunked_link_rate(monkeypatch):
  """An auto arm that streams its windows in chunks gets its prediction's link term from the chunked deliveries'
  rate, measured once per KV dtype and chunk size; arms that stream nothing or whole windows are not measured."""
  calls = []

  def h2d_chunked(model, kv_dtype, mesh, batch, rows, chunk_rows, reps):
    del model, mesh, batch, reps
    calls.append((kv_dtype, rows, chunk_rows))
    return dict(chunk_rows=chunk_rows, gbps_median=40.0)

  monkeypatch.setattr(ceilings, "h2d_chunked", h2d_chunked)
  cell = _auto_cell(
      auto_d2=_auto_arm(24, 8, 1024),
      auto_d1=_auto_arm(24, 8, 1024),
      auto_d2_g2=_auto_arm(24, 8),
      auto_d0=_auto_arm(32, 0, 1024),
  )
  links = benchmark._chunked_links(None, None, 1, 4096, 1, cell["arms"])  # pylint: disable=protected-access
  cell["h2d_chunked"] = links
  assert calls == [("model", 4096, 1024)] and sorted(links) == ["auto_d1", "auto_d2"]
  benchmark._summarize(cell, 50.0)  # pylint: disable=protected-access
  by = cell["arms"]
  assert by["auto_d2"]["predicted_link_gbps"] == by["auto_d1"]["predicted_link_gbps"] == 40.0
  assert by["auto_d2"]["predicted_ms_per_step"] == pytest.approx(1e3 * 32 * _GIB / 40e9)
  assert by["auto_d2_g2"]["predicted_link_gbps"] == 50.0  # Whole windows: the link's peak.
  assert by["auto_d2_g2"]["predicted_ms_per_step"] == pytest.approx(1e3 * 32 * _GIB / 50e9)


def test_h2d_chunked_delivers_a_window_in_the_transport_s_chunks():
  """ceilings.h2d_chunked moves one layer's window (K over the tensor axis) in jaxkv.chunked's chunks and reports the
  window's bytes per device."""
  config = _config()
  mesh = mesh_lib.make_mesh(config.mesh)
  leaf = decode_attention.LEAF_ROWS
  out = ceilings.h2d_chunked(config.model, "int8", mesh, 2, 5 * leaf, 2 * leaf, 2)
  assert out["chunks"] == len(chunked.chunks(5 * leaf, 2 * leaf)) == 3 and out["chunk_rows"] == 2 * leaf
  heads = config.model.num_kv_heads // 2
  assert out["bytes_per_device"] == 2 * 2 * heads * 5 * leaf * PACKED_ROWS["int8"]
  assert len(out["gbps"]) == 2 and out["gbps_median"] > 0


def _layer_config(proportions: str):
  return dataclasses.replace(_config(), split=SplitConfig(mode="layer", layer_split=proportions))


def test_step_bytes_follow_the_split_mode():
  """Tensor: each device receives its half of every layer, both at once; layer (4 + 2 of 6 layers): the fullest
  device receives 4 whole layers and the links carry all 6 in sequence."""
  rows = [16, 24]
  tensor_cfg, layer_cfg = _config(), _layer_config("2,1")
  mesh = mesh_lib.make_mesh(tensor_cfg.mesh)
  t = benchmark.kv_step_bytes(tensor_cfg, run_lib.make_layout(tensor_cfg, mesh), 2, rows)
  assert t["per_device"] == t["in_sequence"] == t["total"] / 2 > 0
  layer = benchmark.kv_step_bytes(layer_cfg, run_lib.make_layout(layer_cfg, mesh), 2, rows)
  assert layer["total"] == layer["in_sequence"] == t["total"] and layer["per_device"] == t["total"] * 4 / 6


def test_bench_in_split_mode_layer():
  """The ceilings put each layer's window to its own stage's device; the link bound uses the bytes in sequence."""
  out = benchmark.run(
      _layer_config("2,1"), _spec(contexts=(16,), arms=("device", "host_d1"), new_tokens=3, rounds=1, peer=False)
  )
  cell = out["cells"][0]
  host = cell["arms"]["host_d1"]
  assert host["status"] == "ok" and cell["tokens_match_across_arms"] is True
  stage0, stage1 = host["transport"]["h2d_bytes_by_device"].values()
  assert stage0 == 2 * stage1 > 0  # 4 layers on the first device, 2 on the second.
  assert cell["ceilings"]["h2d_layer"]["bytes_per_device"] * 6 * 2 == host["transport"]["h2d_bytes"]  # 2 steps.
  assert (
      cell["kv_bytes_per_step_in_sequence"]
      == cell["kv_bytes_per_step_total"]
      == 1.5 * cell["kv_bytes_per_step_per_device"]
  )
  streaming = cell["kv_bytes_per_step_per_device"] / (cell["transfer_only_ms"] * 1e-3) / 1e9  # The fullest device.
  assert cell["link_peak_gbps"] == pytest.approx(max(out["h2d_peak"]["gbps_median"], streaming))
  want = cell["batch"] * cell["link_peak_gbps"] * 1e9 / cell["kv_bytes_per_step_in_sequence"]
  assert cell["link_bound_tok_s"] == pytest.approx(want)


def test_skip_reason():
  assert "pinned" in benchmark.skip_reason(ValueError("needs 3 GiB of pinned host memory"))
  assert benchmark.skip_reason(RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 1 GiB"))
  assert benchmark.skip_reason(peer_hf.PeerError("no CUDA"))
  assert benchmark.skip_reason(ValueError("shapes do not match")) is None
  assert benchmark.skip_reason(TypeError("bug")) is None


def test_arm_names():
  arm = arms.ArmSpec
  assert arms.parse_arm("device") == arm("device")
  assert arms.parse_arm("host_d4") == arm("host", 4)
  assert arms.parse_arm("host_d2_int8") == arm("host", 2, "int8")
  assert arms.parse_arm("device_float8_e4m3fn") == arm("device", None, "float8_e4m3fn")
  assert arms.parse_arm("host_d0_bfloat16") == arm("host", 0, "bfloat16")
  assert arms.parse_arm("host_d2_ha") == arm("host", 2, None, 0.0)
  assert arms.parse_arm("auto_d1_int8_ha35") == arm("auto", 1, "int8", 0.35)
  assert arms.parse_arm("device_g1") == arm("device", group_layers=1)
  assert arms.parse_arm("host_d2_int8_g4") == arm("host", 2, "int8", None, 4)
  assert arms.parse_arm("host_d2_int4") == arm("host", 2, "int4")
  assert arms.parse_arm("device_int4") == arm("device", None, "int4")
  assert arms.parse_arm("auto_d2_int4_ha") == arm("auto", 2, "int4", 0.0)
  assert arms.parse_arm("host_d2_spec") == arm("host", 2, speculate="lookup")
  assert arms.parse_arm("device_g1_spec3") == arm("device", group_layers=1, speculate="oracle", right=3)
  assert arms.parse_arm("host_d2_int4_spec0") == arm("host", 2, "int4", speculate="oracle", right=0)
  assert arms.parse_arm("host_d2_ha_spec3") == arm("host", 2, None, 0.0, speculate="oracle", right=3)
  assert arms.parse_arm("host_d2_self") == arm("host", 2, speculate="self")
  assert arms.parse_arm("host_d2_ha_g1_self") == arm("host", 2, None, 0.0, 1, speculate="self")
  assert arms.arm_config(helpers.tiny_config(head_dim=32), "host_d2_self").speculate.mode == "self"
  bad_names = ("host", "host_d", "device_d1", "hf_offloaded", "host_d2_int2", "host_d2_model", "host_d2int8")
  for bad in bad_names + (
      "device_ha",
      "host_d2_ha00",
      "host_d2_ha5",
      "host_d2_ha_int8",
      "host_d2_g",
      "device_g1_int8",
      "host_d2_self3",
      "host_d2_spec_self",
  ):
    with pytest.raises(ValueError):
      arms.parse_arm(bad)
  cfg = from_config_dict(tiny.get_config())  # head_dim 16: int8 and int4 do not fit, before any work.
  for arm_name in ("host_d2_int8", "device_int4"):
    with pytest.raises(ValueError, match="head_dim"):
      benchmark.run(cfg, _spec(arms=(arm_name,)))


def test_speculative_arms_give_the_plain_arm_s_tokens():
  """host_d2_spec2 (an oracle drafter of 2 right tokens, its truth a plain run's) and host_d2_spec (the lookup
  drafter) generate host_d2's tokens, and report their passes."""
  out = benchmark.run(
      _config(), _spec(contexts=(16,), batches=(1,), arms=("host_d2", "host_d2_spec2", "host_d2_spec"), peer=False)
  )
  cell = out["cells"][0]
  assert cell["tokens_match_across_arms"] is True
  oracle = cell["arms"]["host_d2_spec2"]["transport"]["speculate"]
  assert oracle["accepted"] > 0 and oracle["passes"] < oracle["tokens"] == 7, oracle
  assert cell["arms"]["host_d2_spec"]["transport"]["speculate"]["tokens"] == 7
  assert "speculate" not in cell["arms"]["host_d2"]["transport"]


def test_peer_decodes_on_the_cpu_and_says_why_it_cannot_on_cuda():
  """The peer's worker (torch and transformers, the parity extra) prefills and decodes greedily on the CPU, with a
  plain DynamicCache (offloading needs CUDA); where torch sees no CUDA device, starting it on "cuda" says so."""
  helpers.import_extra("torch", "parity")
  helpers.import_extra("transformers", "parity")
  model = from_config_dict(tiny.get_config()).model
  peer = peer_hf.HFPeer.start(model, 64, device="cpu")
  try:
    assert peer.info["device"] == "cpu" and peer.info["weights_gib"] > 0
    res = peer.generate([[1, 2, 3, 4], [5, 6, 7, 8]], 4)
    assert res["decode_steps"] == 3 and res["decode_s"] > 0 and res["prefill_s"] > 0
    assert res["cache"] == "DynamicCache" and [len(t) for t in res["tokens"]] == [4, 4]
    assert all(0 <= t < model.vocab_size for seq in res["tokens"] for t in seq)
  finally:
    peer.close()
  import torch  # pylint: disable=g-import-not-at-top

  if torch.cuda.is_available():
    return
  with pytest.raises(peer_hf.PeerError, match="sees no CUDA device"):
    peer_hf.HFPeer.start(model, 64)


class _Window:
  """A delivery that records when it was waited for."""

  def __init__(self, log, layer):
    self.log, self.layer = log, layer

  def block_until_ready(self):
    self.log.append(self.layer)
    return self


class _FakeTransport:
  """deliveries hands out windows 0..n-1, one layer a group, and records, after each one's compute, the layers
  waited for so far."""

  def __init__(self, depth, num_layers):
    self.depth, self.num_layers, self.waited, self.seen = depth, num_layers, [], []

  def deliveries(self, next_pass):
    del next_pass
    for l in range(self.num_layers):
      yield transport_lib.Delivery((l,), [_Window(self.waited, l)])
      self.seen.append(list(self.waited))


@pytest.mark.parametrize("depth", [0, 2])
def test_transfer_only_waits_depth_plus_one_behind_and_for_all_at_the_end(depth):
  """compute(l) waits for the delivery depth + 1 layers before it, across passes; the clock waits for every one."""
  t = _FakeTransport(depth, 6)
  assert ceilings.transfer_only_ms(t, passes=2) > 0
  layers = list(range(6)) * 2  # The deliveries of both passes, in order.
  assert [seen[-1] if seen else None for seen in t.seen] == [None] * (depth + 1) + layers[: 12 - depth - 1]
  assert [len(seen) for seen in t.seen] == [max(i - depth, 0) for i in range(12)]
  assert t.waited == layers


def test_synthetic_context_skips_all_but_the_last_prefill_chunk(monkeypatch):
  """With synthetic_context every jaxkv sample stores the rows below the last chunk as zeros (16-row chunks: 32 of
  a 40-token context) and the report says so."""
  seen = []
  generate = benchmark.Engine.generate

  def spy(self, prompts, new_tokens, **kw):
    seen.append(kw["zero_rows"])
    return generate(self, prompts, new_tokens, **kw)

  monkeypatch.setattr(benchmark.Engine, "generate", spy)
  spec = _spec(contexts=(40,), arms=("device", "host_d1"), new_tokens=3, rounds=1, peer=False, synthetic_context=True)
  out = benchmark.run(_config(), spec)
  assert seen == [32] * 4  # A warm-up and a round per arm.
  assert out["spec"]["synthetic_context"] is True and out["cells"][0]["tokens_match_across_arms"] is True
  assert "synthetic context" in report.markdown(out)


def test_the_link_test_is_sized_to_the_run():
  config = _config()
  mesh = mesh_lib.make_mesh(config.mesh)
  small = _spec(contexts=(16, 40), batches=(1, 2))
  assert benchmark.link_test_bytes(config, mesh, small) == benchmark.LINK_TEST_BYTES[0]  # Tiny: the floor.
  big = _spec(contexts=(20_000,), batches=(4,))
  cfg = benchmark.cell_config(config, 20_000, big.new_tokens)
  rows = benchmark.decode_window_rows(20_000, big.new_tokens - 1, cfg.kv.block)[-1:]
  step = benchmark.kv_step_bytes(cfg, run_lib.make_layout(cfg, mesh), 4, rows)["per_device"]
  assert benchmark.LINK_TEST_BYTES[0] < step < benchmark.LINK_TEST_BYTES[1]
  assert benchmark.link_test_bytes(config, mesh, big) == step


def test_the_library_defines_no_flags():
  """Of jaxkv.bench, only the app (__main__) defines flags: the library imports beside any app's flags."""
  assert not [m for m in flags.FLAGS.flags_by_module_dict() if m.startswith("jaxkv.bench")]
