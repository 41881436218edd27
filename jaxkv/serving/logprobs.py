"""Log-probabilities in the OpenAI shapes: /v1/completions' `logprobs` object and /v1/chat/completions'
`logprobs.content` list, from jaxkv.sampling.logprobs's (logprob, [(id, logprob), ...]) per token.

A token's text is its id decoded alone (special tokens kept; a piece of a multi-byte character decodes to U+FFFD, as
in vLLM), `bytes` its UTF-8; without a tokenizer it is "token_id:<id>" (vLLM's return_tokens_as_token_ids).
"""

from __future__ import annotations

from collections.abc import Sequence

Entry = tuple[float, list[tuple[int, float]]]  # A token's log-probability and its most likely (id, logprob).


def token_text(tokenizer, token: int) -> str:
  if tokenizer is None:
    return f"token_id:{token}"
  return tokenizer.decode([token], skip_special_tokens=False)


def text_length(tokenizer, token: int) -> int:
  """The length of a token's text in a choice's text (0 without a tokenizer: the text is empty)."""
  return 0 if tokenizer is None else len(token_text(tokenizer, token))


def completion(tokenizer, ids: Sequence[int], entries: Sequence[Entry | None], offset: int) -> dict:
  """The `logprobs` object of a completion choice (or chunk) for `ids`: tokens, token_logprobs, top_logprobs (one
  {text: logprob} per token; None for a token without) and text_offset (each token's start in the text, from
  `offset`: the sum of the texts' lengths before it, as vLLM)."""
  texts = [token_text(tokenizer, t) for t in ids]
  offsets = []
  for t in ids:
    offsets.append(offset)
    offset += text_length(tokenizer, t)
  return {
      "tokens": texts,
      "token_logprobs": [None if e is None else e[0] for e in entries],
      "top_logprobs": [None if e is None else {token_text(tokenizer, i): lp for i, lp in e[1]} for e in entries],
      "text_offset": offsets,
  }


def chat(tokenizer, ids: Sequence[int], entries: Sequence[Entry]) -> dict:
  """The `logprobs` object of a chat choice (or chunk) for `ids`: content, one {token, logprob, bytes,
  top_logprobs} per token."""

  def one(token: int, logprob: float) -> dict:
    text = token_text(tokenizer, token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

  content = [dict(one(t, e[0]), top_logprobs=[one(i, lp) for i, lp in e[1]]) for t, e in zip(ids, entries)]
  return {"content": content, "refusal": None}
