"""The tokenizer that a GGUF file's metadata describes, built with Hugging Face `tokenizers` (no transformers).

llama.cpp's converter stores the vocabulary (`tokenizer.ggml.tokens`), each token's type (`token_type`), the merges
of a BPE vocabulary (`merges`) or the scores of a SentencePiece one (`scores`), the pre-tokenizer's name (`pre`) and
the special ids. Two kinds of vocabulary (`tokenizer.ggml.model`) are built, as transformers' GGUF loader builds
them (tests/test_gguf.py compares the ids):

  gpt2   byte-level BPE (Llama-3, Qwen3, SmolLM2): the pre-tokenizer's split regex by its name (GPT-2's for a name
         not listed), the vocabulary spelled in the byte alphabet, the file's merges.
  llama  SentencePiece BPE (Llama-2 style): Metaspace, byte fallback, merges recovered from the scores.

Tokens typed control (and unknown) become special added tokens, user-defined ones plain added tokens, so that the
text of either is never cut into pieces. BOS (and EOS) are added as `tokenizer.ggml.add_bos_token` (`add_eos_token`)
say: by default BOS for a llama vocabulary, nothing for gpt2.
"""

from __future__ import annotations

import tokenizers
from tokenizers import decoders
from tokenizers import models
from tokenizers import pre_tokenizers
from tokenizers import processors

CONTROL, UNKNOWN, USER_DEFINED = 3, 2, 4  # llama.cpp's token types.

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split regex its merges were learned with (the families of the llama and qwen3
# architectures); any other name splits as GPT-2 does.
SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
MODELS = ("gpt2", "llama")


def _byte_alphabet() -> dict[int, str]:
  """GPT-2's byte -> printable character map (bytes that print stand for themselves)."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
  out = {b: chr(b) for b in printable}
  extra = (b for b in range(256) if b not in out)
  out.update({b: chr(256 + i) for i, b in enumerate(extra)})
  return out


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
  """A SentencePiece vocabulary's BPE merges: every split of a token into two tokens, best score first
  (transformers' generate_merges)."""
  merges = []
  for token, score in scores.items():
    pairs = [(token[:i], token[i:], score) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
    merges += sorted(pairs, key=lambda m: (vocab[m[0]], vocab[m[1]]))
  merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
  return [(a, b) for a, b, _ in merges]


def build(meta: dict) -> tokenizers.Tokenizer:
  """The tokenizer of GGUF metadata `meta` ({key: value}, the tokenizer arrays included), or ValueError."""
  kind = meta.get("tokenizer.ggml.model")
  tokens = meta.get("tokenizer.ggml.tokens")
  if kind not in MODELS or not tokens:
    raise ValueError(
        f"the GGUF file's tokenizer is {kind!r}{'' if tokens else ' without tokens'}: jaxkv builds "
        f"{' and '.join(MODELS)} vocabularies (text prompts need one; token ids work without)"
    )
  types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
  if kind == "gpt2":
    spell = _byte_alphabet()
    alphabet = set(spell.values())
    spelled = [t if set(t) <= alphabet else "".join(spell[b] for b in t.encode()) for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    if "tokenizer.ggml.merges" not in meta:
      raise ValueError("the GGUF file's gpt2 vocabulary has no tokenizer.ggml.merges")
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    tok = tokenizers.Tokenizer(
        models.BPE(vocab, merges, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    )
    split = SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if split is None:
      tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
      tok.pre_tokenizer = pre_tokenizers.Sequence(
          [
              pre_tokenizers.Split(tokenizers.Regex(split), behavior="isolated"),
              pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
          ]
      )
    tok.decoder = decoders.ByteLevel()
    special = [t for t, k in zip(spelled, types) if k in (CONTROL, UNKNOWN) and set(t) <= alphabet]
  else:
    vocab = {t: i for i, t in enumerate(tokens)}
    if "tokenizer.ggml.merges" in meta:
      merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    else:
      merges = _merges_from_scores(vocab, dict(zip(tokens, meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))))
    tok = tokenizers.Tokenizer(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    special = [t for t, k in zip(tokens, types) if k in (CONTROL, UNKNOWN)]
  names = spelled if kind == "gpt2" else tokens
  tok.add_special_tokens([tokenizers.AddedToken(t, normalized=False, special=True) for t in special])
  tok.add_tokens([tokenizers.AddedToken(names[i], normalized=False) for i, k in enumerate(types) if k == USER_DEFINED])
  add = dict(bos=meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
  add["eos"] = meta.get("tokenizer.ggml.add_eos_token", False)
  ends = {
      e: meta[f"tokenizer.ggml.{e}_token_id"]
      for e in ("bos", "eos")
      if add[e] and f"tokenizer.ggml.{e}_token_id" in meta
  }
  if ends:
    pieces = [names[ends["bos"]]] if "bos" in ends else []
    pieces += ["$A"] + ([names[ends["eos"]]] if "eos" in ends else [])
    specials = [(names[i], i) for i in ends.values()]
    tok.post_processor = processors.TemplateProcessing(single=" ".join(pieces), special_tokens=specials)
  return tok


def special_token(meta: dict, key: str) -> str | None:
  """The text of the special token whose id is at `key` (e.g. tokenizer.ggml.bos_token_id), None when absent."""
  tokens = meta.get("tokenizer.ggml.tokens") or []
  i = meta.get(key)
  return tokens[i] if i is not None and 0 <= i < len(tokens) else None
