"""A Llama-3 / Qwen3 style decoder in plain JAX, written per layer.

The engine drives the layers from Python so that KV deliveries can be issued between layer calls. Every
function here is pure; jaxkv.engine jits them with explicit shardings.

Shapes (B = batch, T = tokens in a step, D = d_model, H = heads, K = kv heads, G = H // K, Dh = head_dim,
F = mlp_dim, V = vocab, R = cache rows in the attended window):
  layer params: attn_norm [D], wq [D, H, Dh], wk [D, K, Dh], wv [D, K, Dh], wo [H, Dh, D],
                q_norm [Dh], k_norm [Dh] (qk_norm only), mlp_norm [D], w_gate [D, F], w_up [D, F],
                w_down [F, D]
  kv arrays: stored [2, B, K, R, E] (index 0 = K, 1 = V), rows in cache order; see jaxkv.cache. E and the
    dtype come from the KV format (jaxkv.kv_quant): E = Dh for a float cache; quantized rows are packed with
    their scales. Rows are packed when written and unpacked to [2, B, K, R, Dh] inside the layer that attends, once
    per layer call (int8 rows under the decode kernel a tile at a time in it: jaxkv.decode_attention.attention_rows).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import decode_attention
from jaxkv import mesh as mesh_lib
from jaxkv.config import PREFILL_ATTENTIONS, ModelConfig
from jaxkv.kv_quant import KVFormat

LAYER_AXES = {
    "attn_norm": (mesh_lib.EMBED,),
    "wq": (mesh_lib.EMBED, mesh_lib.HEADS, mesh_lib.HEAD_DIM),
    "wk": (mesh_lib.EMBED, mesh_lib.KV_HEADS, mesh_lib.HEAD_DIM),
    "wv": (mesh_lib.EMBED, mesh_lib.KV_HEADS, mesh_lib.HEAD_DIM),
    "wo": (mesh_lib.HEADS, mesh_lib.HEAD_DIM, mesh_lib.EMBED),
    "q_norm": (mesh_lib.HEAD_DIM,),
    "k_norm": (mesh_lib.HEAD_DIM,),
    "mlp_norm": (mesh_lib.EMBED,),
    "w_gate": (mesh_lib.EMBED, mesh_lib.MLP),
    "w_up": (mesh_lib.EMBED, mesh_lib.MLP),
    "w_down": (mesh_lib.MLP, mesh_lib.EMBED),
}
SCORE_BUDGET_BYTES = 2**30  # Largest f32 score block of a prefill chunk (jaxkv.model.blocked_attention).
SPAN_HIDDEN_BYTES = 2**30  # The hidden states of the chunks a prefill computes layer by layer (prefill_span).
TOP_AXES = {
    "embed": (None, mesh_lib.EMBED),  # Replicated: a gather by token id.
    "final_norm": (mesh_lib.EMBED,),
    "lm_head": (mesh_lib.EMBED, mesh_lib.VOCAB),
}


def prefill_span(cfg: ModelConfig, batch: int, chunk: int) -> int:
  """The chunks of `chunk` rows that a prefill computes layer by layer (jaxkv.engine.Engine.prefill: each layer's
  chunks one after another, their hidden states [batch, chunk, d_model] held from one layer to the next): as many
  as SPAN_HIDDEN_BYTES holds, at least one."""
  return max(1, SPAN_HIDDEN_BYTES // (batch * chunk * cfg.d_model * jnp.dtype(cfg.dtype).itemsize))


def dtype_of(cfg: ModelConfig):
  return jnp.dtype(cfg.dtype)


def param_axes(cfg: ModelConfig) -> dict:
  """Logical axes of every parameter, in the structure of `init_params`."""
  layer = {k: v for k, v in LAYER_AXES.items() if cfg.qk_norm or k not in ("q_norm", "k_norm")}
  top = {k: v for k, v in TOP_AXES.items() if not (cfg.tie_embeddings and k == "lm_head")}
  return dict(top, layers=[dict(layer) for _ in range(cfg.num_layers)])


def init_params(cfg: ModelConfig, key: jax.Array, mesh: jax.sharding.Mesh, layout=None) -> dict:
  """Seeded random weights, created directly in their sharded layout: on `mesh`, or with a jaxkv.layout.Layout
  each layer on its stage's mesh and the top (embedding, final norm, head) on the first stage's. The values do
  not depend on the placement.

  Scales: embeddings N(0, 1); projections N(0, 1/fan_in), so activations keep unit scale; norms 1.
  """
  layer_mesh = (lambda l: mesh) if layout is None else layout.mesh
  top_mesh = mesh if layout is None else layout.first
  for m in {id(m): m for m in [mesh] + ([] if layout is None else list(layout.meshes))}.values():
    mesh_lib.check_divisible(cfg, m)
  dt = dtype_of(cfg)
  axes = param_axes(cfg)
  d, h, k, dh, f = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
  shapes_layer = {
      "attn_norm": ((d,), None),
      "mlp_norm": ((d,), None),
      "q_norm": ((dh,), None),
      "k_norm": ((dh,), None),
      "wq": ((d, h, dh), d),
      "wk": ((d, k, dh), d),
      "wv": ((d, k, dh), d),
      "wo": ((h, dh, d), h * dh),
      "w_gate": ((d, f), d),
      "w_up": ((d, f), d),
      "w_down": ((f, d), f),
  }
  shapes_top = {"embed": ((cfg.vocab_size, d), 1), "final_norm": ((d,), None), "lm_head": ((d, cfg.vocab_size), d)}

  def make(shape_fan, name_key, logical, on):
    shape, fan_in = shape_fan
    out = mesh_lib.sharding(on, logical)
    return _init_fn(shape, dt.name, None if fan_in is None else 1.0 / math.sqrt(fan_in), out)(name_key)

  names = sorted(shapes_layer)
  params = {}
  for i, name in enumerate(sorted(axes.keys() - {"layers"})):
    params[name] = make(shapes_top[name], jax.random.fold_in(key, 1_000_000 + i), axes[name], top_mesh)
  params["layers"] = [
      {
          name: make(shapes_layer[name], jax.random.fold_in(key, l * len(names) + names.index(name)), ax, layer_mesh(l))
          for name, ax in layer_axes.items()
      }
      for l, layer_axes in enumerate(axes["layers"])
  ]
  return params


@functools.lru_cache(maxsize=None)
def _init_fn(shape, dtype, scale, out_sharding):
  """Jitted initialiser of one parameter shape: ones (scale None) or N(0, scale^2)."""
  if scale is None:
    return jax.jit(lambda key: jnp.ones(shape, dtype), out_shardings=out_sharding)
  return jax.jit(
      lambda key: (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype), out_shardings=out_sharding
  )


def rms_norm(x, w, eps):
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * w.astype(jnp.float32)).astype(x.dtype)


def rope_frequencies(cfg: ModelConfig) -> np.ndarray:
  """f32[Dh // 2] inverse frequencies, with the configured scaling (llama3 or yarn, as transformers computes them).

  Computed in float64 and rounded once (transformers computes them in float32).
  """
  inv = 1.0 / (cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim))
  s = cfg.rope_scaling
  if s is not None and s.rope_type == "llama3":
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * np.pi / inv
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    inv = np.where(mid, (1 - smooth) * inv / s.factor + smooth * inv, scaled)
  elif s is not None and s.rope_type == "yarn":
    dim = cfg.head_dim

    def correction_dim(rotations):  # The dimension whose frequency turns `rotations` times over the original context.
      return dim * math.log(s.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
      high += 0.001  # As transformers: no division by zero.
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)  # 0: kept, 1: scaled.
    inv = inv / s.factor * ramp + inv * (1 - ramp)
  return inv.astype(np.float32)


def rope_attention_scale(cfg: ModelConfig) -> float:
  """The factor on RoPE's cos and sin (YaRN's attention factor; 1 otherwise)."""
  return 1.0 if cfg.rope_scaling is None else cfg.rope_scaling.attention_scale


def apply_rope(x, pos, inv_freq, scale: float = 1.0):
  """x [B, T, N, Dh]; pos i32[B, T]; scale multiplies cos and sin (YaRN). Rotate-half convention (as the HF
  Llama/Qwen3 checkpoints)."""
  ang = pos.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
  cos = jnp.cos(ang)[:, :, None, :]
  sin = jnp.sin(ang)[:, :, None, :]
  if scale != 1.0:
    cos, sin = cos * scale, sin * scale
  x32 = x.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


# A decode's rows (B * T: projections, norms, MLP, head) are computed as at least this many (zeros below them): XLA's
# GPU kernels for 8 rows read the weights faster than those for 1 (docs/design.md, "Decode groups"). A speculative
# verify pass of B sequences runs its B * T rows as blocks of a one-token step's rows, max(B, MIN_ROWS), so that each
# row runs the step's kernels on the step's shapes and rounds alike in both (docs/design.md, "What is bitwise").
MIN_ROWS = 16


def on_min_rows(fn, *xs, batch: int | None = None):
  """fn(*xs) for xs [N, T, ...] (the same N, T), every output sliced back to [N, T, ...].

  Fewer than MIN_ROWS rows run as [MIN_ROWS, 1, ...] (zero rows below the N * T). batch: the sequences of a decode
  pass whose N * T rows are batch x tokens (a verify pass); its rows then run as blocks of a one-token step's
  [R, 1, ...], R = max(batch, MIN_ROWS), one block after another (no fusion or dot merger joins two blocks into a
  larger shape). Without batch (a prefill chunk, or a step, whose rows are its batch), N * T >= MIN_ROWS rows run as
  one call. Every call of fn is fenced, its inputs and outputs behind optimization barriers: fn compiles to the same
  fusions whatever pads, slices or joins its rows around it (a step's, a verify block's), so the GPU autotuner, whose
  picks are per fusion, gives both the same kernels.
  """
  n, t = xs[0].shape[:2]
  rows = n * t
  r = MIN_ROWS if batch is None else max(batch, MIN_ROWS)
  fenced = lambda *ys: jax.lax.optimization_barrier(fn(*jax.lax.optimization_barrier(ys)))
  if rows >= MIN_ROWS and (batch is None or rows == r):
    return fenced(*xs)
  blocks = -(-rows // r)
  pad = lambda x: jnp.pad(x.reshape((rows, 1) + x.shape[2:]), [(0, blocks * r - rows)] + [(0, 0)] * (x.ndim - 1))
  padded = [pad(x) for x in xs]
  outs = []
  for i in range(blocks):
    block = [x[i * r : (i + 1) * r] for x in padded]
    if outs:  # Block i waits for block i - 1: two blocks cannot become one larger matmul.
      block, _ = jax.lax.optimization_barrier((block, outs[-1]))
    outs.append(fenced(*block))
  out = outs[0] if blocks == 1 else jax.tree.map(lambda *ys: jnp.concatenate(ys), *outs)
  return jax.tree.map(lambda y: y[:rows].reshape((n, t) + y.shape[2:]), out)


def qkv(p, x, pos, cfg: ModelConfig, batch: int | None = None):
  """x [B, T, D], pos i32[B, T] -> q [B, T, H, Dh], k, v [B, T, K, Dh] (RoPE applied), on at least MIN_ROWS rows
  (batch: on_min_rows's)."""

  def rows(x, pos):
    h = rms_norm(x, p["attn_norm"], cfg.rms_eps)
    q = jnp.einsum("btd,dhk->bthk", h, p["wq"])
    k = jnp.einsum("btd,dhk->bthk", h, p["wk"])
    v = jnp.einsum("btd,dhk->bthk", h, p["wv"])
    if cfg.qk_norm:
      q = rms_norm(q, p["q_norm"], cfg.rms_eps)
      k = rms_norm(k, p["k_norm"], cfg.rms_eps)
    inv, scale = rope_frequencies(cfg), rope_attention_scale(cfg)
    return apply_rope(q, pos, inv, scale), apply_rope(k, pos, inv, scale), v

  return on_min_rows(rows, x, pos, batch=batch)


def attention(q, kv, mask):
  """q [B, T, H, Dh]; kv [2, B, K, R, Dh] values (unpacked); mask bool[B, T, R] (True = attend) -> [B, T, H, Dh]
  of q's dtype.

  Softmax in f32; the weights and V products in kv's dtype. Every query row must have at least one True in its mask.
  """
  b, t, h, dh = q.shape
  k_heads = kv.shape[2]
  qg = q.reshape(b, t, k_heads, h // k_heads, dh)
  s = jnp.einsum("btkgd,bkrd->bkgtr", qg, kv[0], preferred_element_type=jnp.float32)
  s = s * (1.0 / math.sqrt(dh))
  s = jnp.where(mask[:, None, None, :, :], s, -jnp.inf)
  w = jax.nn.softmax(s, axis=-1).astype(kv.dtype)
  o = jnp.einsum("bkgtr,bkrd->btkgd", w, kv[1])
  return o.reshape(b, t, h, dh).astype(q.dtype)


def attn_out_and_mlp(p, x, o, cfg: ModelConfig, batch: int | None = None):
  """Residual adds: x [B, T, D], o [B, T, H, Dh] -> x [B, T, D], on at least MIN_ROWS rows (batch: on_min_rows's)."""

  def rows(x, o):
    x = x + jnp.einsum("bthk,hkd->btd", o, p["wo"])
    h = rms_norm(x, p["mlp_norm"], cfg.rms_eps)
    g = jnp.einsum("btd,df->btf", h, p["w_gate"])
    u = jnp.einsum("btd,df->btf", h, p["w_up"])
    return x + jnp.einsum("btf,fd->btd", jax.nn.silu(g) * u, p["w_down"])

  return on_min_rows(rows, x, o, batch=batch)


def prefill_layer(
    p, x, window, start, *, cfg: ModelConfig, kv_format: KVFormat | None = None, attention_impl: str = "xla"
):
  """One layer over a chunk of C prompt rows that starts at row W = window.shape[3].

  x [B, C, D]; window stored [2, B, K, W, E] rows [0, W) or None (first chunk); start i32[B] first valid row;
  kv_format: how rows are stored (default: the model dtype); attention_impl: "xla" (`blocked_attention`, the
  reference) or "cudnn" (`fused_prefill_attention`; see `prefill_attention_impl`).
  Returns x [B, C, D] and the chunk's stored kv [2, B, K, C, E]. The chunk attends to its rows as stored
  (packed, then unpacked): the values decode will see.
  Rows before `start` are left padding: their keys are masked for everyone, and a padding query attends to
  itself only (so it stays finite).
  """
  fmt = kv_format or KVFormat.of(cfg)
  c = x.shape[1]
  w_rows = 0 if window is None else window.shape[3]
  rows = w_rows + jnp.arange(c, dtype=jnp.int32)  # [C]
  pos = jnp.maximum(rows[None, :] - start[:, None], 0)  # [B, C]
  q, k, v = qkv(p, x, pos, cfg)
  chunk = fmt.pack(jnp.stack([k, v]).transpose(0, 1, 3, 2, 4))  # [2, B, K, C, E]
  if attention_impl == "cudnn":
    prefix = None if window is None else fmt.unpack(window)
    o = fused_prefill_attention(q, fmt.unpack(chunk), prefix, start, cudnn_attention)
    return attn_out_and_mlp(p, x, o, cfg), chunk
  kv = fmt.unpack(chunk if window is None else jnp.concatenate([window, chunk], axis=3))
  key_rows = jnp.arange(w_rows + c, dtype=jnp.int32)
  causal = (key_rows[None, None, :] <= rows[None, :, None]) & (key_rows[None, None, :] >= start[:, None, None])
  mask = causal | (key_rows[None, None, :] == rows[None, :, None])
  return attn_out_and_mlp(p, x, blocked_attention(q, kv, mask), cfg), chunk


def query_block(b: int, h: int, t: int, r: int, budget_bytes: int) -> int:
  """Queries per attention block: t halved while the f32 scores [B, H, block, R] exceed the budget."""
  qb = t
  while qb % 2 == 0 and b * h * qb * r * 4 > budget_bytes:
    qb //= 2
  return qb


def blocked_attention(q, kv, mask):
  """`attention` over blocks of queries in sequence (lax.map), so that a long prefill chunk against a long window
  never materialises all of its scores. Query rows are independent: only the peak memory changes.

  q [B, T, H, Dh]; kv [2, B, K, R, Dh]; mask bool[B, T, R] -> [B, T, H, Dh].
  """
  b, t, h, dh = q.shape
  qb = query_block(b, h, t, kv.shape[3], SCORE_BUDGET_BYTES)
  if qb == t:
    return attention(q, kv, mask)
  n = t // qb
  qs = q.reshape(b, n, qb, h, dh).swapaxes(0, 1)
  ms = mask.reshape(b, n, qb, -1).swapaxes(0, 1)
  o = jax.lax.map(lambda a: attention(a[0], kv, a[1]), (qs, ms))  # [n, B, qb, H, Dh]
  return o.swapaxes(0, 1).reshape(b, t, h, dh)


FUSED_DTYPES = ("bfloat16", "float16")  # What cuDNN's flash attention takes.


def prefill_attention_impl(choice: str, cfg: ModelConfig, fmt: KVFormat, device) -> str:
  """The prefill attention that runs on `device` (a jax Device): "xla" or "cudnn".

  choice (engine.prefill_attention): "xla"; "cudnn", ValueError when it cannot run; "auto", "cudnn" where it can
  run, else "xla". cuDNN's flash attention needs a CUDA GPU, q and the KV values (unpacked) both in bfloat16 or
  float16, and head_dim a multiple of 8 up to 128 (256 from compute capability 9.0, Hopper)."""
  if choice not in PREFILL_ATTENTIONS:
    raise ValueError(f"engine.prefill_attention must be one of {', '.join(PREFILL_ATTENTIONS)}, got {choice!r}")
  if choice == "xla":
    return "xla"
  capability = getattr(device, "compute_capability", None)
  max_head_dim = 256 if capability and tuple(int(v) for v in str(capability).split(".")) >= (9, 0) else 128
  missing = []
  if device.platform != "gpu" or capability is None:
    missing.append(f"a CUDA GPU (the devices are {device.platform})")
  if cfg.dtype not in FUSED_DTYPES:
    missing.append(f"model.dtype bfloat16 or float16 (it is {cfg.dtype})")
  elif fmt.values_dtype != jnp.dtype(cfg.dtype):
    missing.append(f"KV values in the model dtype (kv.dtype {fmt.name} holds {fmt.values_dtype})")
  if cfg.head_dim % 8 or cfg.head_dim > max_head_dim:
    missing.append(f"head_dim a multiple of 8 up to {max_head_dim} (it is {cfg.head_dim})")
  return decode_attention.choose_kernel(
      "engine.prefill_attention",
      choice,
      "cudnn",
      missing,
      lambda: cudnn_check(device, cfg.dtype, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim),
      f"cuDNN's flash attention to run and match the XLA attention on {device}",
      "prefill attention: plain XLA, not cuDNN",
  )


CUDNN_CHECK_TOLERANCE = 2e-2  # Relative error (Frobenius) of the fused prefill attention vs `attention`, bf16/f16.


@functools.lru_cache(maxsize=None)
def cudnn_check(device, dtype: str, heads: int, kv_heads: int, head_dim: int) -> str | None:
  """Runs `fused_prefill_attention` with `cudnn_attention` once on `device` in a small case of the model's heads (two
  sequences, one left-padded into the chunk, a chunk of 64 rows after 128): None when it runs and its relative error
  against `attention` is within CUDNN_CHECK_TOLERANCE, else what went wrong (cuDNN missing or too old, another
  kernel contract)."""
  rng = np.random.default_rng(0)
  c, w = 64, 128
  put = lambda a: jax.device_put(jnp.asarray(a, dtype), device)
  q = put(rng.standard_normal((2, c, heads, head_dim)))
  chunk_kv = put(rng.standard_normal((2, 2, kv_heads, c, head_dim)))
  prefix_kv = put(rng.standard_normal((2, 2, kv_heads, w, head_dim)))
  start = jax.device_put(jnp.array([0, w + 9], jnp.int32), device)
  rows, keys = w + jnp.arange(c), jnp.arange(w + c)
  mask = (keys[None, None, :] <= rows[None, :, None]) & (keys[None, None, :] >= start[:, None, None])
  mask = mask | (keys[None, None, :] == rows[None, :, None])
  try:
    fused = jax.jit(fused_prefill_attention, static_argnums=4)(q, chunk_kv, prefix_kv, start, cudnn_attention)
    fused = np.asarray(fused, np.float32)
  except Exception as e:  # pylint: disable=broad-exception-caught  (any failure means: not here)
    return f"{type(e).__name__}: {str(e)[:300]}"
  ref = np.asarray(jax.jit(attention)(q, jnp.concatenate([prefix_kv, chunk_kv], axis=3), mask), np.float32)
  err = float(np.linalg.norm(fused - ref) / np.linalg.norm(ref))
  if not err <= CUDNN_CHECK_TOLERANCE:
    return f"relative error {err:.3g} > {CUDNN_CHECK_TOLERANCE}"
  return None


def cudnn_attention(q, k, v, q_len, kv_len, causal: bool):
  """cuDNN's flash attention (GPU only), as `fused_prefill_attention` calls its kernel.

  q [B, T, H, Dh]; k, v [B, S, K, Dh] (K divides H: query head h reads KV head h // (H / K)), all bfloat16 or all
  float16; q_len, kv_len i32[B] >= 1: queries [0, q_len) and keys [0, kv_len) are valid (right padding); causal:
  key j only for queries i >= j (top-left). Returns o [B, T, H, Dh] of q's dtype (rows past q_len undefined) and
  lse f32[B, H, T], the log-sum-exp of each query's scaled scores.

  This is the function behind jax.nn.dot_product_attention(implementation="cudnn"), called directly because that
  one rounds the log-sum-exp to q's dtype (bfloat16 steps by 1/8 between 16 and 32: too coarse to merge two
  partials)."""
  from jax._src.cudnn import fused_attention_stablehlo as fa  # pylint: disable=g-import-not-at-top

  mask = fa.MaskType.PADDING_CAUSAL if causal else fa.MaskType.PADDING
  o, lse = fa.dot_product_attention(
      q,
      k,
      v,
      q_seqlen=q_len,
      kv_seqlen=kv_len,
      scale=1.0 / math.sqrt(q.shape[-1]),
      mask_type=mask,
      qkv_layout="BTNH",
      return_residual=True,
  )
  return o, lse.astype(jnp.float32)


def fused_prefill_attention(q, chunk_kv, prefix_kv, start, kernel):
  """The attention of `prefill_layer` with a fused (flash) kernel: row r of sequence b attends rows [start[b], r];
  a left-padding query (r < start[b]) gets its own value row, as `attention` gives it.

  q [B, C, H, Dh] rows [W, W + C); chunk_kv [2, B, K, C, Dh] the values of those rows (unpacked); prefix_kv
  [2, B, K, W, Dh] rows [0, W) or None (W = 0); start i32[B]; kernel: `cudnn_attention` or a function of its
  contract. Returns [B, C, H, Dh] of q's dtype.

  The kernel masks only right padding and a top-left causal diagonal, so the chunk's offset from its keys is split
  into two calls whose partials are merged by their log-sum-exps (`merge_partials`, in f32):
    the chunk over itself, causal: each sequence's rows are rolled up by its padding in the chunk,
      p = clip(start - W, 0, C), so its valid rows come first (q and kv lengths C - p);
    the chunk over the prefix, no causal mask: the prefix rows reversed, so its valid rows [start, W) come first
      (kv length W - start); a sequence with none takes the first call alone.
  """
  b, c, h, dh = q.shape
  w_rows = 0 if prefix_kv is None else prefix_kv.shape[3]
  pad = jnp.clip(start - w_rows, 0, c)  # [B]
  lanes = jnp.arange(c, dtype=jnp.int32)[None, :]
  roll = lambda a, i: jnp.take_along_axis(a, i.reshape(i.shape + (1,) * (a.ndim - 2)), axis=1)
  up, down = (lanes + pad[:, None]) % c, (lanes - pad[:, None]) % c  # [B, C]
  kv = chunk_kv.transpose(0, 1, 3, 2, 4)  # [2, B, C, K, Dh]
  n = jnp.maximum(c - pad, 1).astype(jnp.int32)
  o, lse = kernel(roll(q, up), roll(kv[0], up), roll(kv[1], up), n, n, True)
  o = roll(o, down)
  lse = jnp.take_along_axis(lse, down[:, None, :], axis=2)  # [B, H, C]
  if prefix_kv is not None:
    prefix = prefix_kv[:, :, :, ::-1].transpose(0, 1, 3, 2, 4)  # [2, B, W, K, Dh], row W - 1 first.
    m = jnp.clip(w_rows - start, 0, w_rows).astype(jnp.int32)
    o1, lse1 = kernel(q, prefix[0], prefix[1], jnp.full((b,), c, jnp.int32), jnp.maximum(m, 1), False)
    has = m[:, None, None] > 0  # [B, 1, 1]
    lse1 = jnp.where(has, lse1, -jnp.inf)
    o1 = jnp.where(has[..., None], o1.astype(jnp.float32), 0.0)
    t = lambda a: a.transpose(0, 2, 1)  # [B, H, C] -> [B, C, H]
    o = merge_partials(o1, t(lse1), o.astype(jnp.float32), t(lse))[0]
  own = jnp.repeat(kv[1], h // kv.shape[3], axis=2)  # [B, C, H, Dh]: each query head's own value row.
  valid = w_rows + lanes >= start[:, None]  # [B, C]
  return jnp.where(valid[:, :, None, None], o.astype(q.dtype), own.astype(q.dtype))


def decode_layer(
    p,
    x,
    window,
    open_page,
    start,
    end,
    *,
    cfg: ModelConfig,
    kv_format: KVFormat | None = None,
    attention_impl: str = "xla",
    mesh: jax.sharding.Mesh | None = None,
):
  """One layer for one new token per sequence, written at row `end` of every sequence; or for T tokens per sequence
  (a speculative verify pass, jaxkv.spec_decode), written at rows end .. end + T - 1.

  x [B, D] (one token) or [B, T, D]; window stored [2, B, K, A, E] rows [W - A, W) (A >= W: rows below 0 are a start
  padding, jaxkv.cache), or None while W = 0; open_page stored [2, B, K, P, E] rows [W, W + P), on device; start
  i32[B]; end i32[] with W <= end < W + P and W a multiple of P (so W = end - end % P: a traced value, the program
  depends on A only); kv_format: how rows are stored (default: the model dtype); attention_impl: "xla" or "pallas"
  (jaxkv.decode_attention: end-anchored leaves over the window and the open page, read where they are, folded in a
  fixed tree; a sequence's bits do not depend on A, W or the batch around it) or "legacy"
  (`legacy_decode_attention`, one token only); mesh: the devices the kv heads are sharded over (the Pallas kernel
  runs per shard).

  With T tokens, token i attends rows [start_b, end + i] with its leaves anchored at end + i: the computation of a
  one-token step at row end + i, so causal within the T rows. Rows past the open page are not written, and a token
  there attends as the page's last row (its output is meaningless: the caller discards it).
  Returns x of x's shape and the open page with the new rows written (packed).
  """
  fmt = kv_format or KVFormat.of(cfg)
  a_rows, page = (0 if window is None else window.shape[3]), open_page.shape[3]
  t = 1 if x.ndim == 2 else x.shape[1]
  q, open_page = query_and_write(p, x, open_page, start, end, end % page, cfg, fmt)
  first_row = end - end % page - a_rows  # The window's first row: W - A.
  b, _, h, dh = q.shape
  k = open_page.shape[2]
  stored = (open_page,) if window is None else (window, open_page)
  parts = decode_attention.attention_rows(attention_impl, fmt, stored)  # Once for every token.
  if attention_impl == "legacy":
    if t != 1:
      raise ValueError("engine.decode_attention legacy decodes one token per pass (no speculative verify pass)")
    qg = q[:, 0].reshape(b, k, h // k, dh).astype(fmt.values_dtype)
    o = legacy_decode_attention(qg, parts, start, end, first_row)
  else:
    outs = []
    kw = dict(impl=attention_impl, mesh=mesh, kv_format=fmt)
    for i in range(t):
      # Fenced: no fusion joins the attention (whose fold has more levels at a longer W) to the projections around
      # it, so that they compile to the same fusions, and the GPU autotuner's picks, at every W.
      qg = jax.lax.optimization_barrier(q[:, i].reshape(b, k, h // k, dh).astype(fmt.values_dtype))
      row = end if t == 1 else token_row(end, i, page)
      o, _ = decode_attention.attend(qg, parts, first_row, start, row, **kw)
      outs.append(jax.lax.optimization_barrier(o))
    o = outs[0] if t == 1 else jnp.stack(outs, axis=1)  # [B, K, G, Dh] or [B, T, K, G, Dh]
  out = attn_out_and_mlp(p, x.reshape(b * t, 1, -1), o.reshape(b * t, 1, h, dh).astype(x.dtype), cfg, batch=b)
  return out.reshape(x.shape), open_page


def token_row(end, i: int, page: int):
  """Token i's row in a verify pass of tokens at rows end .. end + T - 1 (end i32[], page: the open page's rows P):
  end + i, or the page's last row for a token past the page (decode_layer)."""
  return jnp.minimum(end + i, end - end % page + page - 1)


def legacy_decode_attention(q, parts, start, end, first_row=0):
  """The decode attention before jaxkv.decode_attention (engine.decode_attention "legacy", kept for A/B): the
  window and the open page each reduced whole (partial_attention) and their partials merged, so that a row's bits
  depend on the window's length A (so it runs without window buckets). q [B, K, G, Dh]; parts: ([window values
  [2, B, K, A, Dh] rows [first_row, first_row + A),] open page values [2, B, K, P, Dh]) -> o f32[B, K, G, Dh]."""
  *window, page_kv = parts
  a_rows = 0 if not window else window[0].shape[3]
  valid = lambda rows: (rows[None, :] >= start[:, None]) & (rows[None, :] <= end)  # [B, R]
  page_rows = first_row + a_rows + jnp.arange(page_kv.shape[3], dtype=jnp.int32)
  o, lse = partial_attention(q, page_kv, valid(page_rows))
  if window:
    o_w, lse_w = partial_attention(q, window[0], valid(first_row + jnp.arange(a_rows, dtype=jnp.int32)))
    o, _ = merge_partials(o_w, lse_w, o, lse)
  return o


def query_and_write(p, x, open_page, start, end, page_row, cfg: ModelConfig, fmt: KVFormat):
  """x [B, D] -> q [B, 1, H, Dh] and the open page with the new row (packed) written at page_row; or x [B, T, D] ->
  q [B, T, H, Dh], the rows written at page_row .. page_row + T - 1 (those past the page dropped). The projections
  run over the B * T rows in blocks of a one-token step's rows (`on_min_rows` with batch B)."""
  b, t = x.shape[0], 1 if x.ndim == 2 else x.shape[1]
  pos = (end - start)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]
  q, k, v = qkv(p, x.reshape(b * t, 1, -1), pos.reshape(b * t, 1), cfg, batch=b)
  new = fmt.pack(jnp.stack([k, v]).reshape(2, b, t, *k.shape[2:]).transpose(0, 1, 3, 2, 4))  # [2, B, K, T, E]
  q = q.reshape(b, t, *q.shape[2:])
  if t == 1:
    return q, jax.lax.dynamic_update_slice(open_page, new, (0, 0, 0, page_row, 0))
  rows = page_row + jnp.arange(t, dtype=jnp.int32)
  return q, open_page.at[:, :, :, rows].set(new, mode="drop")


# Split attention: rows [0, r1) of a layer's window are attended on the host (jaxkv.host.attention), rows [r1, W)
# (the tail, delivered) and the open page on the device, and the two softmax partials are merged. A layer is then three
# functions: decode_query (the query, handed to the host, and the new row), decode_tail_partial (the device's partial
# over the delivered tail) and decode_merge (the merge and the rest of the layer). Not bit-identical to decode_layer:
# the rows are summed in another order.


def decode_query(p, x, open_page, start, end, *, cfg: ModelConfig, kv_format: KVFormat | None = None):
  """The first part of a split layer: its query and the new row.

  x [B, D]; open_page stored [2, B, K, P, E] rows [W, W + P); start i32[B]; end i32[] with W <= end < W + P and W a
  multiple of P, so the new row goes to page row end % P (no window argument: this function compiles once).
  Returns q f32[B, K, G, Dh] (query head k * G + g; the model dtype's values, widened) and the open page with the
  new row written (packed). x [B, T, D] (a verify pass): q f32[B, K, T * G, Dh], token t's query head k * G + g at
  [:, k, t * G + g] (token_queries), the rows end .. end + T - 1 written (query_and_write).
  """
  fmt = kv_format or KVFormat.of(cfg)
  q, open_page = query_and_write(p, x, open_page, start, end, end % open_page.shape[3], cfg, fmt)
  b, t, h, dh = q.shape
  k = open_page.shape[2]
  if x.ndim == 2:
    return q[:, 0].reshape(b, k, h // k, dh).astype(jnp.float32), open_page
  return (
      q.reshape(b, t, k, h // k, dh).transpose(0, 2, 1, 3, 4).reshape(b, k, t * h // k, dh).astype(jnp.float32),
      open_page,
  )


def token_queries(q, g: int) -> list:
  """A verify pass's queries q [B, K, T * G, Dh] (decode_query) -> each token's [B, K, G, Dh], g = G."""
  return [q[:, :, i * g : (i + 1) * g] for i in range(q.shape[2] // g)]


def partial_attention(q, kv, mask):
  """q [B, K, G, Dh]; kv [2, B, K, R, Dh] values (unpacked); mask bool[B, R] (True = attend) -> o f32[B, K, G, Dh],
  the attention output normalized over these rows, and lse f32[B, K, G], the log-sum-exp of their scaled scores
  (o = 0 and lse = -inf for a sequence with no True). Scores and softmax in f32, the weights and V products in kv's
  dtype with f32 accumulation."""
  s = jnp.einsum("bkgd,bkrd->bkgr", q, kv[0], preferred_element_type=jnp.float32)
  s = s * (1.0 / math.sqrt(q.shape[-1]))
  s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
  m = jnp.max(s, axis=-1)
  m = jnp.where(m == -jnp.inf, 0.0, m)  # No valid row: every e below is 0.
  e = jnp.exp(s - m[..., None])
  total = jnp.sum(e, axis=-1)
  o = jnp.einsum("bkgr,bkrd->bkgd", e.astype(kv.dtype), kv[1], preferred_element_type=jnp.float32)
  some = total > 0
  return jnp.where(some[..., None], o / jnp.where(some, total, 1.0)[..., None], 0.0), m + jnp.log(total)


def merge_partials(o1, lse1, o2, lse2):
  """The split-K merge of two attention partials over disjoint rows: exact up to f32 rounding.

  o1, o2 f32[..., Dh], each normalized over its rows; lse1, lse2 f32[...], their log-sum-exps (-inf: no rows, and
  then that o must be finite, e.g. 0; not both). Returns o f32[..., Dh] and lse f32[...] over the union of the rows.
  """
  m = jnp.maximum(lse1, lse2)
  w1, w2 = jnp.exp(lse1 - m), jnp.exp(lse2 - m)
  total = w1 + w2
  return (w1[..., None] * o1 + w2[..., None] * o2) / total[..., None], m + jnp.log(total)


def decode_tail_partial(
    q,
    tail,
    open_page,
    start,
    end,
    *,
    kv_format: KVFormat,
    attention_impl: str = "xla",
    mesh: jax.sharding.Mesh | None = None,
):
  """The device's partial of a split layer: attention over the delivered tail and the open page.

  q f32[B, K, G, Dh] from decode_query; tail stored [2, B, K, T, E] rows [W - T, W), or None while T = 0; open_page
  stored [2, B, K, P, E] rows [W, W + P), the new row written; start i32[B]; end i32[], W = end - end % P;
  attention_impl, mesh: as decode_layer's (the leaves end-anchored at `end`, rows before the tail masked; the rows
  as jaxkv.decode_attention.attention_rows gives them). Returns o f32[B, K, G, Dh] and lse f32[B, K, G]
  (partial_attention).
  """
  t_rows, page = (0 if tail is None else tail.shape[3]), open_page.shape[3]
  stored = (open_page,) if tail is None else (tail, open_page)
  parts = decode_attention.attention_rows(attention_impl, kv_format, stored)
  q = q.astype(kv_format.values_dtype)
  first_row = end - end % page - t_rows
  if attention_impl != "legacy":
    kw = dict(impl=attention_impl, mesh=mesh, kv_format=kv_format)
    return decode_attention.attend(q, parts, first_row, start, end, **kw)
  key_rows = first_row + jnp.arange(t_rows + page, dtype=jnp.int32)
  mask = (key_rows[None, :] >= start[:, None]) & (key_rows[None, :] <= end)  # [B, T + P]; row `end` is valid.
  return partial_attention(q, jnp.concatenate(parts, axis=3) if len(parts) > 1 else parts[0], mask)


def decode_merge(p, x, o, lse, host_o, host_lse, *, cfg: ModelConfig):
  """The end of a split layer: the device's partial (o, lse) merged with the host's (host_o f32[B, K, G, Dh],
  host_lse f32[B, K, G] over rows [0, W - T); o = 0, lse = -inf where no row was valid), then the rest of the
  layer. x [B, D] -> x [B, D]; a verify pass: x [B, T, D], the partials over T * G query heads per kv head
  (decode_query), the rest of the layer over the B * T rows."""
  o, _ = merge_partials(host_o, host_lse, o, lse)
  if x.ndim == 2:
    b, k, g, dh = o.shape
    return attn_out_and_mlp(p, x[:, None, :], o.reshape(b, 1, k * g, dh).astype(x.dtype), cfg)[:, 0, :]
  (b, t, _), (k, dh) = x.shape, o.shape[1::2]
  o = o.reshape(b, k, t, -1, dh).transpose(0, 2, 1, 3, 4).reshape(b * t, 1, -1, dh)
  return attn_out_and_mlp(p, x.reshape(b * t, 1, -1), o.astype(x.dtype), cfg, batch=b).reshape(x.shape)


def embed(params, tokens):
  """tokens i32[...] -> [..., D]."""
  return jnp.take(params["embed"], tokens, axis=0)


def logits(params, x, cfg: ModelConfig, batch: int | None = None):
  """x [..., D] -> f32 logits [..., V], on at least MIN_ROWS rows; a verify pass's x [B, T, D] with batch = B
  (on_min_rows)."""
  w = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
  head = lambda x: jnp.einsum(
      "btd,dv->btv", rms_norm(x, params["final_norm"], cfg.rms_eps), w, preferred_element_type=jnp.float32
  )
  lead = x.shape[:-1]
  rows = math.prod(lead)
  return on_min_rows(head, x.reshape(rows, 1, x.shape[-1]), batch=batch).reshape(lead + (w.shape[1],))
