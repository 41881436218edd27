"""The tokenizer of a checkpoint folder: its tokenizer.json, read with Hugging Face `tokenizers`, and its chat template
(jaxkv.chat_template); or one built elsewhere (jaxkv.gguf_loader.tokenizer)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import tokenizers

from jaxkv import chat_template as chat_template_lib

TOKENIZER_FILE = "tokenizer.json"


class Tokenizer:
  """Text <-> token ids with a tokenizer.json.

  `encode` applies the tokenizer's post-processor, so a prompt starts with BOS exactly when the checkpoint's
  tokenizer adds one (Llama-3 adds <|begin_of_text|>, Qwen3 adds nothing).
  """

  def __init__(
      self,
      path: str,
      backend: tokenizers.Tokenizer | None = None,
      chat_template: chat_template_lib.ChatTemplate | None = None,
  ):
    """A tokenizer.json at `path`, or `backend` built from the file at `path`; `chat_template` serves
    `encode_chat`."""
    if backend is None:
      if not os.path.isfile(path):
        raise ValueError(f"no tokenizer file {path!r}")
      try:
        backend = tokenizers.Tokenizer.from_file(path)
      except Exception as e:  # tokenizers raises a bare Exception for a malformed file.
        raise ValueError(f"cannot read {path!r} as a tokenizers tokenizer.json: {e}") from e
    self._tok = backend
    self.path = path
    self.chat_template = chat_template

  @classmethod
  def from_dir(cls, checkpoint_dir: str) -> Tokenizer:
    """The tokenizer.json of a checkpoint folder (ValueError when there is none)."""
    path = os.path.join(checkpoint_dir, TOKENIZER_FILE)
    if not os.path.isfile(path):
      raise ValueError(f"checkpoint directory {checkpoint_dir!r} has no {TOKENIZER_FILE}: text prompts need one")
    return cls(path, chat_template=chat_template_lib.ChatTemplate.from_dir(checkpoint_dir))

  @property
  def vocab_size(self) -> int:
    """Ids in the vocabulary, added tokens included."""
    return self._tok.get_vocab_size(with_added_tokens=True)

  def bytes_per_token(self) -> int | None:
    """A bound on the UTF-8 bytes of text that one token covers, or None where none is known. A byte-level BPE
    tokenizer without a normalizer spells every byte of the text in its pieces, one character each: its longest
    piece (or added token) bounds it, so a text of more bytes than capacity * bound cannot fit. Other
    tokenizers may cover many bytes with one token or drop them (whitespace that a word-level tokenizer splits on)."""
    spec = json.loads(self._tok.to_str())
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if spec.get("normalizer") is not None or not any(p.get("type") == "ByteLevel" for p in parts):
      return None
    added = [len(t.content.encode()) for t in self._tok.get_added_tokens_decoder().values()]  # Matched as written.
    return max([len(piece) for piece in self._tok.get_vocab(with_added_tokens=False)] + added)

  def spec(self) -> str:
    """The tokenizer as the tokenizers library writes it (tokenizer.json's JSON)."""
    return self._tok.to_str()

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of `text`, with the special tokens (BOS) that the tokenizer's post-processor adds unless
    add_special_tokens=False (a rendered chat template writes its own)."""
    # encode_batch, unlike encode, lets go of the GIL while it works: a server's other threads run meanwhile.
    return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
    """The text of `messages` ([{"role": "user", "content": ...}, ...]) in the chat template, as transformers'
    `apply_chat_template(tokenize=False)` renders it."""
    if self.chat_template is None:
      raise ValueError(f"the tokenizer of {self.path!r} has no chat template")
    return self.chat_template.render(list(messages), add_generation_prompt)

  def end_of_turn_id(self) -> int | None:
    """The special token that the chat template writes right after an assistant's message (Llama-3's <|eot_id|>,
    ChatML's <|im_end|>), or None: no template, jinja2 missing, or text there that is not a special token."""
    if self.chat_template is None:
      return None
    mark = "jaxkv-end-of-turn-probe"
    try:
      text = self.apply_chat_template(
          [{"role": "user", "content": "hi"}, {"role": "assistant", "content": mark}], add_generation_prompt=False
      )
    except ValueError:
      return None
    after = self._tok.encode(text.partition(mark)[2], add_special_tokens=False).ids
    special = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
    return after[0] if after and after[0] in special else None

  def encode_chat(self, messages: Sequence[dict]) -> list[int]:
    """Token ids of `messages` in the chat template, with the prompt for the assistant's turn. The template writes
    the special tokens itself: the post-processor adds none."""
    return self.encode(self.apply_chat_template(messages), add_special_tokens=False)


class Detokenizer:
  """Text of a growing token sequence, piece by piece (for streaming): `add` returns the new text, held back while
  the last tokens end inside a UTF-8 character. It decodes only the tokens since the last piece, with the token before
  them for context, as the whole sequence would decode."""

  def __init__(self, tokenizer: Tokenizer):
    self._tok, self._ids = tokenizer, []
    self._prefix = self._read = 0  # ids[prefix:read] decoded to the text already returned (context).

  def add(self, ids: Sequence[int], final: bool = False) -> str:
    """The text that `ids` add; `final`: the sequence ended, return what was held back too."""
    self._ids.extend(ids)
    before = self._tok.decode(self._ids[self._prefix : self._read])
    text = self._tok.decode(self._ids[self._prefix :])
    if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
      return ""
    self._prefix, self._read = self._read, len(self._ids)
    return text[len(before) :]
