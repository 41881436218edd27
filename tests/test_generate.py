"""The generate app end to end (processes of their own: --cpu_devices must act before JAX starts)."""

import json

import helpers
import pytest

from experiments import common
from experiments import tiny
from jaxkv import generate as generate_app
from jaxkv.apps import runs

# The README's exactness commands, as written (the default 4 devices, the default model).
README_EXACTNESS = (
    ("--kv_placement=device",),
    ("--kv_placement=host", "--kv_pipeline_depth=0"),
    ("--kv_placement=host", "--kv_pipeline_depth=2"),
)
SERVE = ("--sequences=6", "--parallel=2", "--prompt_len=20", "--max_new_tokens=6")
TEXT_PROMPTS = ["w5 w6 w7", "w9 w10 w11 w12 w13 w14 w15 w16 w17 w18"]
LAYER_SPLIT = ("--split_mode=layer", "--layer_split=2,1", "--kv_placement=host", "--kv_pipeline_depth=1")


@pytest.fixture(scope="module")
def apps(tmp_path_factory):
  """Every generate run of this module, forked from one process that imported the library (helpers.fork_apps), two at
  a time: (name -> (exit status, stdout, stderr, JSON output or None), the folder of the checkpoint with a tokenizer).
  """
  tmp = tmp_path_factory.mktemp("generate")
  hf, hf32 = helpers.hf_config(), helpers.hf_config(head_dim=32)  # head_dim 32: int8 KV (the default model's is 16).
  ckpt = helpers.write_checkpoint(tmp / "ckpt", hf, helpers.hf_tensors(hf))
  helpers.write_tokenizer(ckpt)
  ckpt32 = helpers.write_checkpoint(tmp / "ckpt32", hf32, helpers.hf_tensors(hf32))
  devices = ("--cpu_devices=2",)  # run_app's; the README's commands run on the app's default.
  flags = {f"readme{i}": f for i, f in enumerate(README_EXACTNESS)}
  flags |= {
      "override": (*devices, "--config.model.num_layers=2", "--capacity=640", "--max_new_tokens=3"),
      "serve_device": (*devices, *SERVE, "--kv_placement=device"),
      "serve_host": (*devices, *SERVE, "--kv_placement=host", "--kv_pipeline_depth=1"),
      "few1": (*devices, "--sequences=1", "--parallel=8", "--max_new_tokens=4"),
      "few8": (*devices, "--sequences=8", "--parallel=8", "--max_new_tokens=4"),
      "int8": (*devices, f"--checkpoint_dir={ckpt32}", "--kv_dtype=int8", "--max_new_tokens=3"),
      "ckpt": (
          *devices,
          f"--checkpoint_dir={ckpt}",
          *(f"--prompt={p}" for p in TEXT_PROMPTS),
          "--max_new_tokens=5",
          "--checkpoint_dtype=bfloat16",
          "--kv_placement=host",
      ),
      "layer": (*devices, *LAYER_SPLIT, "--prompt_len=9,3", "--max_new_tokens=6"),
  }
  argv = {name: ["-m", generate_app.__name__, *f, f"--json_out={tmp / name}.json"] for name, f in flags.items()}
  out = {}
  for name, (status, stdout, stderr, _) in helpers.fork_apps(tmp / "runs", argv).items():
    path = tmp / f"{name}.json"
    out[name] = (status, stdout, stderr, json.loads(path.read_text()) if path.exists() else None)
  return out, ckpt


def _run(apps, name) -> tuple[str, dict]:
  """A run that exited 0: its stdout and JSON output."""
  status, stdout, stderr, out = apps[0][name]
  assert status == 0 and out is not None, stderr[-3000:]
  return stdout, out


def test_the_readme_exactness_commands_give_one_pair_of_hashes_at_the_depths_they_name(apps):
  runs_ = [_run(apps, f"readme{i}") for i in range(len(README_EXACTNESS))]
  for i in range(len(README_EXACTNESS)):
    stderr = apps[0][f"readme{i}"][2]
    assert "kv pipeline" not in stderr, stderr[-3000:]  # Nothing capped or lowered.
  (out_dev, dev), (_, ordered), (_, host) = runs_
  assert len({(r["tokens_sha256"], r["logits_sha256"]) for _, r in runs_}) == 1
  assert [len(t) for t in dev["tokens"]] == [16] * 4 and len(dev["devices"]) == 4
  # The default model's 3 decode groups: depth 2 runs at depth 2, over a ring of 4 groups.
  assert host["transport"]["decode_groups"] == [[0, 1], [2, 3], [4, 5]]
  assert (host["transport"]["depth"], host["transport"]["ring_slots"], host["transport"]["fallback_reason"]) == (
      2,
      4,
      None,
  )
  assert ordered["transport"]["depth"] == 0 and host["transport"]["h2d_bytes"] > 0
  assert dev["transport"]["dispatches_per_step"] == 6  # 3 group calls, the head, the tokens' and logits' copies.
  assert f"logits_sha256 {dev['logits_sha256']}" in out_dev and "sequence 3 (prompt 9 tokens)" in out_dev
  assert "kv placement device, nothing streamed," in out_dev  # No depth where no ring delivers.
  # Peak memory: no device stats on CPU; this process's resident set, printed as in the JSON.
  m = dev["memory"]
  assert m["device_peak_bytes"] is None and m["host_peak_rss_bytes"] > 2**20
  assert f"peak memory: host RSS {m['host_peak_rss_bytes'] / 2**30:.1f} GiB" in out_dev


