"""An HTTP server (jaxkv.serving.api) on a free localhost port in the test process, for the server's tests."""

from __future__ import annotations

import contextlib
import threading
import time

from jaxkv import serving
from jaxkv.serving import api as serve_api

START_S = 60.0  # Bound on the server's start.


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
):
  """Serves `engine` on 127.0.0.1 (a port the OS picks; access: its API key and CORS origins, default none); yields
  (base url, Model); stops the server and the loop."""
  loop = serving.ServingLoop(serving.Server(engine, parallel, prefix_cache_bytes), max_queue)
  if start_loop:
    loop.start()
  model = serve_api.Model(name, loop, tokenizer, template, eos_ids)
  app = serve_api.make_app(model) if access is None else serve_api.make_app(model, access)
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
    thread.join(START_S)
    loop.stop(START_S)
