"""Serve: `python3 -m jaxkv.serve`, an OpenAI-compatible HTTP server with continuous batching (jaxkv.serving.api).

Takes generate's model sources and flags (--config, --kv_*, --split_mode, --cpu_devices, --checkpoint_dir or --gguf,
--checkpoint_dtype, --ignore_eos, --seed for random weights, --speculate), read as generate reads them, and serves on
--host:--port with --parallel slots; up to --max_queue requests wait for a slot, more get 429; request bodies past
--max_body_mb get 413; --slot_save_path is the folder of saved slots (POST /slots/{id}?action=save|restore, with
--prefix_cache_gib). generate's flags for its own prompts (--prompt, --chat, --prompt_len, --batch,
--max_new_tokens, --sequences, --json_out) are refused. SIGTERM (or Ctrl-C) stops taking requests, lets those in
flight finish, then exits. Needs the `serve` extra: pip install -e '.[serve]'.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket

from absl import app
from absl import flags
from absl import logging

from jaxkv import distributed
from jaxkv import preflight
from jaxkv.apps import cli

# generate's flags: --checkpoint_dir, --gguf, --checkpoint_dtype, --ignore_eos, --parallel, --seed, --prefix_cache_gib.
from jaxkv.apps import generate

HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
PORT = flags.DEFINE_integer("port", 8000, "Port to listen on.", lower_bound=1, upper_bound=65535)
MAX_QUEUE = flags.DEFINE_integer("max_queue", 64, "Requests that may wait for a slot; more are refused with 429.")
MODEL_NAME = flags.DEFINE_string(
    "served_model_name",
    None,
    "The model's name in the API (default: the checkpoint folder's or GGUF file's name, else jaxkv-random).",
)
MAX_BODY_MB = flags.DEFINE_float(
    "max_body_mb", None, "Request bodies larger than this many MiB are refused with 413 (default: jaxkv.serving.api's)."
)

WARMUP = flags.DEFINE_bool(
    "warmup",
    False,
    "Before listening, compile the decode programs of every window bucket of the capacity and the prefill programs of "
    "every chunk shape (jaxkv.warmup), a line per bucket and per chunk index, so that no request waits for them.",
)

SLOT_SAVE_PATH = flags.DEFINE_string(
    "slot_save_path",
    None,
    "A folder for POST /slots/{id}?action=save|restore files (llama-server's --slot-save-path; made if missing); "
    "needs --prefix_cache_gib. Without it the endpoint answers 501.",
)

API_KEY = flags.DEFINE_string(
    "api_key", None, "A key every request must send as 'Authorization: Bearer <key>' (/health stays open)."
)
API_KEY_FILE = flags.DEFINE_string("api_key_file", None, "A file whose first line is the API key (kept out of ps).")
CORS_ORIGINS = flags.DEFINE_list(
    "cors_origins",
    [],
    "Origins a browser may call the API from (CORS), e.g. https://a.example,https://b.example; * = any.",
)

# generate's flags that give its own prompts and outputs: a server takes its prompts from requests.
_NOT_SERVED = (
    generate.PROMPT,
    generate.CHAT,
    generate.PROMPT_LEN,
    generate.BATCH,
    generate.MAX_NEW,
    generate.SEQUENCES,
    generate.JSON_OUT,
)

HELP_GROUPS = {
    "model and config": [
        *cli.CONFIG_GROUP,
        generate.CHECKPOINT_DIR,
        generate.GGUF,
        generate.CHECKPOINT_DTYPE,
        generate.IGNORE_EOS,
        generate.SEED,
    ],
    "server": [
        HOST,
        PORT,
        generate.PARALLEL,
        MAX_QUEUE,
        MAX_BODY_MB,
        MODEL_NAME,
        generate.PREFIX_CACHE_GIB,
        SLOT_SAVE_PATH,
        WARMUP,
        cli.SPECULATE_FLAG,
    ],
    "access": [API_KEY, API_KEY_FILE, CORS_ORIGINS],
    "KV cache": cli.KV_GROUP,
    "split": cli.SPLIT_GROUP,
    "multi-host": cli.MULTIHOST_GROUP,
}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if generate.PARALLEL.value < 1 or MAX_QUEUE.value < 1:
    raise app.UsageError(f"--parallel and --max_queue must be >= 1, got {generate.PARALLEL.value}, {MAX_QUEUE.value}")
  given = [f"--{h.name}" for h in _NOT_SERVED if flags.FLAGS[h.name].present]
  if given:
    raise app.UsageError(f"jaxkv.serve takes its prompts from requests: drop {', '.join(given)}")
  checkpoint = generate.CHECKPOINT_DIR.value or generate.GGUF.value
  if generate.CHECKPOINT_DIR.value and generate.GGUF.value:
    raise app.UsageError("give --checkpoint_dir or --gguf, not both")
  if generate.CHECKPOINT_DTYPE.value and not checkpoint:
    raise app.UsageError("--checkpoint_dtype needs --checkpoint_dir or --gguf (else set --config.model.dtype)")
  if generate.IGNORE_EOS.value and not checkpoint:
    raise app.UsageError("--ignore_eos is for a checkpoint's end-of-sequence ids: give --checkpoint_dir or --gguf")
  if MAX_BODY_MB.value is not None and MAX_BODY_MB.value <= 0:
    raise app.UsageError(f"--max_body_mb must be > 0, got {MAX_BODY_MB.value:g}")
  if SLOT_SAVE_PATH.value is not None:
    if not generate.PREFIX_CACHE_GIB.value:
      raise app.UsageError("--slot_save_path saves slots as prefix cache blocks: give --prefix_cache_gib too")
    try:
      os.makedirs(SLOT_SAVE_PATH.value, exist_ok=True)
    except OSError as e:
      raise app.UsageError(f"cannot make the folder {SLOT_SAVE_PATH.value} ({e.strerror}); fix --slot_save_path") from e
  missing = [m for m in ("fastapi", "uvicorn", "prometheus_client", "jinja2") if importlib.util.find_spec(m) is None]
  if missing:
    raise preflight.InputError(f"jaxkv.serve needs {', '.join(missing)} (the serve extra)", "pip install -e '.[serve]'")
  try:
    with socket.create_server((HOST.value, PORT.value)):
      pass
  except OSError as e:
    raise app.UsageError(f"cannot listen on {HOST.value}:{PORT.value} ({e.strerror}); pick another --port") from e
  if API_KEY.value is not None and API_KEY_FILE.value is not None:
    raise app.UsageError("give --api_key or --api_key_file, not both")
  if API_KEY.value == "":
    raise app.UsageError("--api_key is empty; give a key, or leave the flag out for none")
  from jaxkv.serving import access as access_lib  # pylint: disable=g-import-not-at-top  (needs the serve extra)

  api_key = API_KEY.value
  if API_KEY_FILE.value is not None:
    try:
      api_key = access_lib.read_key_file(API_KEY_FILE.value)
    except ValueError as e:
      raise app.UsageError(f"{e}; fix --api_key_file") from e
  if distributed.settings(cli.COORDINATOR_ADDRESS.value, cli.NUM_PROCESSES.value, cli.PROCESS_ID.value):
    raise app.UsageError("serve runs in one process: drop the multi-process flags and JAX_* variables")
  cd = cli.resolved_config_dict(checkpoint=bool(checkpoint))
  cli.setup_platform(cli.model_of(cd, generate.CHECKPOINT_DIR.value, generate.GGUF.value, generate.checkpoint_dtype()))
  from jaxkv.serving import api as serve_api  # pylint: disable=g-import-not-at-top  (after the platform is set)

  name = MODEL_NAME.value or (os.path.basename(os.path.normpath(checkpoint)) if checkpoint else "jaxkv-random")
  model = serve_api.build_model(
      cd,
      checkpoint_dir=generate.CHECKPOINT_DIR.value,
      gguf=generate.GGUF.value,
      eos=not generate.IGNORE_EOS.value,
      dtype=generate.checkpoint_dtype(),
      parallel=generate.PARALLEL.value,
      seed=generate.SEED.value,
      max_queue=MAX_QUEUE.value,
      name=name,
      prefix_cache_bytes=generate.prefix_cache_bytes(),
      warmup=(lambda line: print(line, flush=True)) if WARMUP.value else None,
  )
  logging.info("serving %s on http://%s:%d", name, HOST.value, PORT.value)
  print(
      f"serving {name} on http://{HOST.value}:{PORT.value} ({generate.PARALLEL.value} slots, capacity "
      f"{model.capacity} tokens, {'text and token ids' if model.tokenizer else 'token ids'})",
      flush=True,
  )
  # uvicorn drains on SIGTERM, then raises it again for the handler it found: let that one return, so that the loop
  # stops and the app exits 0.
  signal.signal(signal.SIGTERM, lambda *_: logging.info("SIGTERM: drained"))
  try:
    body_mb = serve_api.DEFAULT_MAX_BODY_MB if MAX_BODY_MB.value is None else MAX_BODY_MB.value
    access = access_lib.Access(api_key, tuple(CORS_ORIGINS.value))
    api_app = serve_api.make_app(model, body_mb, access, SLOT_SAVE_PATH.value)
    serve_api.uvicorn_server(api_app, HOST.value, PORT.value).run()
  finally:
    model.loop.stop()


def run() -> None:
  """The app: `python3 -m jaxkv.serve`."""
  cli.run(main, HELP_GROUPS, __doc__)


if __name__ == "__main__":
  run()
