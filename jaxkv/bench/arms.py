"""The benchmark's arms: an arm name -> its config.

An arm is a KV placement and delivery depth ("device"; "host_d0" = ordered; "host_dN" = pipelined at depth N;
"auto_dN" = the residency planner), optionally with a KV dtype suffix ("host_d2_int8", "host_d2_int4", "device_int4",
"device_float8_e4m3fn"; none = the config's kv.dtype) and then a host attention suffix ("host_d2_ha": the host's share
chosen at start; "host_d2_ha40": f = 0.40; jaxkv.host.split), a decode group suffix ("device_g1":
kv.group_layers = 1, one call per layer; none = the config's) and last a speculative decoding suffix ("host_d2_spec":
the lookup drafter, speculate.mode lookup; "host_d2_spec3": an oracle drafter whose drafts of speculate.k tokens hold
3 right ones, so that each verify pass accepts 3 where the page leaves room: jaxkv.speculate.Oracle; "host_d2_self":
self-speculation from an int4 copy of the KV on the device, speculate.mode self: jaxkv.self_draft), or the Hugging
Face peer (PEER_ARM, jaxkv.bench.peer_hf).
"""

from __future__ import annotations

import dataclasses
import re

from jaxkv.config import KV_DTYPES, Config

PEER_ARM = "hf_offloaded"
ORDERED_ARM = "host_d0"
DEVICE_ARM = "device"
ARM_KV_DTYPES = tuple(d for d in KV_DTYPES if d != "model")  # Arm name suffixes.
_ARM_RE = re.compile(
    rf"^(device|(host|auto)_d(\d+))(?:_({'|'.join(ARM_KV_DTYPES)}))?(_ha(\d\d)?)?(?:_g(\d+))?(?:(_spec(\d+)?)|(_self))?$"
)


@dataclasses.dataclass(frozen=True)
class ArmSpec:
  """placement: "device", "host" or "auto"; depth: None for "device"; kv_dtype: None = the config's kv.dtype;
  host_attention: None = off, 0.0 = the share chosen at start (jaxkv.host.split), f in (0, 1) = that share;
  group_layers: kv.group_layers (None = the config's); speculate: None = off, "lookup", "self" or "oracle" (then
  right: its drafts' right tokens)."""

  placement: str
  depth: int | None = None
  kv_dtype: str | None = None
  host_attention: float | None = None
  group_layers: int | None = None
  speculate: str | None = None
  right: int | None = None


def parse_arm(name: str) -> ArmSpec:
  """Arm name -> ArmSpec: "device"; "host_d<N>" / "auto_d<N>"; then "_<kv dtype>", then "_ha" or "_ha<NN>", then
  "_g<N>" (kv.group_layers N), then "_spec", "_spec<M>" or "_self"."""
  m = _ARM_RE.match(name)
  if not m or (m.group(5) and m.group(2) is None) or m.group(6) == "00":
    raise ValueError(
        f"unknown arm {name!r}: use 'device', 'host_d<depth>' (host_d0 = ordered) or 'auto_d<depth>' (residency "
        f"planner), optionally followed by '_<kv dtype>' with a kv dtype of {', '.join(ARM_KV_DTYPES)} "
        "(e.g. host_d2_int8, host_d2_int4), then for a host or auto arm '_ha' (host attention, share measured) or "
        "'_ha<NN>' (share NN / 100, e.g. host_d2_ha40), and last optionally '_g<N>' (N layers per decode call at most, "
        "kv.group_layers; e.g. device_g1, one call per layer), then '_spec' (speculative decoding, the lookup drafter), "
        "'_spec<M>' (an oracle drafter of M right tokens) or '_self' (self-speculation from an int4 copy of the KV)"
    )
  ha = None if not m.group(5) else int(m.group(6) or 0) / 100
  group_layers = None if m.group(7) is None else int(m.group(7))
  kind = "self" if m.group(10) else None if not m.group(8) else "lookup" if m.group(9) is None else "oracle"
  spec = dict(speculate=kind)
  spec["right"] = None if m.group(9) is None else int(m.group(9))
  if m.group(2) is None:
    return ArmSpec("device", None, m.group(4), group_layers=group_layers, **spec)
  return ArmSpec(m.group(2), int(m.group(3)), m.group(4), ha, group_layers, **spec)


def arm_config(config: Config, arm: str) -> Config:
  """The config of an arm (an oracle arm's speculate section is the config's: its drafter is the run's); ValueError
  when its KV dtype does not fit the model (int8 and int4 need head_dim % 32 == 0)."""
  a = parse_arm(arm)
  kv = dataclasses.replace(
      config.kv,
      placement=a.placement,
      pipeline_depth=config.kv.pipeline_depth if a.depth is None else a.depth,
      dtype=a.kv_dtype or config.kv.dtype,
      host_attention=a.host_attention is not None,
      host_attention_fraction=a.host_attention or 0.0,
      group_layers=config.kv.group_layers if a.group_layers is None else a.group_layers,
  )
  if a.speculate in ("lookup", "self"):
    return dataclasses.replace(config, kv=kv, speculate=dataclasses.replace(config.speculate, mode=a.speculate))
  return dataclasses.replace(config, kv=kv)


def arm_kv_dtype(config: Config, arm: str) -> str:
  """The KV dtype an arm runs with (its suffix, else the config's kv.dtype)."""
  return parse_arm(arm).kv_dtype or config.kv.dtype
