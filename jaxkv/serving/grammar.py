"""Structured output: a request's grammar (a JSON object, a JSON schema, a regular expression, or a grammar in Lark
or GBNF, which llguidance tells apart) through llguidance, the grammar engine of llama.cpp and vLLM (the `serve` extra).

`Grammars` holds the checkpoint's tokenizer as llguidance reads it; `compile` gives a request its `Grammar`, a matcher
over the vocabulary: `allowed()` is the tokens it may sample next, bool[V] (the head's per-row mask,
jaxkv.meta.DecodeState.allowed), `consume(token)` advances it on each token read back. Once the grammar is complete
it allows only the end of sequence ids, which end the request.
"""

from __future__ import annotations

import json

import llguidance
import numpy as np
from llguidance import numpy as llguidance_numpy

KINDS = ("json_object", "json_schema", "regex", "grammar")


class Grammar:
  """One request's matcher over a vocabulary of `vocab` tokens (ids past the tokenizer's are never allowed)."""

  def __init__(self, matcher: llguidance.LLMatcher, vocab: int):
    self._matcher, self.vocab = matcher, vocab

  def allowed(self) -> np.ndarray:
    """bool[V]: the tokens it accepts next."""
    bits = llguidance_numpy.allocate_token_bitmask(1, self.vocab)
    llguidance_numpy.fill_next_token_bitmask(self._matcher, bits)
    return np.unpackbits(bits.view(np.uint8), bitorder="little")[: self.vocab].astype(bool)

  def consume(self, token: int) -> None:
    self._matcher.consume_token(token)


class Grammars:
  """Compiles grammars for a tokenizer (jaxkv.tokenizer.Tokenizer) of a model of `vocab` tokens whose end of
  sequence ids are `eos` (what a complete grammar allows)."""

  def __init__(self, tokenizer, vocab: int, eos: list[int]):
    self._tokenizer = llguidance.LLTokenizer(tokenizer.spec(), n_vocab=vocab, eos_token=eos)
    self.vocab = vocab

  def compile(self, kind: str, source: str | dict | None) -> Grammar:
    """A grammar of `kind` (KINDS; json_object takes no source, json_schema a dict or its JSON text); ValueError
    saying why for one that does not compile."""
    if kind not in KINDS:
      raise ValueError(f"unknown grammar kind {kind!r}; one of {KINDS}")
    if kind == "json_object":
      kind, source = "json_schema", {"type": "object"}
    if isinstance(source, dict):
      source = json.dumps(source)
    try:
      text = llguidance.grammar_from(kind, source)
    except Exception as e:  # pylint: disable=broad-except  (its converters raise what their parsers raise)
      raise ValueError(str(e).strip()) from e
    matcher = llguidance.LLMatcher(self._tokenizer, text)
    if matcher.is_error():
      raise ValueError(matcher.get_error().strip())
    return Grammar(matcher, self.vocab)
