"""The OpenAI-compatible HTTP API over a jaxkv.serving.loop.ServingLoop (FastAPI and uvicorn; `serve` extra).

POST /v1/completions (prompt: text, or token ids), POST /v1/chat/completions (the checkpoint's chat template,
jaxkv.chat_template), GET /v1/models, GET /health, GET /metrics (Prometheus text, jaxkv.serving.metrics), GET /slots
(each slot's request and tokens), llama-server's /tokenize, /detokenize, /props and POST /slots/{id}?action=...
(a slot's conversation saved, restored or erased, with a slot save path: jaxkv.serving.slot_files). With "stream":
true the choices come as server-sent events, one chunk per token, then `data: [DONE]`. Every choice (and chunk)
carries its generated ids in `token_ids`; without a tokenizer prompts are token ids and `text` is empty.

Sampling fields left out take the config's sampling section (greedy by default), so a request with the same prompt
and settings gets the tokens `python3 -m jaxkv.generate` prints; penalties, min_p, logit_bias and min_tokens reach
the head per request (jaxkv.sampling). `stop` strings end a request at the first one and cut the text before it; so
does a checkpoint's end of sequence id or a `stop_token_ids` id (its id ends `token_ids`), unless "ignore_eos".
`logprobs` (and chat's `top_logprobs`) give each token's float32 log-probability under the model's logits in the
OpenAI shapes (jaxkv.serving.logprobs); a completion's `echo` puts its prompt before the text, and with `logprobs`
its prompt tokens' (the first null; `max_tokens: 0`: the prompt alone). `n` samples of one prompt are n requests
(sample i seeded seed + i) sharing its prefill, choices 0..n-1. Structured output (`response_format`, `guided_*`,
`grammar`) masks the head per row (jaxkv.serving.grammar); a chat's `tools` are rendered by its template and the calls
in its answer parsed (jaxkv.serving.tools). A field the server does not implement is a 400 naming it
(jaxkv.serving.schemas: its no-op value is accepted).

Every error is OpenAI's `{"error": {"message", "type", "param", "code"}}`: bad input a 400, an unknown model or route
a 404, a body over the limit a 413, a full queue a 429 with Retry-After; the server keeps serving. Nothing a client
sends stalls the others: tokenizing and rendering the chat template run on worker threads, and a text prompt whose
bytes alone prove it longer than the capacity is refused before it is tokenized. A client that disconnects, streaming
or not, ends its request at the next decode step, freeing its slot.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import os
import secrets
import threading
import time
import uuid
from collections.abc import Callable

import fastapi
import fastapi.exceptions
import pydantic
import uvicorn
from fastapi import concurrency
from fastapi import responses
from starlette import exceptions as starlette_exceptions

from jaxkv import chat_template as chat_template_lib
from jaxkv import sampling as sampling_lib
from jaxkv import tokenizer as tokenizer_lib
from jaxkv import warmup as warmup_lib
from jaxkv.config import SamplingConfig
from jaxkv.serving import access as access_lib
from jaxkv.serving import logprobs as logprobs_lib
from jaxkv.serving import loop as loop_lib
from jaxkv.serving import metrics as metrics_lib
from jaxkv.serving import schemas
from jaxkv.serving import server as server_lib
from jaxkv.serving import slot_files
from jaxkv.serving import tools as tools_lib
from jaxkv.serving.requests import Request

DEFAULT_MAX_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI's.
DEFAULT_MAX_BODY_MB = 8.0  # Request bodies past this many MiB are refused with 413.
RETRY_AFTER_S = 1  # A 429's Retry-After.


@dataclasses.dataclass(frozen=True)
class Model:
  """What the API serves: its name, the loop, and a checkpoint's tokenizer, chat template (None without) and end of
  sequence ids (a request ends after one, unless it asks "ignore_eos")."""

  name: str
  loop: loop_lib.ServingLoop
  tokenizer: tokenizer_lib.Tokenizer | None = None
  chat_template: chat_template_lib.ChatTemplate | None = None
  eos_ids: frozenset[int] = frozenset()

  @property
  def capacity(self) -> int:
    return self.loop.server.engine.config.engine.capacity

  @functools.cached_property
  def grammars(self):
    """The compiler of requests' grammars (jaxkv.serving.grammar.Grammars; llguidance reads the tokenizer at first
    use, about a second). Needs a tokenizer and end of sequence ids."""
    from jaxkv.serving import grammar  # pylint: disable=g-import-not-at-top  (llguidance: the serve extra)

    return grammar.Grammars(self.tokenizer, self.loop.server.engine.config.model.vocab_size, sorted(self.eos_ids))

  @functools.cached_property
  def max_prompt_bytes(self) -> int | None:
    """UTF-8 bytes of text past which a prompt cannot fit the capacity (jaxkv.tokenizer's bytes_per_token); None:
    no such bound is known."""
    per_token = self.tokenizer.bytes_per_token() if self.tokenizer is not None else None
    return None if per_token is None else per_token * self.capacity


class ApiError(Exception):

  def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
    super().__init__(message)
    self.status, self.message, self.kind = status, message, kind


def _error(status: int, message: str, kind: str = "invalid_request_error", headers=None) -> responses.JSONResponse:
  body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
  return responses.JSONResponse(body, status, headers=headers)


class _Output:
  """A choice's text and ids as tokens arrive: incremental detokenization, `stop` strings (the text is cut before
  the first that starts after the text of its first min_tokens tokens; while one could still complete, its possible
  start is held back)."""

  def __init__(self, tokenizer, stops: list[str], min_tokens: int = 0):
    self.detok = tokenizer_lib.Detokenizer(tokenizer) if tokenizer else None
    self.stops = [s for s in stops if s]
    self.min_tokens = min_tokens
    self.ids: list[int] = []
    self.text, self.sent, self.stopped, self.floor = "", 0, False, 0

  def add(self, ids: list[int], final: bool = False, eos: bool = False) -> str:
    """Takes new ids (final: the request ended; eos: with these end of sequence ids, which add no text) and returns
    the text that may be sent now."""
    self.ids += ids
    if self.detok is not None:
      self.text += self.detok.add([] if eos else ids, final)
    if len(self.ids) < self.min_tokens:
      self.floor = len(self.text)
    hold = 0
    if self.stops:
      cuts = [i for i in (self.text.find(s, max(self.floor, self.sent - len(s))) for s in self.stops) if i >= 0]
      if cuts:
        self.text, self.stopped = self.text[: min(cuts)], True
      elif not final:
        hold = max(len(s) for s in self.stops) - 1
    upto = max(self.sent, len(self.text) - hold)
    piece, self.sent = self.text[self.sent : upto], upto
    return piece


@dataclasses.dataclass(frozen=True)
class _Echo:
  """A completion's prompt echoed before its text (`echo`): its ids and text; only: max_tokens 0, the prompt alone
  (the one token its request generates is dropped)."""

  ids: list[int]
  text: str
  only: bool


# How a request ended (the metrics' reason) -> OpenAI's finish_reason.
_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop", "error": None}


class _Generation:
  """One request in the loop, seen from the event loop: its tokens arrive on an asyncio queue. Its end is counted
  once in the metrics, by reason, with the tokens its client was handed (usage.completion_tokens); `t0`: its arrival
  (time.perf_counter())."""

  def __init__(
      self,
      model: Model,
      metrics: metrics_lib.Metrics,
      request: Request,
      stops: list[str],
      eos: frozenset,
      t0: float,
      echo: _Echo | None = None,
  ):
    self.model, self.metrics, self.t0, self.echo = model, metrics, t0, echo
    self.out = _Output(model.tokenizer, stops, request.rules.min_tokens if request.rules else 0)
    self.logprobs: list = []  # Per token of out.ids, jaxkv.sampling.logprobs's where the request asked.
    self._ends = [0]  # _ends[k]: where token k's text starts in the token texts joined (after an echoed prompt's).
    self.last_s: float | None = None  # When the last token arrived.
    self.reason: str | None = None  # How it ended (loop.ENDS, or "stop": a stop string).
    self.finish: str | None = None
    self._events: asyncio.Queue = asyncio.Queue()
    aloop = asyncio.get_running_loop()

    def put(*event):
      if not aloop.is_closed():
        aloop.call_soon_threadsafe(self._events.put_nowait, event)

    try:
      self.handle = model.loop.submit(
          request, lambda *t: put("token", *t), lambda why, err: put("end", why, err), eos_ids=eos
      )
    except ValueError as e:
      raise ApiError(400, str(e)) from e
    except loop_lib.QueueFull as e:
      raise ApiError(429, f"server busy: {e}; retry later", "rate_limit_error") from e
    except loop_lib.Closed as e:
      raise ApiError(503, str(e), "server_error") from e

  async def next(self) -> tuple[list[int], str]:
    """Waits for the next event: (new ids, the text to send); self.finish is set when the request ended."""
    event = await self._events.get()
    if event[0] == "token":
      if self.echo is not None and self.echo.only:  # max_tokens 0: the token is not the client's.
        return [], ""
      token, now = event[1], time.perf_counter()
      if self.last_s is None:
        self.metrics.ttft.observe(now - self.t0)
      else:
        self.metrics.itl.observe(now - self.last_s)
      self.last_s = now
      self.logprobs.append(event[2])
      eos = token in self.handle.eos_ids  # The loop ends the request with it.
      piece = self.out.add([token], final=eos, eos=eos)
      if eos:
        self._end("eos")
      elif self.out.stopped:
        self.handle.cancel()
        self._end("stop")
      return [token], piece
    _, why, err = event
    if why == "error":
      self._end("error")
      raise ApiError(500, f"the engine failed: {err}", "server_error")
    self._end(why)
    return [], self.out.add([], final=True)

  def shaped_logprobs(self, ids: list[int], first: int, chat: bool, echoed: bool = False) -> dict | None:
    """The OpenAI `logprobs` of ids = out.ids[first:first + len(ids)] (None where the request asked for none);
    echoed: after the echoed prompt's, where the request echoes its prompt with logprobs."""
    tok, prompt = self.model.tokenizer, self.handle.prompt_logprobs
    if echoed and self.echo is not None and prompt is not None:
      if len(self._ends) == 1:
        self._ends[0] = sum(logprobs_lib.text_length(tok, t) for t in self.echo.ids)
      shaped = logprobs_lib.completion(tok, self.echo.ids, prompt, 0)
      generated = self.shaped_logprobs(ids, first, chat)
      return shaped if generated is None else {k: v + generated[k] for k, v in shaped.items()}
    entries = self.logprobs[first : first + len(ids)]
    if not ids or entries[0] is None:
      return None
    if chat:
      return logprobs_lib.chat(tok, ids, entries)
    while len(self._ends) <= first:
      self._ends.append(self._ends[-1] + logprobs_lib.text_length(tok, self.out.ids[len(self._ends) - 1]))
    return logprobs_lib.completion(tok, ids, entries, self._ends[first])

  def abort(self) -> None:
    """The client went away: ends the request at the next decode step, and next() with "cancelled"."""
    self.handle.cancel()
    self._events.put_nowait(("end", "cancelled", None))

  def close(self) -> None:
    """Ends the request if it still runs (a no-op once it ended), counting it as cancelled."""
    self.handle.cancel()
    if self.reason is None:
      self._end("cancelled")

  def _end(self, reason: str) -> None:
    self.reason, self.finish = reason, _FINISH[reason]
    now, m = time.perf_counter(), self.metrics
    m.finished.labels(reason).inc()
    m.generated.inc(len(self.out.ids))
    m.e2e.observe(now - self.t0)
    placed = self.handle.placed_s
    m.queue.observe((now if placed is None else placed) - self.t0)


