"""The server with a checkpoint's tokenizer and chat template (a tiny Llama written here): text prompts, chat
completions through the template, stop strings, and streamed text that adds up to the whole."""

import json
import os
import threading
import time

import numpy as np
import pytest
import tokenizers
from safetensors.numpy import save_file

for _extra in ("fastapi", "uvicorn", "prometheus_client", "httpx", "openai"):
  pytest.importorskip(_extra, reason="the serve extra: pip install -e '.[serve]'")

# pylint: disable=g-import-not-at-top,g-bad-import-order
import httpx
import openai
import serve_helpers

from experiments import tiny
from jaxkv import chat_template as chat_template_lib
from jaxkv import checkpoint
from jaxkv import config as config_lib
from jaxkv import run as run_lib
from jaxkv import tokenizer as tokenizer_lib

# pylint: enable=g-import-not-at-top,g-bad-import-order

SPECIAL = ["<unk>", "<bos>", "<eos>", "<|user|>", "<|assistant|>"]
WORDS = {**{t: i for i, t in enumerate(SPECIAL)}, **{f"w{i}": i for i in range(len(SPECIAL), 256)}}
TEMPLATE = "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
TEMPLATE += "{% if add_generation_prompt %}<|assistant|>{% endif %}"
TIMEOUT_S = 120.0
EOS_PROMPT = "w40 w41 w42"


def write_checkpoint(path) -> None:
  """A 2-layer Llama with random weights, a word-level tokenizer.json adding <bos>, and a chat template."""
  d, heads, kv, dh, mlp, vocab, layers = 64, 8, 4, 16, 128, 256, 2
  hf = dict(
      architectures=["LlamaForCausalLM"],
      model_type="llama",
      vocab_size=vocab,
      hidden_size=d,
      num_hidden_layers=layers,
      num_attention_heads=heads,
      num_key_value_heads=kv,
      head_dim=dh,
      intermediate_size=mlp,
      rms_norm_eps=1e-6,
      rope_theta=10_000.0,
      tie_word_embeddings=False,
      torch_dtype="float32",
  )
  rng = np.random.default_rng(0)
  w = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
  ones = lambda n: np.ones(n, np.float32)
  t = {"model.embed_tokens.weight": w(vocab, d), "model.norm.weight": ones(d), "lm_head.weight": w(vocab, d)}
  for l in range(layers):
    p = f"model.layers.{l}."
    t.update({p + "input_layernorm.weight": ones(d), p + "post_attention_layernorm.weight": ones(d)})
    t.update({p + "self_attn.q_proj.weight": w(heads * dh, d), p + "self_attn.o_proj.weight": w(d, heads * dh)})
    t.update({p + "self_attn.k_proj.weight": w(kv * dh, d), p + "self_attn.v_proj.weight": w(kv * dh, d)})
    t.update({p + "mlp.gate_proj.weight": w(mlp, d), p + "mlp.up_proj.weight": w(mlp, d)})
    t[p + "mlp.down_proj.weight"] = w(d, mlp)
  with open(os.path.join(path, checkpoint.CONFIG_FILE), "w") as f:
    json.dump(hf, f)
  save_file(t, os.path.join(path, checkpoint.WEIGHTS_FILE), metadata={"format": "pt"})
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(WORDS, unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tok.decoder = tokenizers.decoders.WordPiece(prefix="##")  # Joins words with spaces.
  tok.add_special_tokens(SPECIAL)
  tok.post_processor = tokenizers.processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
  tok.save(os.path.join(path, tokenizer_lib.TOKENIZER_FILE))
  with open(os.path.join(path, chat_template_lib.CONFIG_FILE), "w") as f:
    json.dump(dict(chat_template=TEMPLATE, bos_token="<bos>", eos_token={"content": "<eos>"}), f)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("llama"))
  write_checkpoint(path)
  cd = tiny.get_config()
  cd.mesh.tensor = 2  # Divides the 4 KV heads.
  _, _, _, engine = run_lib.build_from_checkpoint(config_lib.from_config_dict(cd), path)
  tok = tokenizer_lib.Tokenizer.from_dir(path)
  template = chat_template_lib.ChatTemplate.from_dir(path)
  eos = engine.generate([tok.encode(EOS_PROMPT)], 12).tokens[0][5]  # An end of sequence id that this prompt meets.
  with open(os.path.join(path, "generation_config.json"), "w") as f:
    json.dump(dict(eos_token_id=[eos, 255]), f)
  eos_ids = checkpoint.eos_ids(path)
  assert eos_ids == {eos, 255}
  with serve_helpers.running(engine, parallel=4, tokenizer=tok, template=template, eos_ids=eos_ids) as (url, _):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)
    yield client, engine, tok, eos


