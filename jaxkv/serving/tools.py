"""Tool calls: which format a chat template's model calls tools in, and the calls parsed out of its text.

Two formats, told apart by the template's source (as vLLM's `hermes` and `llama3_json` parsers):
  * "hermes" (Qwen2.5, Qwen3, Hermes: the template writes `<tool_call>`): each call is
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, after any text;
  * "llama3_json" (Llama-3.1 to 3.3: the template renders `tools` without `<tool_call>`): the whole answer is
    `{"name": ..., "parameters": {...}}` (calls joined by ";"), after an optional `<|python_tag|>`.
A template that never reads `tools` has none. A text that does not parse as calls is content.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

HERMES_START = "<tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def template_format(source: str) -> str | None:
  """The tool call format of a chat template's source: "hermes", "llama3_json", or None (it renders no tools)."""
  if not re.search(r"\btools\b", source):
    return None
  return "hermes" if HERMES_START in source else "llama3_json"


@dataclasses.dataclass(frozen=True)
class Call:
  name: str
  arguments: str  # JSON text, as OpenAI's.

  def openai(self, index: int | None = None) -> dict:
    """OpenAI's tool call (with `index`: a stream's delta)."""
    call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": dataclasses.asdict(self)}
    return call if index is None else dict(call, index=index)


def content_length(fmt: str, text: str, final: bool) -> int:
  """How much of a streamed answer's `text` so far is surely content (the rest may start a tool call: held)."""
  if fmt == "hermes":
    start = text.find(HERMES_START)
    if start >= 0:
      return start
    if final:
      return len(text)
    partial = max((k for k in range(1, len(HERMES_START)) if text.endswith(HERMES_START[:k])), default=0)
    return len(text) - partial
  head = text.lstrip()
  could_be_call = head.startswith(("{", PYTHON_TAG)) or (PYTHON_TAG.startswith(head) and not final)
  return 0 if could_be_call or (not head and not final) else len(text)


def parse(fmt: str, text: str) -> tuple[str, list[Call]]:
  """(the content before the calls, the calls) of an answer; (text, []) where it holds none that parse."""
  if fmt == "hermes":
    start = text.find(HERMES_START)
    if start < 0:
      return text, []
    calls = [_call(body, "arguments") for body in _HERMES.findall(text[start:])]
    return (text[:start].rstrip(), calls) if calls and all(calls) else (text, [])
  head = text.lstrip().removeprefix(PYTHON_TAG).strip()
  if not head.startswith("{"):
    return text, []
  calls = [_call(body, "parameters") for body in _split_objects(head)]
  return ("", calls) if calls and all(calls) else (text, [])


def _call(body: str, key: str) -> Call | None:
  try:
    obj = json.loads(body)
  except json.JSONDecodeError:
    return None
  if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
    return None
  args = obj.get(key, obj.get("arguments", {}))
  return Call(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _split_objects(text: str) -> list[str]:
  """JSON objects joined by ";" (Llama-3's parallel calls) -> each object's text."""
  decoder, out, i = json.JSONDecoder(), [], 0
  while i < len(text):
    try:
      _, end = decoder.raw_decode(text, i)
    except json.JSONDecodeError:
      return [text]
    out.append(text[i:end])
    i = end
    while i < len(text) and text[i] in " \n;":
      i += 1
  return out