def make_app(
    model: Model,
    max_body_mb: float = DEFAULT_MAX_BODY_MB,
    access: access_lib.Access = access_lib.Access(),
    slot_save_path: str | None = None,
) -> fastapi.FastAPI:
  """The FastAPI app (request bodies up to `max_body_mb` MiB; its API key and CORS origins: `access`; slots saved to
  and restored from files in the folder `slot_save_path`, None: not at all); starting and stopping the loop is the
  caller's (jaxkv.serve)."""
  app = fastapi.FastAPI(title="jaxkv", docs_url=None, redoc_url=None)
  app.add_middleware(_BodyLimit, max_bytes=int(max_body_mb * 2**20))
  access.install(app)
  metrics = metrics_lib.Metrics(model.loop)
  created = int(time.time())
  _ = model.max_prompt_bytes  # Read the vocabulary now, not in the first request.

  @app.exception_handler(fastapi.exceptions.RequestValidationError)
  async def invalid(_, exc: fastapi.exceptions.RequestValidationError):
    parts = []
    for e in exc.errors()[:3]:
      if e["type"] == "json_invalid":
        parts.append(f"malformed JSON ({e.get('ctx', {}).get('error', e['msg'])} at character {e['loc'][-1]})")
        continue
      where = ".".join(str(x) for x in e["loc"] if x != "body")
      if e["type"] == "extra_forbidden":
        parts.append(f"unsupported field {where!r}: jaxkv does not implement it; leave it out")
        continue
      parts.append(f"{where}: {e['msg']}" if where else e["msg"])
    metrics.rejected.labels("400").inc()
    return _error(400, "invalid request: " + "; ".join(parts))

  @app.exception_handler(ApiError)
  async def api_error(_, exc: ApiError):
    metrics.rejected.labels(str(exc.status)).inc()
    return _error(exc.status, exc.message, exc.kind, {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 429 else None)

  @app.exception_handler(starlette_exceptions.HTTPException)
  async def http_error(http: fastapi.Request, exc: starlette_exceptions.HTTPException):
    """The framework's own errors (no such route, method, a body past the limit or not UTF-8) in OpenAI's shape."""
    metrics.rejected.labels(str(exc.status_code)).inc()
    message = str(exc.detail)
    if exc.status_code in (404, 405):
      message = f"{message}: {http.method} {http.url.path}"
    elif isinstance(exc.__cause__, UnicodeDecodeError):
      message = f"malformed JSON (not UTF-8: {exc.__cause__.reason} at byte {exc.__cause__.start})"
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return _error(exc.status_code, message, kind, exc.headers)

  @app.exception_handler(Exception)
  async def crash(_, exc: Exception):  # A bug: the traceback goes to the log, the client gets OpenAI's shape.
    metrics.rejected.labels("500").inc()
    return _error(500, f"internal error ({type(exc).__name__}); the server log has the details", "server_error")

  @app.get("/health")
  async def health():
    if not model.loop.alive:
      return _error(503, "the serving loop is not running", "server_error")
    return {"status": "ok"}

  @app.get("/metrics")
  async def metrics_endpoint():
    return responses.Response(metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

  @app.get("/v1/models")
  async def models():
    vocab = model.loop.server.engine.config.model.vocab_size  # Token-id prompts stay below it.
    card = dict(id=model.name, object="model", created=created, owned_by="jaxkv", max_model_len=model.capacity)
    card.update(vocab_size=vocab, meta={"n_ctx": model.capacity, "n_vocab": vocab})  # vLLM's and llama-server's.
    return {"object": "list", "data": [card]}

  @app.post("/tokenize")
  async def tokenize(body: schemas.TokenizeRequest):
    tok = _tokenizer(model)

    def tokens() -> list:  # On a worker thread, as a prompt's.
      ids = tok.encode(body.content, add_special_tokens=body.add_special)
      return [{"id": i, "piece": tok.decode([i], skip_special_tokens=False)} for i in ids] if body.with_pieces else ids

    return {"tokens": await concurrency.run_in_threadpool(tokens)}

  @app.post("/detokenize")
  async def detokenize(body: schemas.DetokenizeRequest):
    ids = _ids(body.tokens, model, "tokens")
    return {"content": await concurrency.run_in_threadpool(_tokenizer(model).decode, ids, False)}

  @app.get("/props")
  async def props():
    cfg = model.loop.server.engine.config
    settings = dict(dataclasses.asdict(cfg.sampling), n_ctx=model.capacity, eos_ids=sorted(model.eos_ids))
    return {
        "default_generation_settings": settings,
        "total_slots": model.loop.parallel,
        "model_alias": model.name,
        "vocab_size": cfg.model.vocab_size,
        "chat_template": None if model.chat_template is None else model.chat_template.source,
    }

  @app.get("/slots")
  async def slots():
    return model.loop.slots()

  @app.post("/slots/{id_slot}")
  async def slot_action(id_slot: str, action: str = "", body: schemas.SlotFileRequest | None = None):
    """llama-server's: a slot's conversation saved to a file of slot_save_path, restored from one, or erased
    (jaxkv.serving.slot_files; the engine thread does the KV's part)."""
    if slot_save_path is None:
      raise ApiError(501, "this server does not save slots: start it with --slot_save_path", "not_supported_error")
    if not id_slot.isdigit() or int(id_slot) >= model.loop.parallel:
      raise ApiError(400, f"id_slot: no slot {id_slot!r}; the server has slots 0..{model.loop.parallel - 1}")
    if action not in ("save", "restore", "erase"):
      raise ApiError(400, f"action: {action!r} is none of save, restore, erase")
    slot, t0, cfg = int(id_slot), time.perf_counter(), model.loop.server.engine.config
    if action == "erase":
      return {"id_slot": slot, "n_erased": await _engine_job(model.loop.erase, slot)}
    if model.loop.server.prefix_cache is None:
      raise ApiError(400, f"{action}: slots are saved as prefix cache blocks: start the server with --prefix_cache_gib")
    if body is None:
      raise ApiError(400, f'{action} needs a body {{"filename": ...}}')
    fp = slot_files.fingerprint(cfg)
    try:
      path = slot_files.path_in(slot_save_path, body.filename)
      if action == "save":
        saved = await _engine_job(model.loop.save, slot)
        nbytes = await concurrency.run_in_threadpool(slot_files.write, path, saved, fp)
      else:
        saved, nbytes = await concurrency.run_in_threadpool(slot_files.read, path, fp, cfg.engine.prefill_chunk)
        await _engine_job(model.loop.restore, slot, saved, body.filename)
    except FileNotFoundError as e:
      raise ApiError(400, f"filename: no file {body.filename!r} in the slot save path") from e
    except ValueError as e:
      raise ApiError(400, f"{action}: {e}") from e
    except OSError as e:
      raise ApiError(500, f"{action}: {body.filename!r}: {e.strerror}", "server_error") from e
    ms, head = (time.perf_counter() - t0) * 1e3, dict(id_slot=slot, filename=body.filename)
    if action == "save":
      return dict(head, n_saved=len(saved.tokens), n_written=nbytes, timings=dict(save_ms=ms))
    return dict(head, n_restored=len(saved.tokens), n_read=nbytes, timings=dict(restore_ms=ms))

  @app.post("/v1/completions")
  async def completions(body: schemas.CompletionRequest, http: fastapi.Request):
    t0 = time.perf_counter()
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
      if len(prompt) != 1:
        raise ApiError(400, f"one prompt per request (n samples of it: `n`), got a list of {len(prompt)}")
      prompt = prompt[0]
    if isinstance(prompt, str):
      if model.tokenizer is None:
        raise ApiError(400, "text prompts need a checkpoint with a tokenizer.json; send token ids (a list of ints)")
      ids = await _encode(model, prompt)
    else:
      ids = list(prompt)
    if body.max_tokens == 0 and not body.echo:
      raise ApiError(400, "max_tokens: 0 asks for the prompt only, which needs echo: true; send max_tokens >= 1")
    echo = None
    if body.echo:
      text = prompt if isinstance(prompt, str) else ""
      if not isinstance(prompt, str) and model.tokenizer is not None:
        text = await concurrency.run_in_threadpool(model.tokenizer.decode, ids, False)
      echo = _Echo(ids, text, body.max_tokens == 0)
    max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    return await _respond(body, ids, max_tokens, "text_completion", http, t0, body.logprobs, echo)

  @app.post("/v1/chat/completions")
  async def chat(body: schemas.ChatRequest, http: fastapi.Request):
    t0 = time.perf_counter()
    if model.tokenizer is None or model.chat_template is None:
      raise ApiError(400, "chat needs a checkpoint with a tokenizer.json and a chat template; use /v1/completions")
    messages = [_message(m, i) for i, m in enumerate(body.messages)]
    tools, tool_format = None, None
    if body.tools:
      tool_format = tools_lib.template_format(model.chat_template.source)
      if tool_format is None:
        raise ApiError(400, "tools: this model's chat template renders no tools; leave tools out")
      tools = [t.model_dump(exclude_none=True) for t in body.tools]
      if body.tool_choice == "none":
        tool_format = None  # Rendered, as vLLM does; the answer is content.
    try:
      text = await concurrency.run_in_threadpool(model.chat_template.render, messages, True, tools)
    except ValueError as e:
      raise ApiError(400, str(e)) from e
    ids = await _encode(model, text, add_special_tokens=False)
    max_tokens = body.max_completion_tokens or body.max_tokens  # None: until its end or the capacity.
    if body.top_logprobs is not None and not body.logprobs:
      raise ApiError(400, "top_logprobs needs logprobs: true")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return await _respond(body, ids, max_tokens, "chat.completion", http, t0, logprobs, tool_format=tool_format)

  async def _respond(
      body: schemas.Params,
      ids: list[int],
      max_tokens: int | None,
      kind: str,
      http: fastapi.Request,
      t0: float,
      logprobs: int | None,
      echo: _Echo | None = None,
      tool_format: str | None = None,
  ):
    if body.model is not None and body.model != model.name:
      raise ApiError(404, f"model {body.model!r} is not served here; GET /v1/models lists {model.name!r}")
    if not ids:
      raise ApiError(400, "the prompt is empty")
    if body.stream_options is not None and not body.stream:
      raise ApiError(400, "stream_options: only with stream: true (a response that is not streamed has its usage)")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if stops and model.tokenizer is None:
      raise ApiError(400, "stop strings need a checkpoint with a tokenizer.json")
    eos = (frozenset() if body.ignore_eos else model.eos_ids) | frozenset(_ids(body.stop_token_ids or [], model))
    if max_tokens is not None and body.min_tokens > max_tokens:
      raise ApiError(400, f"min_tokens ({body.min_tokens}) must be <= max_tokens ({max_tokens})")
    rules = _rules(body, model, eos)
    if echo is not None and echo.only:
      max_tokens = 1  # Its token is dropped (_Generation): prefill and head run as for any request.
    prompt_logprobs = logprobs if echo is not None else None
    spec = _grammar_spec(body)
    if spec is not None:
      try:
        model.loop.server.check_grammar(spec[0])
      except ValueError as e:
        raise ApiError(400, str(e)) from e
    grammars = [None if spec is None else await _compile(model, *spec) for _ in range(body.n)]
    seed, sampling, gens = _seed(body.seed), _sampling(body, model), []
    try:
      for i in range(body.n):  # Sample i: seed + i; the first's prefill serves the others (Request.prompt_shares).
        shares = body.n - 1 if i == 0 else 0
        request = Request(
            tuple(ids),
            max_tokens,
            (seed + i) & 0x7FFFFFFF,
            sampling,
            rules,
            logprobs,
            prompt_logprobs,
            prompt_shares=shares,
            grammar=grammars[i],
        )
        gens.append(_Generation(model, metrics, request, stops, eos, t0, echo))
    except ApiError:
      for gen in gens:
        gen.close()
      raise
    rid = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + uuid.uuid4().hex
    head = {"id": rid, "created": int(time.time()), "model": model.name}
    if body.stream:
      include_usage = body.stream_options is not None and body.stream_options.include_usage
      return responses.StreamingResponse(
          _stream(gens, head, kind, len(ids), include_usage, http, tool_format), media_type="text/event-stream"
      )

    async def finish(gen: _Generation) -> None:
      while gen.finish is None:
        await gen.next()

    watch = asyncio.ensure_future(_watch(http, gens))
    try:
      await asyncio.gather(*(finish(gen) for gen in gens))
    finally:
      watch.cancel()
      for gen in gens:
        gen.close()
    if any(gen.reason == "cancelled" for gen in gens):
      return responses.Response(status_code=499)  # Nobody reads it.
    choices = []
    for i, gen in enumerate(gens):
      out = gen.out
      choice = {
          "index": i,
          "token_ids": out.ids,
          "logprobs": gen.shaped_logprobs(out.ids, 0, kind == "chat.completion", echoed=True),
          "finish_reason": gen.finish,
      }
      if kind == "chat.completion":
        content, calls = tools_lib.parse(tool_format, out.text) if tool_format else (out.text, [])
        choice["message"] = {"role": "assistant", "content": content}
        if calls:
          choice["message"] = dict(content=content or None, tool_calls=[c.openai() for c in calls], role="assistant")
          choice["finish_reason"] = "tool_calls"
      else:
        choice["text"] = ("" if echo is None else echo.text) + out.text
      choices.append(choice)
    return dict(head, object=kind, choices=choices, usage=_usage(len(ids), gens))

  return app


async def _stream(
    gens: list[_Generation],
    head: dict,
    kind: str,
    prompt_tokens: int,
    include_usage: bool,
    http: fastapi.Request,
    tool_format: str | None = None,
):
  """Server-sent events: a chunk per token of a choice (its index), the choice's last with its finish_reason, usage
  if asked, then [DONE]. With tool_format (jaxkv.serving.tools) the text that may start a tool call is held back,
  and the calls come in the choice's last chunk (`delta.tool_calls`, each with its index). Ends the requests when
  the client goes away (_watch, or the response task is cancelled)."""
  chat = kind == "chat.completion"
  obj = "chat.completion.chunk" if chat else "text_completion"
  first, sent = [True] * len(gens), [0] * len(gens)  # sent: each choice's ids sent so far.
  texts, shown = [""] * len(gens), [0] * len(gens)  # With tool_format: each choice's text, and its part sent.

  def chunk(i, ids, piece):
    gen = gens[i]
    logprobs = gen.shaped_logprobs(ids, sent[i], chat, echoed=first[i])
    choice = {"index": i, "token_ids": ids, "logprobs": logprobs, "finish_reason": gen.finish}
    calls = []
    if tool_format is not None:
      texts[i] += piece
      if gen.finish is None:
        upto = tools_lib.content_length(tool_format, texts[i], final=False)
      else:
        content, calls = tools_lib.parse(tool_format, texts[i])
        upto = len(content) if calls else len(texts[i])
      upto = max(upto, shown[i])
      piece, shown[i] = texts[i][shown[i] : upto], upto
    if calls:
      choice["finish_reason"] = "tool_calls"
    if chat:
      choice["delta"] = dict({"role": "assistant"} if first[i] else {}, content=piece)
      if calls:
        choice["delta"]["tool_calls"] = [c.openai(k) for k, c in enumerate(calls)]
    else:
      choice["text"] = (gen.echo.text if first[i] and gen.echo is not None else "") + piece
    first[i], sent[i] = False, sent[i] + len(ids)
    return _event(dict(head, object=obj, choices=[choice]))

  watch = asyncio.ensure_future(_watch(http, gens))
  events = _merged(gens)
  try:
    try:
      async for i, ids, piece in events:
        if gens[i].reason == "cancelled":
          return
        if ids or piece or gens[i].finish is not None:
          yield chunk(i, ids, piece)
    except ApiError as e:
      yield _event({"error": {"message": e.message, "type": e.kind, "param": None, "code": e.status}})
      return
    if include_usage:
      yield _event(dict(head, object=obj, choices=[], usage=_usage(prompt_tokens, gens)))
    yield "data: [DONE]\n\n"
  finally:
    await events.aclose()
    watch.cancel()
    for gen in gens:
      gen.close()


async def _merged(gens: list[_Generation]):
  """(choice index, ids, text) of each generation's events (_Generation.next) as they come, until every one
  finished."""
  pending = {asyncio.ensure_future(gen.next()): i for i, gen in enumerate(gens)}
  try:
    while pending:
      done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
      for future in sorted(done, key=pending.get):
        i = pending.pop(future)
        ids, piece = future.result()
        yield i, ids, piece
        if gens[i].finish is None:
          pending[asyncio.ensure_future(gens[i].next())] = i
  finally:
    for future in pending:
      future.cancel()


async def _watch(http: fastapi.Request, gens: list[_Generation]) -> None:
  """Aborts `gens` when their client disconnects: ASGI's receive, once the body is read, returns only that."""
  while (await http.receive())["type"] != "http.disconnect":
    pass
  for gen in gens:
    gen.abort()


async def _engine_job(queue: Callable, *args):
  """The result of a slot job that `queue(*args)` (a ServingLoop method) hands the engine thread; ApiError (503)
  when the loop is not running."""
  try:
    future = queue(*args)
  except loop_lib.Closed as e:
    raise ApiError(503, str(e), "server_error") from e
  return await asyncio.wrap_future(future)


async def _encode(model: Model, text: str, add_special_tokens: bool = True) -> list[int]:
  """The ids of a text prompt, encoded on a worker thread; ApiError (400) for text that is not Unicode (a lone
  surrogate) or whose bytes alone prove it longer than the capacity (Model.max_prompt_bytes)."""
  try:
    size = len(text.encode())
  except UnicodeEncodeError as e:
    raise ApiError(400, f"the prompt is not valid Unicode ({e.reason} at character {e.start})") from e
  limit = model.max_prompt_bytes
  if limit is not None and size > limit:
    raise ApiError(
        400,
        f"the prompt has {size} bytes of text, longer than the cache capacity {model.capacity} holds (a token covers "
        f"at most {limit // model.capacity} bytes)",
    )
  return await concurrency.run_in_threadpool(model.tokenizer.encode, text, add_special_tokens)


class _BodyLimit:
  """ASGI middleware: a request body of more than `max_bytes` (by its Content-Length, or the bytes that arrive) is a
  413, raised where the app reads the body (an HTTPException, which the app's handler answers)."""

  def __init__(self, app, max_bytes: int):
    self.app, self.max_bytes = app, max_bytes

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    declared = dict(scope["headers"]).get(b"content-length", b"")  # The server refuses a malformed one.
    too_large, seen = declared.isdigit() and int(declared) > self.max_bytes, 0

    async def limited():
      nonlocal seen
      if not too_large:
        message = await receive()
        seen += len(message.get("body", b""))
        if seen <= self.max_bytes or message["type"] != "http.request":
          return message
      mib = self.max_bytes / 2**20
      raise fastapi.HTTPException(413, f"the request body is larger than the server's limit of {mib:g} MiB")

    return await self.app(scope, limited, send)


def _event(obj: dict) -> str:
  return "data: " + pydantic.TypeAdapter(dict).dump_json(obj).decode() + "\n\n"


def _usage(prompt: int, gens: list[_Generation]) -> dict:
  """OpenAI's usage of the choices `gens` of one prompt (counted once; cached: its tokens the first choice took from
  the prefix cache)."""
  completion = sum(len(gen.out.ids) for gen in gens)
  usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
  return dict(usage, prompt_tokens_details={"cached_tokens": gens[0].handle.cached_tokens})


def _message(m: schemas.Message, i: int) -> dict:
  """Chat message i as the template sees it: content parts of type text joined into one string (a 400 for parts of
  another type: an image, audio), an assistant's tool call arguments as the mapping their JSON holds."""
  d = m.model_dump(exclude_none=False)
  if isinstance(m.content, list):
    for k, p in enumerate(m.content):
      if p.get("type") != "text" or not isinstance(p.get("text"), str):
        raise ApiError(
            400, f"messages[{i}].content[{k}]: only parts of type text with a text are served, got {p.get('type')!r}"
        )
    d["content"] = "".join(p["text"] for p in m.content)
  elif m.content is None:  # An assistant turn of tool calls only.
    d["content"] = ""
  calls = d.get("tool_calls") if m.role == "assistant" else None
  for k, call in enumerate(calls if isinstance(calls, list) else []):
    fn = call.get("function") if isinstance(call, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):  # As vLLM: templates read them as a mapping.
      try:
        fn["arguments"] = json.loads(fn["arguments"]) if fn["arguments"] else {}
      except json.JSONDecodeError as e:
        raise ApiError(400, f"messages[{i}].tool_calls[{k}].function.arguments: not JSON ({e.msg})") from e
  return d


def _seed(seed: int | None) -> int:
  """A request's sampling seed as the engine keys it (31 bits); a random one when not given."""
  return secrets.randbits(31) if seed is None else seed & 0x7FFFFFFF


def _sampling(body: schemas.Params, model: Model) -> SamplingConfig:
  """The request's sampling settings: the config's where a field is left out."""
  base = model.loop.server.engine.config.sampling
  given = dict(
      temperature=body.temperature,
      top_p=body.top_p,
      top_k=None if body.top_k is None else max(body.top_k, 0),
      min_p=body.min_p,
      presence_penalty=body.presence_penalty,
      frequency_penalty=body.frequency_penalty,
      repetition_penalty=body.repetition_penalty,
  )
  return dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})


