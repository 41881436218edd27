"""The gate suite: arms agree bit for bit on the fixed tasks, and a differing arm fails the gate."""

import helpers
import pytest

from jaxkv import gate_suite


@pytest.fixture(scope="module")
def report():
  return gate_suite.run(helpers.tiny_config(), helpers.mesh(2), helpers.params(2), new_tokens=6)


def test_gates_pass_with_one_hash_per_task(report):
  assert report["passed"] and report["exactness"]["passed"] and report["memory"]["passed"]
  tasks = report["exactness"]["tasks"]
  assert len(tasks) >= 8
  assert {1, 7, 8, 9} <= {t["prompt_length"] for t in tasks}  # Block boundaries (block = 8).
  assert max(t["prompt_length"] for t in tasks) == helpers.tiny_config().engine.capacity - 6 + 1  # Near capacity.
  for t in tasks:
    assert set(t["hashes"]) == set(gate_suite.ARMS) and len(set(t["hashes"].values())) == 1
  assert len({next(iter(t["hashes"].values())) for t in tasks}) == len(tasks)  # Tasks differ from each other.
  for arm, m in report["memory"]["arms"].items():
    assert m["ring_high_water_bytes_per_device"] <= m["ring_bytes_per_device_configured"]
    assert (m["ring_high_water_bytes_per_device"] > 0) == (arm != "device")
  par = report["parallel"]
  assert par["passed"] and set(par["transcripts"]) == set(gate_suite.ARMS)
  assert len(set(par["transcripts"].values())) == 1
  assert par["sequences"] == 16 and par["parallel"] == 8 and par["insertions"] >= 1  # Slots were reused.


def test_an_arm_that_differs_fails_the_exactness_gate():
  # A bfloat16 cache on the float32 tiny model changes the logits: the gate must catch it.
  out = gate_suite.run(helpers.tiny_config(), helpers.mesh(1), helpers.params(1), ("device", "host_d1_bfloat16"), 4)
  assert not out["passed"] and not out["exactness"]["passed"]
  assert not any(t["passed"] for t in out["exactness"]["tasks"])
  assert not out["parallel"]["passed"]


def test_capacity_too_small_for_the_tasks_is_a_clear_error():
  import dataclasses  # pylint: disable=g-import-not-at-top

  cfg = helpers.tiny_config()
  small = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, capacity=20))
  with pytest.raises(ValueError, match="too small for the gate tasks"):
    gate_suite.task_lengths(small, 6)
