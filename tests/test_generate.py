"""The generate app end to end (a subprocess: --cpu_devices must act before JAX starts)."""

import json
import os
import subprocess
import sys

import pytest

from jaxkv import generate as generate_app

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(generate_app.__file__)))  # Holds the jaxkv package.


def _generate(tmp_path, name, *flags):
  out = tmp_path / f"{name}.json"
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  proc = subprocess.run(
      [sys.executable, "-m", generate_app.__name__, "--cpu_devices=2", f"--json_out={out}", *flags],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout, json.loads(out.read_text())


def test_json_shows_equal_hashes_for_device_and_host_pipelined(tmp_path):
  out_dev, dev = _generate(tmp_path, "device", "--kv_placement=device")
  # One call per layer (the tiny model's 6 layers are one group otherwise, which caps the depth at 0).
  host_flags = ("--kv_placement=host", "--kv_pipeline_depth=2", "--kv_transport_debug=1", "--config.kv.group_layers=1")
  _, host = _generate(tmp_path, "host", *host_flags)
  assert (dev["tokens_sha256"], dev["logits_sha256"]) == (host["tokens_sha256"], host["logits_sha256"])
  assert dev["tokens"] == host["tokens"] and [len(t) for t in dev["tokens"]] == [16] * 4
  assert len(dev["devices"]) == 2
  assert dev["config"]["kv"]["placement"] == "device" and host["config"]["kv"]["placement"] == "host"
  assert host["transport"]["depth"] == 2 and host["transport"]["h2d_bytes"] > 0 and host["transport"]["steps"]
  assert dev["transport"]["dispatches_per_step"] == 4 and len(host["transport"]["decode_groups"]) == 6
  assert f"logits_sha256 {dev['logits_sha256']}" in out_dev and "sequence 3 (prompt 9 tokens)" in out_dev


def test_bad_flags_are_usage_errors(tmp_path):
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  for flags, match in (
      (["--prompt_len=3,x"], "comma-separated integers"),
      (["--batch=3", "--prompt_len=1,2"], "--batch=3"),
      (["--sequences=4", "--parallel=0"], "--parallel >= 1"),
  ):
    proc = subprocess.run(
        [sys.executable, "-m", generate_app.__name__, "--cpu_devices=1", *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0 and match in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("override", ["--config.model.num_layers=2"])
def test_config_fields_are_overridable(tmp_path, override):
  _, out = _generate(tmp_path, "override", override, "--max_new_tokens=3")
  assert out["config"]["model"]["num_layers"] == 2 and [len(t) for t in out["tokens"]] == [3] * 4


def test_sequences_are_served_on_parallel_slots(tmp_path):
  flags = ("--sequences=6", "--parallel=2", "--prompt_len=20", "--max_new_tokens=6")
  stdout, dev = _generate(tmp_path, "serve_device", *flags, "--kv_placement=device")
  _, host = _generate(tmp_path, "serve_host", *flags, "--kv_placement=host", "--kv_pipeline_depth=1")
  assert dev["transcript_sha256"] == host["transcript_sha256"]
  assert len(dev["requests"]) == 6 and dev["transport"]["insertions"] + 2 * (dev["transport"]["epochs"] - 1) >= 4
  for r in dev["requests"]:
    assert 1 <= r["prompt_length"] <= 20 and 3 <= len(r["tokens"]) == r["max_new_tokens"] <= 6
  assert f"transcript_sha256 {dev['transcript_sha256']}" in stdout and "request 5 (prompt" in stdout