# Structured output's request fields -> the grammar kind each gives (jaxkv.serving.grammar.KINDS).
_GRAMMAR_FIELDS = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_grammar": "grammar",
    "grammar": "grammar",
}


def _grammar_spec(body: schemas.Params) -> tuple[str, str, object] | None:
  """The request's grammar as (field, kind, source), None without; a 400 for more than one."""
  given = [(f, kind, getattr(body, f)) for f, kind in _GRAMMAR_FIELDS.items() if getattr(body, f) is not None]
  fmt = body.response_format
  if fmt is not None and fmt.type == "json_object":
    given.append(("response_format", "json_object", None))
  elif fmt is not None and fmt.type == "json_schema":
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
      raise ApiError(400, "response_format: type json_schema needs json_schema.schema")
    given.append(("response_format", "json_schema", fmt.json_schema.schema_))
  if len(given) > 1:
    raise ApiError(400, f"one structured output field per request, got {', '.join(f for f, *_ in given)}")
  return given[0] if given else None


async def _compile(model: Model, field: str, kind: str, source):
  """A request's grammar (jaxkv.serving.grammar.Grammar), compiled on a worker thread; a 400 naming `field` where it
  cannot be."""
  if model.tokenizer is None or not model.eos_ids:
    raise ApiError(400, f"{field}: structured output needs a checkpoint with a tokenizer.json and end of sequence ids")
  try:
    return await concurrency.run_in_threadpool(lambda: model.grammars.compile(kind, source))
  except ValueError as e:
    raise ApiError(400, f"{field}: the grammar does not compile: {str(e).splitlines()[0]}") from e


