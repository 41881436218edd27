"""The tools/check_*.py scripts' bench runs: `python3 -m jaxkv.bench` (or another app writing --json_out) in a child
process (the script itself starts no JAX backend), bounded in time, and its JSON read back."""

from __future__ import annotations

import json
import os
import subprocess
import time


def run(cmd: list[str], json_out: str, timeout_s: float, done: str = "cells") -> tuple[dict, int | str, float]:
  """Runs `cmd` (a command writing --json_out=json_out); returns its JSON (with "error": the exit status and its
  stderr's tail where it failed or its JSON has no `done` key: a bench's cells), the exit status ("timeout" past
  timeout_s) and the wall seconds."""
  t0 = time.perf_counter()
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    rc, tail = proc.returncode, proc.stderr[-3000:]
  except subprocess.TimeoutExpired as e:
    rc, tail = "timeout", (e.stderr or b"")[-3000:].decode(errors="replace")
  wall = time.perf_counter() - t0
  out = {}
  if os.path.exists(json_out):
    with open(json_out) as f:
      out = json.load(f)
  if rc != 0 or not out.get(done):
    out["error"] = f"exit {rc} after {wall:.0f} s: {tail[-1500:]}"
  return out, rc, wall
