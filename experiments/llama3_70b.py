"""Llama-3-70B geometry, random weights: for planning memory (80 layers, 8 KV heads of 128)."""

from experiments import common


def get_config(arg=None):
  common.check_variant("llama3_70b", arg)
  c = common.base_config()
  c.model.update(
      vocab_size=128_256,
      d_model=8192,
      num_layers=80,
      num_heads=64,
      num_kv_heads=8,
      head_dim=128,
      mlp_dim=28_672,
      rope_theta=500_000.0,
      rms_eps=1e-5,
  )
  c.engine.update(capacity=32_768 + 256, prefill_chunk=2048)
  return c
