"""Who may call the HTTP API: an API key (OpenAI's `Authorization: Bearer <key>`; /health stays open, for load
balancers) and the browser origins allowed by CORS (starlette's CORSMiddleware)."""

from __future__ import annotations

import dataclasses
import secrets

import fastapi
from fastapi import responses
from fastapi.middleware import cors

OPEN_PATHS = frozenset({"/health"})


@dataclasses.dataclass(frozen=True)
class Access:
  """api_key: the key every request but OPEN_PATHS' must send (None: none needed); cors_origins: the origins a
  browser may call from ("*": any; empty: no CORS headers)."""

  api_key: str | None = None
  cors_origins: tuple[str, ...] = ()

  def install(self, app: fastapi.FastAPI) -> None:
    """Adds the key check, then CORS around it (so that a browser's preflight, which carries no key, is answered)."""
    if self.api_key is not None:
      expected = f"Bearer {self.api_key}".encode()

      @app.middleware("http")
      async def check_key(request: fastapi.Request, call_next):
        given = request.headers.get("authorization", "").encode()
        if request.url.path in OPEN_PATHS or secrets.compare_digest(given, expected):
          return await call_next(request)
        error = {
            "message": "a valid API key is needed: send 'Authorization: Bearer <key>'",
            "type": "authentication_error",
        }
        return responses.JSONResponse({"error": dict(error, param=None, code="invalid_api_key")}, 401)

    if self.cors_origins:
      app.add_middleware(
          cors.CORSMiddleware,
          allow_origins=list(self.cors_origins),
          allow_methods=["*"],
          allow_headers=["*"],
          allow_credentials="*" not in self.cors_origins,
      )


def read_key_file(path: str) -> str:
  """The API key in a file (its first line, stripped); ValueError when it is missing or empty."""
  try:
    with open(path, encoding="utf-8") as f:
      key = f.readline().strip()
  except OSError as e:
    raise ValueError(f"cannot read the API key file {path} ({e.strerror})") from e
  if not key:
    raise ValueError(f"the API key file {path} is empty")
  return key
