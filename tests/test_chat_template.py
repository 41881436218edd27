"""jaxkv.chat_template renders a checkpoint's chat template as transformers' apply_chat_template does: the same text
and, encoded without added special tokens, the same ids."""

import json
import os

import pytest
import tokenizers

from jaxkv import chat_template as chat_template_lib
from jaxkv import tokenizer as tokenizer_lib

transformers = pytest.importorskip("transformers", reason="the parity extra: pip install -e '.[test,parity]'")

SPECIAL = ["<bos>", "<eos>", "<|user|>", "<|assistant|>", "<|system|>"]
WORDS = {"<unk>": 0, **{t: i + 1 for i, t in enumerate(SPECIAL)}, **{f"w{i}": i for i in range(6, 256)}}
# Loop variables, filters, raise_exception, tojson and the special tokens, with trim_blocks/lstrip_blocks at work.
TEMPLATE = """{{ bos_token }}
{%- for m in messages %}
  {%- if m['role'] == 'system' and not loop.first %}{{ raise_exception('the system message must come first') }}{% endif %}
<|{{ m['role'] }}|> {{ m['content'] | trim }}
  {%- if m['role'] == 'assistant' %} {{ eos_token }}{% endif %}
  {%- if m.get('name') %} {{ m['name'] | tojson }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %} <|assistant|>{% endif %}"""
MESSAGES = [
    {"role": "system", "content": "w7"},
    {"role": "user", "content": " w8 w9 ", "name": "w12"},
    {"role": "assistant", "content": "w10"},
    {"role": "user", "content": "w11"},
]


def write_tokenizer(path, where: str):
  """A word-level tokenizer saved by transformers, its chat template in chat_template.jinja (transformers 5) or in
  tokenizer_config.json (earlier)."""
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(WORDS, unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens(SPECIAL)
  tok.post_processor = tokenizers.processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
  hf = transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>", chat_template=TEMPLATE
  )
  hf.save_pretrained(path)
  jinja = os.path.join(path, chat_template_lib.TEMPLATE_FILE)
  if where == "tokenizer_config.json" and os.path.isfile(jinja):
    os.remove(jinja)
    config_path = os.path.join(path, chat_template_lib.CONFIG_FILE)
    with open(config_path) as f:
      config = json.load(f)
    with open(config_path, "w") as f:
      json.dump(dict(config, chat_template=TEMPLATE), f)
  return transformers.AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("where", ["chat_template.jinja", "tokenizer_config.json"])
def test_renders_and_encodes_as_transformers(tmp_path, where):
  hf = write_tokenizer(tmp_path, where)
  template = chat_template_lib.ChatTemplate.from_dir(str(tmp_path))
  tok = tokenizer_lib.Tokenizer.from_dir(str(tmp_path))
  for messages in (MESSAGES, MESSAGES[:2]):
    for add in (True, False):
      want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
      text = template.render(messages, add_generation_prompt=add)
      assert text == want
      ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add)["input_ids"]
      assert tok.encode(text, add_special_tokens=False) == ids
  assert text == '<bos><|system|> w7<|user|> w8 w9 "w12"'  # The last: MESSAGES[:2], no generation prompt.


def test_the_template_s_exceptions_are_value_errors(tmp_path):
  write_tokenizer(tmp_path, "chat_template.jinja")
  template = chat_template_lib.ChatTemplate.from_dir(str(tmp_path))
  with pytest.raises(ValueError, match="rejects these messages: the system message must come first"):
    template.render([MESSAGES[1], MESSAGES[0]])


def test_no_template_is_none(tmp_path):
  assert chat_template_lib.ChatTemplate.from_dir(str(tmp_path)) is None
  with pytest.raises(ValueError, match="does not parse"):
    chat_template_lib.ChatTemplate("{% for %}", {})
