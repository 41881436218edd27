"""Qwen3-32B geometry, random weights: 64 layers, 64 query / 8 KV heads of 128, per-head q/k RMSNorm.

arg "yarn" turns on the YaRN rope scaling that the Qwen3 model cards set for 128k contexts (factor 4 over the
pretrained 32k); run it with --capacity=131328 (128k + a block).
"""

from experiments import common


def get_config(arg=None):
  common.check_variant("qwen3_32b", arg, ("yarn",))
  c = common.base_config()
  c.model.update(
      vocab_size=151_936,
      d_model=5120,
      num_layers=64,
      num_heads=64,
      num_kv_heads=8,
      head_dim=128,
      mlp_dim=25_600,
      rope_theta=1_000_000.0,
      rms_eps=1e-6,
      qk_norm=True,
  )
  c.model.rope_scaling.update(rope_type="yarn", factor=4.0, original_max_position=32_768)
  c.model.use_rope_scaling = arg == "yarn"
  c.engine.update(capacity=32_768 + 256, prefill_chunk=2048)
  return c