def test_the_checkpoint_s_end_of_sequence_ends_a_request(served):
  client, engine, tok, eos = served
  want = engine.generate([tok.encode(EOS_PROMPT)], 12).tokens[0]
  cut = want[: want.index(eos) + 1]
  out = client.completions.create(model="tiny", prompt=EOS_PROMPT, max_tokens=12, temperature=0).choices[0]
  assert out.token_ids == cut and out.finish_reason == "stop" and out.text == tok.decode(cut[:-1])
  on = client.completions.create(
      model="tiny", prompt=EOS_PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
  ).choices[0]
  assert on.token_ids == want and on.finish_reason == "length"


def test_text_prompts_and_streamed_text(served):
  client, engine, tok, _ = served
  out = client.completions.create(model="tiny", prompt="w7 w8 w9", max_tokens=10, temperature=0)
  ids = out.choices[0].token_ids
  assert ids == engine.generate([tok.encode("w7 w8 w9")], 10).tokens[0]
  assert out.choices[0].text == tok.decode(ids) and out.usage.prompt_tokens == 4
  chunks = list(client.completions.create(model="tiny", prompt="w7 w8 w9", max_tokens=10, temperature=0, stream=True))
  assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text


def test_stop_strings_cut_the_text_and_end_the_request(served):
  client, _, tok, _ = served
  full = client.completions.create(model="tiny", prompt="w20 w21", max_tokens=12, temperature=0).choices[0]
  words = full.text.split(" ")
  stop = words[3]  # Its first occurrence may come earlier.
  cut = full.text[: full.text.index(stop)]
  for stream in (False, True):
    out = client.completions.create(
        model="tiny", prompt="w20 w21", max_tokens=12, temperature=0, stop=[stop, "zz"], stream=stream
    )
    chunks = list(out) if stream else [out]
    text = "".join(c.choices[0].text for c in chunks)
    ids = [t for c in chunks for t in c.choices[0].token_ids]
    assert text == cut and chunks[-1].choices[0].finish_reason == "stop", stream
    assert ids == full.token_ids[: len(ids)] and stop in tok.decode(ids) and stop not in tok.decode(ids[:-1])


def test_chat_completions_use_the_template(served):
  client, engine, tok, _ = served
  messages = [
      {"role": "user", "content": "w30 w31"},
      {"role": "assistant", "content": "w32"},
      {"role": "user", "content": "w33"},
  ]
  out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
  prompt = tok.encode("<bos><|user|> w30 w31 <|assistant|> w32 <|user|> w33 <|assistant|>", add_special_tokens=False)
  assert prompt[:2] == [1, 3] and out.usage.prompt_tokens == len(prompt)
  choice = out.choices[0]
  assert choice.token_ids == engine.generate([prompt], 8).tokens[0]
  assert choice.message.role == "assistant" and choice.message.content == tok.decode(choice.token_ids)
  chunks = list(
      client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True)
  )
  assert chunks[0].choices[0].delta.role == "assistant"
  assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
  # Without max_tokens a chat request may run to the capacity.
  with pytest.raises(openai.BadRequestError, match="capacity"):
    client.chat.completions.create(model="tiny", messages=messages, max_tokens=500)


