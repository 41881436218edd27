"""The Hugging Face peer arm: transformers' offloaded KV cache on jaxkv's model geometry.

A LlamaForCausalLM with the jaxkv model's dimensions (random bf16 weights on the CUDA device, sdpa attention,
no rope scaling or qk-norm: only speed is compared) prefills the prompts in one call, then decodes greedily
with its KV cache offloaded to host memory: `DynamicCache(config=..., offloading=True)` (transformers 5.x),
else `OffloadedCache()` (4.x). The benchmark runs it on CUDA only; `device="cpu"` runs the same prefill and decode
on the CPU with a plain `DynamicCache` (tests: offloading needs CUDA streams).

It runs in a worker process (this file run as a script) that imports torch and transformers and never JAX,
so the two frameworks' CUDA libraries never load into one process. The worker starts after JAX has taken
its memory pool (by default 75% of the GPU), so the peer has the rest. Protocol: one JSON object per line on
the worker's stdin and stdout; every reply has "ok" and, when false, "reason".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

_OP_INIT, _OP_GENERATE, _OP_EXIT = "init", "generate", "exit"


class PeerError(Exception):
  """The peer cannot run: a package or the CUDA device is missing, it ran out of memory, or the worker died."""


def geometry(model) -> dict:
  """transformers.LlamaConfig keyword arguments for a jaxkv ModelConfig's dimensions."""
  return dict(
      vocab_size=model.vocab_size,
      hidden_size=model.d_model,
      intermediate_size=model.mlp_dim,
      num_hidden_layers=model.num_layers,
      num_attention_heads=model.num_heads,
      num_key_value_heads=model.num_kv_heads,
      head_dim=model.head_dim,
      rope_theta=model.rope_theta,
      rms_norm_eps=model.rms_eps,
      tie_word_embeddings=model.tie_embeddings,
  )


class HFPeer:
  """Client of one worker process; `start` returns it once the worker has built its model."""

  def __init__(self, proc: subprocess.Popen):
    self._proc = proc
    self.info: dict = {}

  @classmethod
  def start(cls, model, max_positions: int, device: str = "cuda") -> HFPeer:
    """Starts the worker and builds the model on torch's `device` (raises PeerError with the reason when it
    cannot)."""
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    peer = cls(proc)
    try:
      peer.info = peer._call(dict(op=_OP_INIT, geometry=geometry(model), max_positions=max_positions, device=device))
    except PeerError:
      peer.close()
      raise
    return peer

  def generate(self, prompts: list[list[int]], new_tokens: int) -> dict:
    """Prefills prompts (B equal-length lists of token ids), decodes new_tokens - 1 greedy steps.

    Returns prefill_s, decode_s (the device synchronized before and after the decode loop), decode_steps, tokens
    (the new_tokens greedy ids of each prompt) and cache (the cache class used).
    """
    return self._call(dict(op=_OP_GENERATE, prompts=prompts, new_tokens=new_tokens))

  def close(self) -> None:
    if self._proc.poll() is None:
      try:
        self._send(dict(op=_OP_EXIT))
        self._proc.wait(timeout=60)
      except (OSError, subprocess.TimeoutExpired):
        self._proc.kill()
        self._proc.wait()

  def _send(self, msg: dict) -> None:
    self._proc.stdin.write(json.dumps(msg) + "\n")
    self._proc.stdin.flush()

  def _call(self, msg: dict) -> dict:
    try:
      self._send(msg)
      line = self._proc.stdout.readline()
    except OSError:  # A broken pipe: the worker is gone.
      line = ""
    if not line:
      raise PeerError(f"the peer worker exited with code {self._proc.wait()}")
    reply = json.loads(line)
    if not reply.pop("ok"):
      raise PeerError(reply["reason"])
    return reply


# ---- The worker: torch and transformers only. ----


def _offloaded_cache(transformers, cfg, device: str):
  """The offloaded cache; on the CPU, whose memory is the host's, the plain DynamicCache (offloading needs CUDA)."""
  if device != "cuda":
    return transformers.DynamicCache()
  try:
    return transformers.DynamicCache(config=cfg, offloading=True)  # transformers 5.x
  except TypeError:
    return transformers.OffloadedCache()  # transformers 4.x


def _sync(state: dict) -> None:
  if state["device"] == "cuda":
    state["torch"].cuda.synchronize()


def _init(state: dict, msg: dict) -> dict:
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top

  device = msg["device"]
  if device == "cuda" and not torch.cuda.is_available():
    raise RuntimeError(f"torch {torch.__version__} sees no CUDA device")
  cfg = transformers.LlamaConfig(**msg["geometry"], max_position_embeddings=msg["max_positions"])
  cfg._attn_implementation = "sdpa"  # pylint: disable=protected-access
  torch.set_default_dtype(torch.bfloat16)
  with torch.device(device):
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
  torch.set_default_dtype(torch.float32)
  with torch.no_grad():
    for p in model.parameters():
      if p.dim() > 1:
        p.normal_(0.0, 0.02)
  state.update(torch=torch, transformers=transformers, cfg=cfg, model=model, device=device)
  return dict(
      torch=torch.__version__,
      transformers=transformers.__version__,
      device=torch.cuda.get_device_name() if device == "cuda" else device,
      weights_gib=sum(p.nbytes for p in model.parameters()) / 2**30,
  )


def _generate(state: dict, msg: dict) -> dict:
  torch, model, device = state["torch"], state["model"], state["device"]
  _sync(state)
  if device == "cuda":
    torch.cuda.empty_cache()
  ids = torch.tensor(msg["prompts"], dtype=torch.long, device=device)  # [B, context]
  context, new = ids.shape[1], msg["new_tokens"]
  positions = torch.arange(context, context + new - 1, device=device)
  cache = _offloaded_cache(state["transformers"], state["cfg"], device)
  with torch.no_grad():
    t0 = time.perf_counter()
    tok = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)
    _sync(state)
    t1 = time.perf_counter()
    tokens = [tok]
    for i in range(new - 1):
      out = model(tok, past_key_values=cache, use_cache=True, cache_position=positions[i : i + 1])
      tok = out.logits[:, -1:].argmax(-1)  # [B, 1]
      tokens.append(tok)
    _sync(state)
    t2 = time.perf_counter()
  return dict(
      prefill_s=t1 - t0,
      decode_s=t2 - t1,
      decode_steps=new - 1,
      tokens=torch.cat(tokens, dim=1).tolist(),
      cache=type(cache).__name__,
  )


def _worker() -> None:
  """Serves requests until "exit" or end of input. Stray prints go to stderr; replies to the real stdout."""
  replies = os.fdopen(os.dup(1), "w")
  os.dup2(2, 1)
  handlers = {_OP_INIT: _init, _OP_GENERATE: _generate}
  state: dict = {}
  for line in sys.stdin:
    msg = json.loads(line)
    if msg["op"] == _OP_EXIT:
      break
    try:
      reply = dict(ok=True, **handlers[msg["op"]](state, msg))
    except Exception as e:  # pylint: disable=broad-except  (the parent reports the arm skipped, with the reason)
      reply = dict(ok=False, reason=f"{type(e).__name__}: {str(e)[:800]}")
    replies.write(json.dumps(reply) + "\n")
    replies.flush()


if __name__ == "__main__":
  _worker()