def _tokenizer(model: Model) -> tokenizer_lib.Tokenizer:
  if model.tokenizer is None:
    raise ApiError(400, "this model has no tokenizer.json: serve a checkpoint with one")
  return model.tokenizer


def _ids(ids, model: Model, what: str = "stop_token_ids") -> list[int]:
  """Token ids of a request field, checked against the vocabulary (a 400 otherwise)."""
  vocab = model.loop.server.engine.config.model.vocab_size
  bad = [i for i in ids if not 0 <= i < vocab]
  if bad:
    raise ApiError(400, f"{what}: token id {bad[0]} is outside the vocabulary [0, {vocab})")
  return list(ids)


def _rules(body: schemas.Params, model: Model, eos: frozenset[int]) -> sampling_lib.Rules | None:
  """The request's logit rules: its logit_bias, and its end ids held back until min_tokens (None: no rule)."""
  bias = {}
  for key, value in (body.logit_bias or {}).items():
    if not key.lstrip("-").isdigit():
      raise ApiError(400, f"logit_bias: keys are token ids, got {key!r}")
    if not -100.0 <= value <= 100.0:
      raise ApiError(400, f"logit_bias: biases are in [-100, 100], got {value} for token {key}")
    bias[_ids([int(key)], model, "logit_bias")[0]] = value
  held = tuple(sorted(eos | model.loop.server.engine.config.sampling.stop_ids)) if body.min_tokens else ()
  if not bias and not held:
    return None
  try:
    return sampling_lib.Rules(bias, body.min_tokens, held)
  except ValueError as e:
    raise ApiError(400, str(e)) from e


