"""Llama-3(.1)-8B geometry, random weights.

arg "3.1" turns on Llama-3.1 rope scaling (128k contexts); run it with --capacity=131328 (128k + a block) or more.
"""

from experiments import common


def get_config(arg=None):
  common.check_variant("llama3_8b", arg, ("3.1",))
  c = common.base_config()
  c.model.update(
      vocab_size=128_256,
      d_model=4096,
      num_layers=32,
      num_heads=32,
      num_kv_heads=8,
      head_dim=128,
      mlp_dim=14_336,
      rope_theta=500_000.0,
      rms_eps=1e-5,
  )
  c.model.use_rope_scaling = arg == "3.1"
  c.engine.update(capacity=32_768 + 256, prefill_chunk=2048)
  return c
