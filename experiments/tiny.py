"""CI-sized model: f32 so that sharded runs match the one-device run tightly. 8 KV heads split over up to 8
devices; 6 layers in decode groups of 2 (kv.group_layers), so that its 3 groups run pipeline depths 1 and 2
uncapped: the default demo's host placement really pipelines. Its sizes (8-row blocks, 128 rows) keep its
windows whole blocks at the default prompts' lengths; a checkpoint or GGUF run takes the engine's defaults instead
(jaxkv.apps.cli)."""

from experiments import common


def get_config(arg=None):
  common.check_variant("tiny", arg)
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
  c.kv.update(block=8, group_layers=2)
  c.engine.update(capacity=128, prefill_chunk=16)
  return c
