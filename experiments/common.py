"""The fields every experiment shares; each experiment file overrides the model and the sizes."""

import ml_collections


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.model = ml_collections.ConfigDict(
      dict(
          vocab_size=0,
          d_model=0,
          num_layers=0,
          num_heads=0,
          num_kv_heads=0,
          head_dim=0,
          mlp_dim=0,
          rms_eps=1e-5,
          rope_theta=500_000.0,
          rope_scaling=None,
          qk_norm=False,
          tie_embeddings=False,
          dtype="bfloat16",
      )
  )
  # RoPE scaling for long contexts (jaxkv.config.RopeScaling): rope_type "llama3" (Llama-3.1) reads factor,
  # low/high_freq_factor and original_max_position; "yarn" (Qwen3) reads factor, original_max_position, beta_fast,
  # beta_slow, mscale, mscale_all_dim, attention_factor and truncate (None = as transformers derives it).
  c.model.rope_scaling = ml_collections.ConfigDict(
      dict(
          rope_type="llama3",
          factor=8.0,
          low_freq_factor=1.0,
          high_freq_factor=4.0,
          original_max_position=8192,
          beta_fast=32.0,
          beta_slow=1.0,
          mscale=ml_collections.FieldReference(None, field_type=float),
          mscale_all_dim=ml_collections.FieldReference(None, field_type=float),
          attention_factor=ml_collections.FieldReference(None, field_type=float),
          truncate=True,
      )
  )
  c.model.use_rope_scaling = False  # True: apply model.rope_scaling.
  c.kv = ml_collections.ConfigDict(
      dict(
          placement="device",
          pipeline_depth=2,
          block=256,
          budget_mib=0,
          headroom_mib=512,
          transport_debug=0,
          dtype="model",  # "model" = model.dtype; or bfloat16, float32, int8, int4, float8_e4m3fn (jaxkv.kv_quant).
          # placement "auto": device GiB for the KV (None = free memory; jaxkv.residency); a float when overridden.
          device_budget_gib=ml_collections.FieldReference(None, field_type=float),
          host_attention=False,  # placement "host" or "auto": attend a share of each window on the host CPU.
          host_attention_fraction=0.0,  # With host_attention: that share; 0 = from rates measured at start.
          host_attention_threads=0,  # With host_attention: the CPU kernel's threads; 0 = numba's pool - 2, at most 16.
          host_attention_wait="auto",  # With host_attention: who waits for its partial: "thread", "device" or "auto".
          group_layers=0,  # Layers per decode call; 0 = automatic (jaxkv.residency.decode_groups), 1 = one per layer.
      )
  )
  # prefill_attention: "auto" (cuDNN's flash attention on a GPU where it runs, else plain XLA), "xla" or "cudnn".
  c.engine = ml_collections.ConfigDict(dict(capacity=4096, prefill_chunk=1024, prefill_attention="auto"))
  c.sampling = ml_collections.ConfigDict(dict(temperature=0.0, top_k=0, top_p=1.0, eos_id=-1))
  c.mesh = ml_collections.ConfigDict(dict(tensor=-1))
  c.split = ml_collections.ConfigDict(dict(mode="tensor", layer_split=""))  # jaxkv.layout.
  return c
