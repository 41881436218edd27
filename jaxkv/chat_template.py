"""Chat templates rendered as transformers' `apply_chat_template` renders them: the checkpoint's Jinja2 template
(tokenizer_config.json's `chat_template`, or chat_template.jinja) in an immutable sandbox, with trim_blocks,
lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson` that does not escape HTML, and the
tokenizer's special tokens (bos_token, eos_token...) as variables."""

from __future__ import annotations

import datetime
import json
import os

import jinja2
import jinja2.ext
import jinja2.sandbox

CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"


def _raise_exception(message):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
  return datetime.datetime.now().strftime(fmt)


class ChatTemplate:
  """messages -> the prompt text. special_tokens: {"bos_token": "<s>", ...}, passed to the template."""

  def __init__(self, template: str, special_tokens: dict[str, str]):
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    try:
      self._template = env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
      raise ValueError(f"the chat template does not parse: {e}") from e
    self.special_tokens = dict(special_tokens)

  @classmethod
  def from_dir(cls, checkpoint_dir: str) -> ChatTemplate | None:
    """The template of a checkpoint folder (chat_template.jinja, else tokenizer_config.json's chat_template, the
    "default" one of a list), or None when it has none."""
    config = {}
    path = os.path.join(checkpoint_dir, CONFIG_FILE)
    if os.path.isfile(path):
      with open(path) as f:
        config = json.load(f)
    template = config.get("chat_template")
    if os.path.isfile(os.path.join(checkpoint_dir, TEMPLATE_FILE)):
      with open(os.path.join(checkpoint_dir, TEMPLATE_FILE)) as f:
        template = f.read()
    if isinstance(template, list):
      template = {t["name"]: t["template"] for t in template}.get("default")
    if not template:
      return None
    special = {}
    for k, v in config.items():
      if k.endswith("_token") and isinstance(v, (str, dict)):
        special[k] = v["content"] if isinstance(v, dict) else v
    return cls(template, special)

  def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The prompt text of a conversation; ValueError when the template rejects it (raise_exception)."""
    try:
      return self._template.render(
          messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens
      )
    except jinja2.TemplateError as e:
      raise ValueError(f"the chat template rejects these messages: {e}") from e