def test_config_fields_and_the_capacity_are_overridable(apps):
  _, out = _run(apps, "override")
  assert out["config"]["model"]["num_layers"] == 2 and [len(t) for t in out["tokens"]] == [3] * 4
  assert out["config"]["engine"]["capacity"] == 640


def test_sequences_are_served_on_parallel_slots(apps):
  (stdout, dev), (_, host) = _run(apps, "serve_device"), _run(apps, "serve_host")
  assert dev["transcript_sha256"] == host["transcript_sha256"]
  assert len(dev["requests"]) == 6 and dev["transport"]["insertions"] + 2 * (dev["transport"]["epochs"] - 1) >= 4
  for r in dev["requests"]:
    assert 1 <= r["prompt_length"] <= 20 and 3 <= len(r["tokens"]) == r["max_new_tokens"] <= 6
  assert f"transcript_sha256 {dev['transcript_sha256']}" in stdout and "request 5 (prompt" in stdout
  assert f"peak memory: host RSS {dev['memory']['host_peak_rss_bytes'] / 2**30:.1f} GiB" in stdout


@pytest.mark.parametrize("sequences", [1, 8])
def test_fewer_or_as_many_requests_as_slots_report_no_reuse(apps, sequences):
  stdout, out = _run(apps, f"few{sequences}")
  assert len(out["requests"]) == sequences and out["transport"]["insertions"] == 0
  assert out["transport"]["epochs"] == 1 and {r["epoch"] for r in out["requests"]} == {0}
  assert "0 slot reuses, 1 epochs" in stdout


def test_kv_int8_runs_with_a_checkpoint_whose_head_dim_allows_it(apps):
  _, out = _run(apps, "int8")  # The default config's model (head_dim 16) is replaced.
  assert out["model"]["head_dim"] == 32 and out["config"]["kv"]["dtype"] == "int8"
  assert [len(t) for t in out["tokens"]] == [3] * 4


def test_a_checkpoint_with_text_prompts_and_a_dtype(apps):
  """--checkpoint_dir with two --prompt and --checkpoint_dtype: the tokenizer's ids, the decoded text printed, and
  the same bits as the library's generate_checkpoint on the same 2 devices."""
  stdout, out = _run(apps, "ckpt")
  path = apps[1]
  assert out["model"]["dtype"] == "bfloat16" and out["model"]["num_layers"] == 3 and out["checkpoint_dir"] == path
  assert out["prompts"] == TEXT_PROMPTS and out["prompt_tokens"] == [[1, 5, 6, 7], [1, *range(9, 19)]]
  inverse = {i: w for w, i in helpers.WORDS.items()}
  for toks, text in zip(out["tokens"], out["text"]):
    assert len(toks) == 5 and text == " ".join(inverse[t] for t in toks if t != 1)
    assert f"  output: {text}" in stdout
  cd = common.base_config()  # Without --config, a checkpoint runs with the engine's defaults.
  cd.mesh.tensor = 2
  want = runs.generate_checkpoint(cd, path, prompts=TEXT_PROMPTS, max_new_tokens=5, seed=0, dtype="bfloat16")
  assert (out["tokens_sha256"], out["logits_sha256"]) == (want["tokens_sha256"], want["logits_sha256"])


def test_split_mode_layer(apps):
  """--split_mode=layer --layer_split=2,1: 4 layers on the first device and 2 on the second, each streaming its own
  layers' windows, with the bits of the library's device placement in the same layout."""
  stdout, out = _run(apps, "layer")
  assert out["config"]["split"] == dict(mode="layer", layer_split="2,1") and "kv placement host" in stdout
  first, second = out["transport"]["h2d_bytes_by_device"].values()
  assert first == 2 * second > 0
  cd = tiny.get_config()
  cd.mesh.tensor = 2
  cd.split.update(mode="layer", layer_split="2,1")
  want = runs.generate_random(cd, [9, 3], 6, 0)
  assert want["transport"]["h2d_bytes"] == 0
  assert (out["tokens_sha256"], out["logits_sha256"]) == (want["tokens_sha256"], want["logits_sha256"])
