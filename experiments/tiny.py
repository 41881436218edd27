"""CI-sized model: f32 so that sharded runs match the one-device run tightly. 8 KV heads split over up to 8
devices; 6 layers so that pipeline depths 1, 2 and 4 all run uncapped."""

from experiments import common


def get_config(arg=None):
  del arg
  c = common.base_config()
  c.model.update(
      vocab_size=256,
      d_model=64,
      num_layers=6,
      num_heads=16,
      num_kv_heads=8,
      head_dim=16,
      mlp_dim=128,
      rope_theta=10_000.0,
      dtype="float32",
  )
  c.kv.block = 8
  c.engine.update(capacity=128, prefill_chunk=16)
  return c