def uvicorn_server(app: fastapi.FastAPI, host: str, port: int, log_level: str = "warning") -> uvicorn.Server:
  """A uvicorn server for the app (run() it; SIGTERM or should_exit = True lets the responses in flight finish)."""
  return uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=None))


def build_model(
    config_dict,
    *,
    checkpoint_dir: str | None,
    dtype: str | None,
    parallel: int,
    seed: int,
    max_queue: int,
    name: str,
    prefix_cache_bytes: int = 0,
    gguf: str | None = None,
    eos: bool = True,
    warmup: Callable[[str], None] | None = None,
) -> Model:
  """The engine, its serving loop (started, its first shapes compiled by one short request), and the tokenizer, chat
  template and end of sequence ids of a checkpoint folder or GGUF file (`gguf`) as `python3 -m jaxkv.generate` reads
  them (jaxkv.preflight.resolve, jaxkv.run); without either, seeded random weights. A folder without a
  tokenizer.json serves token ids only. The checkpoint's end ids end a request in the loop unless it asks
  "ignore_eos" (or `eos` is False); the config's sampling.eos_ids always do. InputError for bad input, before any
  weight is read. warmup: when given, every window bucket's decode programs are compiled for the capacity before the
  loop starts (jaxkv.warmup), and each bucket's progress line is passed to it."""
  from jaxkv import preflight  # pylint: disable=g-import-not-at-top
  from jaxkv import run  # pylint: disable=g-import-not-at-top

  tokenizer = None
  eos_ids: frozenset[int] = frozenset()
  if checkpoint_dir or gguf:
    job = preflight.resolve(config_dict, checkpoint_dir, dtype, gguf, eos=False)
    preflight.check_host_memory(job, parallel)
    if gguf or os.path.isfile(os.path.join(checkpoint_dir, tokenizer_lib.TOKENIZER_FILE)):
      with preflight.input_errors(preflight.FAILURE):
        tokenizer = run.tokenizer(checkpoint_dir, gguf)
    if eos:
      eos_ids = preflight.checkpoint_eos_ids(checkpoint_dir, gguf)
    engine = run.checkpoint_engine(job, checkpoint_dir, dtype, gguf)
  else:
    job = preflight.resolve(config_dict)
    preflight.check_host_memory(job, parallel)
    engine = run.random_engine(job, seed)[1]
  if warmup is not None:
    warmup_lib.warm_up(engine, parallel, warmup)
  loop = loop_lib.ServingLoop(server_lib.Server(engine, parallel, prefix_cache_bytes), max_queue).start()
  done = threading.Event()
  loop.submit(Request((0,), 2), lambda *_: None, lambda why, err: done.set())
  done.wait()
  template = tokenizer.chat_template if tokenizer is not None else None
  return Model(name, loop, tokenizer, template, eos_ids)
