"""The request bodies of the HTTP API (jaxkv.serving.api), as pydantic models: what each endpoint takes, with its
types (strict: "0.5" is not a number) and bounds. A field the server does not implement is refused, never ignored:
`extra="forbid"` for a field of no endpoint, `_NO_OPS` for OpenAI's fields that it accepts only with the value that
asks for nothing."""

from __future__ import annotations

import json
from typing import ClassVar, Literal

import pydantic
import pydantic_core

from jaxkv import sampling

# OpenAI fields the server does not implement, accepted only with the value that asks for nothing (clients send
# some of them by default); any other value, like a field of no endpoint, is a 400 naming it.
_NO_OPS = {
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None, True, False),
    "store": (None, False),
}
_PENALTY = pydantic.Field(None, ge=-2.0, le=2.0)
MAX_N = 16  # Samples a request may ask for (`n`): each is a request of the loop's queue.


class _StreamOptions(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(strict=True, extra="forbid")

  include_usage: bool = False


class _JsonSchema(pydantic.BaseModel):
  """OpenAI's response_format.json_schema."""

  model_config = pydantic.ConfigDict(strict=True, extra="forbid", populate_by_name=True)

  name: str | None = None
  description: str | None = None
  schema_: dict | None = pydantic.Field(None, alias="schema")
  strict: bool | None = None


class _ResponseFormat(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(strict=True, extra="forbid")

  type: Literal["text", "json_object", "json_schema"]
  json_schema: _JsonSchema | None = None


class Params(pydantic.BaseModel):
  """Fields of both endpoints. A field the server does not implement is refused (`_NO_OPS`, extra="forbid"); known
  ones must have their type (strict: "0.5" is not a number). Sampling fields left out take the config's."""

  model_config = pydantic.ConfigDict(strict=True, extra="forbid")
  no_ops: ClassVar[dict] = _NO_OPS

  model: str | None = None
  max_tokens: int | None = pydantic.Field(None, ge=1)
  temperature: float | None = pydantic.Field(None, ge=0.0)
  top_p: float | None = pydantic.Field(None, gt=0.0, le=1.0)
  top_k: int | None = pydantic.Field(None, ge=-1)  # -1 or 0: off.
  min_p: float | None = pydantic.Field(None, ge=0.0, le=1.0)
  presence_penalty: float | None = _PENALTY
  frequency_penalty: float | None = _PENALTY
  repetition_penalty: float | None = pydantic.Field(None, gt=0.0)
  logit_bias: dict[str, float] | None = None  # Token id (a string, as OpenAI's) -> a bias in [-100, 100].
  seed: int | None = None
  stop: str | list[str] | None = None
  stop_token_ids: list[pydantic.StrictInt] | None = None  # As vLLM: ids that end a request (kept as its last).
  stream: bool = False
  stream_options: _StreamOptions | None = None
  n: int = pydantic.Field(1, ge=1, le=MAX_N)  # Samples of the prompt (choices 0..n-1, sample i seeded seed + i).
  ignore_eos: bool = False  # As vLLM: run past the checkpoint's end of sequence ids (the config's eos_id still ends).
  min_tokens: int = pydantic.Field(0, ge=0)  # As vLLM: no end id (nor stop string) before this many tokens.
  user: str | None = None  # An end user's name for the operator's logs: nothing to do here.
  # Structured output (jaxkv.serving.grammar), one of: OpenAI's, vLLM's guided_* and llama-server's GBNF `grammar`.
  response_format: _ResponseFormat | None = None
  guided_json: dict | str | None = None
  guided_regex: str | None = None
  guided_grammar: str | None = None  # Lark or GBNF.
  grammar: str | None = None  # GBNF (or Lark).

  @pydantic.model_validator(mode="before")
  @classmethod
  def _refuse_no_ops(cls, data):
    """Drops the fields of _NO_OPS that ask for nothing; refuses the others."""
    if not isinstance(data, dict):
      return data
    for name, accepted in cls.no_ops.items():
      if name in data:
        value = data[name]
        if not any(value is a or (type(value) is type(a) and value == a) for a in accepted):
          shown = " or ".join(json.dumps(a) for a in accepted)
          raise pydantic_core.PydanticCustomError(
              "unsupported", f"unsupported field {name!r}: jaxkv does not implement it (it takes only {shown})"
          )
    return {k: v for k, v in data.items() if k not in cls.no_ops}


class _Function(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(strict=True, extra="forbid")

  name: str
  description: str | None = None
  parameters: dict | None = None  # Its arguments' JSON schema.
  strict: bool | None = None


class Tool(pydantic.BaseModel):
  """OpenAI's tool: a function the model may call (jaxkv.serving.tools)."""

  model_config = pydantic.ConfigDict(strict=True, extra="forbid")

  type: Literal["function"]
  function: _Function


class CompletionRequest(Params):
  no_ops: ClassVar[dict] = {k: v for k, v in _NO_OPS.items() if k != "echo"}

  prompt: str | list[pydantic.StrictInt] | list[str] | list[list[pydantic.StrictInt]]
  max_tokens: int | None = pydantic.Field(None, ge=0)  # 0: the prompt only, with echo (as vLLM).
  logprobs: int | None = pydantic.Field(None, ge=0, le=sampling.MAX_TOP_LOGPROBS)  # The top entries per token.
  echo: bool = False  # The prompt before the text; with logprobs, its tokens' logprobs (the first null) before.


class Message(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(strict=True, extra="allow")

  role: str
  content: str | list[dict] | None = None


class ChatRequest(Params):
  no_ops: ClassVar[dict] = {k: v for k, v in _NO_OPS.items() if k not in ("tools", "tool_choice")}

  messages: list[Message] = pydantic.Field(min_length=1)
  tools: list[Tool] | None = None
  tool_choice: Literal["none", "auto"] | None = None  # Default "auto" with tools ("none": rendered, not parsed).
  max_completion_tokens: int | None = pydantic.Field(None, ge=1)
  logprobs: bool = False
  top_logprobs: int | None = pydantic.Field(None, ge=0, le=sampling.MAX_TOP_LOGPROBS)


class TokenizeRequest(pydantic.BaseModel):
  """llama-server's /tokenize."""

  model_config = pydantic.ConfigDict(strict=True, extra="forbid")

  content: str
  add_special: bool = False
  with_pieces: bool = False


class DetokenizeRequest(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(strict=True, extra="forbid")

  tokens: list[pydantic.StrictInt]


class SlotFileRequest(pydantic.BaseModel):
  """llama-server's POST /slots/{id_slot}?action=save|restore: a file name in the slot save path."""

  model_config = pydantic.ConfigDict(strict=True, extra="forbid")

  filename: str