def test_chat_and_text_logprobs_in_the_openai_shapes(served):
  client, _, tok, _ = served
  messages = [{"role": "user", "content": "w50 w51"}]
  out = client.chat.completions.create(
      model="tiny", messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
  )
  choice = out.choices[0]
  content = choice.logprobs.content
  assert [c.token for c in content] == [tok.decode([t], skip_special_tokens=False) for t in choice.token_ids]
  for c in content:
    assert c.bytes == list(c.token.encode()) and len(c.top_logprobs) == 3
    assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == c.logprob  # Greedy.
    assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob >= c.top_logprobs[2].logprob
  chunks = list(
      client.chat.completions.create(
          model="tiny", messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3, stream=True
      )
  )
  streamed = [c for k in chunks if k.choices and k.choices[0].logprobs for c in k.choices[0].logprobs.content]
  assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
  text = client.completions.create(model="tiny", prompt="w7 w8", max_tokens=4, temperature=0, logprobs=1).choices[0]
  pieces = [tok.decode([t], skip_special_tokens=False) for t in text.token_ids]
  assert text.logprobs.tokens == pieces
  assert text.logprobs.text_offset == [sum(len(p) for p in pieces[:i]) for i in range(4)]
  with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
    client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, top_logprobs=2)


def test_min_tokens_holds_back_the_checkpoint_s_end_of_sequence(served):
  client, engine, tok, eos = served
  want = engine.generate([tok.encode(EOS_PROMPT)], 12).tokens[0]
  at = want.index(eos)
  out = client.completions.create(
      model="tiny", prompt=EOS_PROMPT, max_tokens=12, temperature=0, extra_body={"min_tokens": at + 2}
  ).choices[0]
  assert out.token_ids[:at] == want[:at] and eos not in out.token_ids[: at + 2]


def test_tokenize_and_detokenize_in_llama_server_s_shapes(served):
  client, _, tok, _ = served
  url = str(client.base_url).removesuffix("/v1/")
  ids = httpx.post(url + "/tokenize", json={"content": "w7 w8"}, timeout=TIMEOUT_S).json()["tokens"]
  assert ids == tok.encode("w7 w8", add_special_tokens=False)
  with_bos = httpx.post(url + "/tokenize", json={"content": "w7 w8", "add_special": True, "with_pieces": True})
  assert with_bos.json()["tokens"] == [
      {"id": 1, "piece": "<bos>"},
      {"id": ids[0], "piece": "w7"},
      {"id": ids[1], "piece": "w8"},
  ]
  assert httpx.post(url + "/detokenize", json={"tokens": ids}, timeout=TIMEOUT_S).json() == {"content": "w7 w8"}
  assert httpx.post(url + "/detokenize", json={"tokens": [100000]}, timeout=TIMEOUT_S).status_code == 400
  props = httpx.get(url + "/props", timeout=TIMEOUT_S).json()
  assert props["chat_template"] == TEMPLATE


def _url(client) -> str:
  return str(client.base_url).removesuffix("/").removesuffix("/v1")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("reason", ["eos", "stop", "length"])
def test_a_request_counts_once_under_its_end_with_its_tokens(served, reason, stream):
  client, _, _, _ = served
  url = _url(client)
  ask = dict(model="tiny", temperature=0, max_tokens=12, stream=stream)
  if stream:
    ask["stream_options"] = {"include_usage": True}
  if reason == "eos":
    ask["prompt"] = EOS_PROMPT
  elif reason == "stop":
    full = client.completions.create(model="tiny", prompt="w20 w21", max_tokens=12, temperature=0).choices[0]
    ask.update(prompt="w20 w21", stop=[full.text.split(" ")[3]])
  else:
    ask.update(prompt="w7 w8 w9", max_tokens=10, extra_body={"ignore_eos": True})
  before, tokens = serve_helpers.finished(url)
  out = client.completions.create(**ask)
  chunks = list(out) if stream else [out]
  usage = chunks[-1].usage
  finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
  after, tokens_after = serve_helpers.finished(url)
  assert serve_helpers.one_more(before, after, reason), (before, after)
  assert tokens_after - tokens == usage.completion_tokens > 0
  assert finish == ["length" if reason == "length" else "stop"]


