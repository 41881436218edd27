"""Chat templates rendered as transformers' `apply_chat_template` renders them: the checkpoint's Jinja2 template
(tokenizer_config.json's `chat_template`, or chat_template.jinja) in an immutable sandbox, with trim_blocks,
lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson` that does not escape HTML, and the
tokenizer's special tokens (bos_token, eos_token...) as variables. Jinja2 (the `gguf` and `serve` extras) is imported
only where a template is parsed: without it, a checkpoint's text prompts work and only its chat template fails,
naming the extra."""

from __future__ import annotations

import datetime
import importlib.util
import json
import os

CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"


def _jinja2():
  try:
    import jinja2  # pylint: disable=g-import-not-at-top
    import jinja2.ext  # pylint: disable=g-import-not-at-top
    import jinja2.sandbox  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ValueError("chat templates need jinja2: pip install 'jaxkv[gguf]' (or jinja2)") from e
  return jinja2


def _raise_exception(message):
  raise _jinja2().exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
  return datetime.datetime.now().strftime(fmt)


class ChatTemplate:
  """messages -> the prompt text. special_tokens: {"bos_token": "<s>", ...}, passed to the template."""

  def __init__(self, template: str, special_tokens: dict[str, str]):
    self.source = template
    self.special_tokens = dict(special_tokens)
    self._template = None
    if importlib.util.find_spec("jinja2") is not None:
      self._compiled()  # A template that does not parse fails here, not at its first use.

  def _compiled(self):
    """The parsed template (ValueError when it does not parse, or without jinja2)."""
    if self._template is not None:
      return self._template
    jinja2 = _jinja2()
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    try:
      self._template = env.from_string(self.source)
    except jinja2.TemplateSyntaxError as e:
      raise ValueError(f"the chat template does not parse: {e}") from e
    return self._template

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

  def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
    """The prompt text of a conversation (tools: the functions the model may call, OpenAI's `tools`, as the template
    renders them); ValueError when the template rejects it (raise_exception)."""
    template = self._compiled()
    extra = {} if tools is None else {"tools": tools}
    try:
      return template.render(
          messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens, **extra
      )
    except _jinja2().TemplateError as e:
      raise ValueError(f"the chat template rejects these messages: {e}") from e
