"""An HTTP server (jaxkv.serving.api) on a free localhost port in the test process, or the app
(`python3 -m jaxkv.serve`) in a process of its own, for the server's tests."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
import traceback
import warnings

import httpx

from jaxkv import serving
from jaxkv.bench import serve_load
from jaxkv.serving import access as access_lib
from jaxkv.serving import api as serve_api

START_S = 60.0  # Bound on the server's start, and on its stop.
SLOW_STOP_S = 10.0  # A stop still running after this is reported with its threads' stacks (a warning).
REASONS = ("eos", "stop", "length", "cancelled", "error")  # jaxkv_requests_total's.


@contextlib.contextmanager
def running(
    engine,
    *,
    parallel: int = 8,
    max_queue: int = 64,
    name: str = "tiny",
    tokenizer=None,
    template=None,
    eos_ids=frozenset(),
    start_loop: bool = True,
    prefix_cache_bytes: int = 0,
    access=None,
    slot_save_path=None,
):
  """Serves `engine` on 127.0.0.1 (a port the OS picks; access: its API key and CORS origins, default none; slot files
  in slot_save_path, default none); yields (base url, Model); stops the server and the loop."""
  loop = serving.ServingLoop(serving.Server(engine, parallel, prefix_cache_bytes), max_queue)
  if start_loop:
    loop.start()
  model = serve_api.Model(name, loop, tokenizer, template, eos_ids)
  access = access_lib.Access() if access is None else access
  app = serve_api.make_app(model, access=access, slot_save_path=slot_save_path)
  server = serve_api.uvicorn_server(app, "127.0.0.1", 0)
  thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
  thread.start()
  t0 = time.monotonic()
  while not server.started:
    if not thread.is_alive() or time.monotonic() - t0 > START_S:
      raise RuntimeError("the test server did not start")
    time.sleep(0.02)
  port = server.servers[0].sockets[0].getsockname()[1]
  try:
    yield f"http://127.0.0.1:{port}", model
  finally:
    server.should_exit = True
    report = threading.Timer(SLOW_STOP_S, _report_slow_stop)
    report.start()
    thread.join(START_S)
    loop.stop(START_S)
    report.cancel()


def _report_slow_stop() -> None:
  """Warns with the stacks of the server's threads (uvicorn's, the serving loop's) while their stop takes long."""
  frames = sys._current_frames()  # pylint: disable=protected-access
  stacks = [
      f"{t.name}:\n" + "".join(traceback.format_stack(frames[t.ident])[-8:])
      for t in threading.enumerate()
      if t.ident in frames and t.name in ("uvicorn", "jaxkv-engine")
  ]
  warnings.warn(f"the test server still stops {SLOW_STOP_S:.0f} s after should_exit; " + "\n".join(stacks))


free_port = serve_load.free_port


@contextlib.contextmanager
def app(*flags: str, start_s: float = 600.0):
  """`python3 -m jaxkv.serve --port=P *flags` in a process of its own (its own simulated devices), healthy; yields
  (base url, the process); kills it at the end."""
  url = f"http://127.0.0.1:{free_port()}"
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  cmd = [sys.executable, "-m", "jaxkv.serve", f"--port={url.rsplit(':', 1)[1]}", *flags]
  proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    serve_load.wait_healthy(url, proc, start_s)
    yield url, proc
  finally:
    proc.kill()
    proc.wait()


def metrics(url: str) -> dict[str, float]:
  """The server's /metrics as {name{labels}: value}."""
  text = httpx.get(url + "/metrics", timeout=START_S).text
  return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))}


def finished(url: str) -> tuple[dict[str, float], float]:
  """(requests ended by reason, generated tokens) so far."""
  m = metrics(url)
  return {r: m[f'jaxkv_requests_total{{reason="{r}"}}'] for r in REASONS}, m["jaxkv_generated_tokens_total"]


def one_more(before: dict[str, float], after: dict[str, float], reason: str) -> bool:
  """Whether exactly one request ended between the two counts, under `reason`."""
  return {r: after[r] - before[r] for r in REASONS} == {r: float(r == reason) for r in REASONS}