@pytest.mark.parametrize(
    "body, status, message",
    [
        ({"messages": [{"role": "user", "content": "w7"}, {"role": "assistant", "content": None}]}, 200, None),
        ({"prompt": "w7 \ud800 w8"}, 400, "not valid Unicode (surrogates not allowed at character 3)"),
        ({"messages": [{"role": "user", "content": "w7 \udfff"}]}, 400, "not valid Unicode"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "w7"}]}]}, 200, None),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "w7"}, {"type": "image_url"}]}]},
            400,
            "messages[0].content[1]: only parts of type text with a text are served, got 'image_url'",
        ),
    ],
)
def test_null_content_parts_and_lone_surrogates_are_no_500(served, body, status, message):
  client, _, _, _ = served
  path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
  content = json.dumps(dict(body, max_tokens=2))  # Escapes the surrogates: the body is UTF-8.
  r = httpx.post(_url(client) + path, content=content, headers={"content-type": "application/json"}, timeout=TIMEOUT_S)
  assert r.status_code == status, r.text
  if message:
    assert message in r.json()["error"]["message"], r.text


def test_tokenizing_a_huge_prompt_stalls_no_one(served):
  """6 MiB of text, under the body limit: a word-level tokenizer gives no byte bound (it drops the spaces), so it is
  tokenized, for seconds, on a worker thread that lets go of the GIL, while /health answers; then refused as too long.
  """
  client, _, tok, _ = served
  assert tok.bytes_per_token() is None
  url, out, waits = _url(client), {}, []
  big = threading.Thread(
      target=lambda: out.update(
          r=httpx.post(url + "/v1/completions", json={"prompt": "w7 w8 " * (1 << 20)}, timeout=TIMEOUT_S)
      )
  )
  big.start()
  while big.is_alive():
    t0 = time.monotonic()
    assert httpx.get(url + "/health", timeout=TIMEOUT_S).status_code == 200
    waits.append(time.monotonic() - t0)
    time.sleep(0.05)
  big.join()
  assert out["r"].status_code == 400 and "longer than the cache capacity" in out["r"].json()["error"]["message"]
  assert len(waits) >= 5 and max(waits) < 2.0, waits


def test_chats_without_max_tokens_reserve_nothing_and_end_at_the_capacity(served):
  client, _, _, _ = served
  messages = [{"role": "user", "content": "w30 w31"}]
  out = client.chat.completions.create(model="tiny", messages=messages, temperature=0, extra_body={"ignore_eos": True})
  used = out.usage.prompt_tokens + out.usage.completion_tokens - 1  # The last token is not written.
  assert out.choices[0].finish_reason == "length" and used <= 128 and out.usage.completion_tokens > 64


def test_an_assistant_s_tool_call_arguments_reach_the_template_as_a_mapping(served):
  """As vLLM's: a template reads a tool call's arguments (JSON text in OpenAI's messages) as the mapping they hold."""
  _, engine, tok, _ = served
  source = TEMPLATE.replace(
      "{{ m['content'] }}",
      "{{ m['content'] }}{% for c in m.get('tool_calls') or [] %}{% if c.function.arguments is mapping %}"
      "w{{ c.function.arguments.n }} w9{% else %}w8{% endif %}{% endfor %}",
  )
  call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"n": 50}'}}
  messages = [
      {"role": "user", "content": "w30"},
      {"role": "assistant", "content": None, "tool_calls": [call]},
      {"role": "tool", "tool_call_id": "call_1", "content": "w31"},
  ]
  template = chat_template_lib.ChatTemplate(source, {"bos_token": "<bos>"})
  with serve_helpers.running(engine, parallel=4, tokenizer=tok, template=template) as (url, _):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    want = "<bos><|user|> w30 <|assistant|> w50 w9 <|tool|> w31 <|assistant|>"
    assert out.usage.prompt_tokens == len(tok.encode(want, add_special_tokens=False))
    call["function"]["arguments"] = "{not json"
    with pytest.raises(openai.BadRequestError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments: not JSON"):
      client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
