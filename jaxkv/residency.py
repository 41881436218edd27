"""The residency planner: `place` plans a new KVCache's placement before anything is allocated, and the cache is
given it: which layers' windows live in pinned host memory, the decode groups, and with `kv.placement = "auto"` the
plan that keeps in device memory the layers whose KV fits and streams the rest. Where a layer is streamed it also
checks the host RAM and the pinned pool (jaxkv.host.memory.RESERVED.reserve).

Granularity: whole decode groups (`decode_groups`, the same in every placement). A layer's window stays ONE array
in one memory, so a streamed group is one delivery and a resident group none, and every group runs the same
compiled function whichever memory its windows come from: outputs stay bit-identical to the device and host
placements. A row-range split of every layer would need two arrays per layer (two deliveries, or a device-side
concatenation that copies the resident rows through HBM each step). A group holds at most 1 GiB per device
(GROUP_TARGET_BYTES) or one layer where a layer is larger: 1-3% of the KV with 32-80 layers at long contexts.

Budget (per device, at the cache's full capacity): free memory of the fullest device when the cache is
allocated (after the weights), minus the delivery ring (`ring_bytes`: depth + 2 groups of streamed layers, or of
their chunks where decode delivers windows in chunks, jaxkv.chunked), minus a
workspace (`workspace_bytes`: the windows grown at a page boundary, one group's where decode delivers windows in
chunks and grows each from its chunks in one buffer, else two groups'; a prefill call's temporaries; one layer's window more, for the holes that grown windows leave; the prefill scores,
WORKSPACE_SCORE_BLOCKS x jaxkv.model.SCORE_BUDGET_BYTES), minus kv.headroom_mib. kv.device_budget_gib replaces the
automatic figure (and lets tests and benchmarks emulate a smaller device); it may not exceed the free memory where
that is known. Where the backend reports no memory (CPU) and no budget is given, every layer is resident.

Decode after a prefill (`decode_plan`): where nothing prefills into the cache again (jaxkv.engine.Engine.generate),
decode runs on a second plan of the same free memory and ring less decode's own workspace (no prefill temporaries,
no holes: the cache's resident windows are allocated at the largest window of the generation, jaxkv.cache.KVCache's
full_rows), which makes more of the prefill's streamed layers resident (jaxkv.engine.Engine.place_for_decode).

Order: the resident layers are spread evenly among the streamed ones (`spread`), so that the link keeps
delivering streamed layers while resident layers compute: with a contiguous resident block, the ring
(depth + 1 deliveries ahead) fills and the link idles for the rest of the block.

Step-time model (`predict_step_ms`): transfers overlap compute, so a decode step takes
max(streamed bytes / link bandwidth, compute time of all layers).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from absl import logging

from jaxkv import cache as cache_lib
from jaxkv import chunked
from jaxkv import decode_attention as da
from jaxkv import mesh as mesh_lib
from jaxkv import model
from jaxkv.config import KVConfig, ModelConfig
from jaxkv.host import memory
from jaxkv.kv_quant import KVFormat

WORKSPACE_SCORE_BLOCKS = 3  # f32 scores, their softmax weights and one spare, of the prefill's query blocks.
GROUP_TARGET_BYTES = 2**30  # Per device: what an automatic group (kv.group_layers 0) delivers, up to GROUP_MAX_LAYERS.
GROUP_MAX_LAYERS = 8  # Layers in an automatic group: a step of L layers has at least L / 8 deliveries to overlap.
# The XLA leaves' temporaries in a decode step, in windows of the model dtype: 2.13 at a 4096-row window (XLA's
# memory analysis on CPU, tests/test_residency.py).
XLA_LEAVES_WINDOWS = 3
RING_SPARE = 2  # Ring slots beyond the depth: the delivery being computed and the previous one (jaxkv.transport).


def group_layers(group_layers: int, host_attention: bool, layer_bytes: int) -> int:
  """Layers per decode call (decode_groups) in every placement: 1 with host attention (its layers keep their own
  calls), else kv.group_layers when set, else as many layers as deliver GROUP_TARGET_BYTES per device (layer_bytes:
  one layer's window per device), at least 1 and at most GROUP_MAX_LAYERS: few calls a step where the windows are
  small, and deliveries that the pipeline can overlap (docs/design.md, "Decode groups")."""
  if host_attention:
    return 1
  if group_layers:
    return group_layers
  return min(GROUP_MAX_LAYERS, max(1, GROUP_TARGET_BYTES // max(layer_bytes, 1)))


def decode_groups(stage_of: tuple[int, ...], per_group: int) -> tuple[tuple[int, ...], ...]:
  """The layers of a pass in groups of consecutive layers, each one decode call and, when streamed, one delivery:
  the runs of layers of one stage (stage_of[l]) cut into groups of `per_group` layers (group_layers).

  The groups do not depend on where the windows live: every placement and depth runs the same group programs, so
  that they give the same bits wherever a compiler may build a layer differently inside groups of other sizes; the
  residency planner keeps or streams whole groups."""
  runs: list[list[int]] = []
  for l, stage in enumerate(stage_of):
    if runs and stage == stage_of[runs[-1][0]]:
      runs[-1].append(l)
    else:
      runs.append([l])
  return tuple(tuple(run[i : i + per_group]) for run in runs for i in range(0, len(run), per_group))


def ring_bytes(depth: int, slot_bytes: int) -> int:
  """The delivery ring per device: depth + RING_SPARE slots of `slot_bytes` (a group's windows)."""
  return (depth + RING_SPARE) * slot_bytes


@dataclasses.dataclass(frozen=True)
class Plan:
  """streamed[l]: layer l's window lives in pinned host memory (else device memory).
  layer_bytes: one layer's KV per device at full capacity; budget_bytes: device bytes the KV may take;
  budget_source: "kv.device_budget_gib", "free device memory" or "no device memory limit"; what the budget left
  out of the free memory (per device): free_bytes (None: unknown), ring_bytes (the delivery ring at the depth asked,
  in chunks where windows are chunked) and workspace_bytes (workspace_bytes). A plan for decode after a prefill
  (decode_plan) also has the layers it made resident that the prefill streamed (promoted) and the prefill's
  workspace (prefill_workspace_bytes; None for any other plan)."""

  streamed: tuple[bool, ...]
  layer_bytes: int
  budget_bytes: int | None
  budget_source: str
  free_bytes: int | None = None
  ring_bytes: int = 0
  workspace_bytes: int = 0
  promoted: tuple[int, ...] = ()
  prefill_workspace_bytes: int | None = None

  @property
  def resident_layers(self) -> int:
    return self.streamed.count(False)

  def summary(self) -> dict:
    return dict(
        resident_layers=self.resident_layers,
        streamed_layers=len(self.streamed) - self.resident_layers,
        layer_bytes_per_device=self.layer_bytes,
        device_budget_bytes=self.budget_bytes,
        budget_source=self.budget_source,
        free_bytes_per_device=self.free_bytes,
        ring_bytes_per_device=self.ring_bytes,
        workspace_bytes_per_device=self.workspace_bytes,
        streamed=[l for l, s in enumerate(self.streamed) if s],
        **(
            {}
            if self.prefill_workspace_bytes is None
            else dict(promoted=list(self.promoted), prefill_workspace_bytes_per_device=self.prefill_workspace_bytes)
        ),
    )


@dataclasses.dataclass(frozen=True)
class Placement:
  """A cache's placement (jaxkv.cache.KVCache): streamed[l], layer l's window in pinned host memory (else device
  memory); the decode groups (decode_groups); plan, auto's Plan (None for "device" and "host"); chunk_rows, the rows
  of a delivery chunk of a streamed layer's window in decode (jaxkv.chunked; 0: whole windows)."""

  streamed: tuple[bool, ...]
  groups: tuple[tuple[int, ...], ...]
  plan: Plan | None
  chunk_rows: int = 0


def place(
    model_config: ModelConfig, kv: KVConfig, layout, batch: int, capacity: int, prefill_chunk: int = 0
) -> Placement:
  """The placement of a new KVCache of the same arguments (layout: jaxkv.layout.Layout), planned before anything is
  allocated: the decode groups; with kv.placement "auto" the plan, its budget from the free memory of the layers'
  devices (this process's) less the workspace of decode and of a prefill in chunks of `prefill_chunk` rows (0: no
  prefill); where a layer is streamed, the host memory check (jaxkv.host.memory.RESERVED.reserve)."""
  num_layers = model_config.num_layers
  meshes = [layout.mesh(l) for l in range(num_layers)]
  rows, tensor = cache_lib.rows_bound(capacity, kv.block), mesh_lib.tensor_size(meshes[0])
  row = cache_lib.row_bytes(model_config, kv.dtype, batch, tensor)
  layer_bytes = row * rows
  group = group_layers(kv.group_layers, kv.host_attention, layer_bytes)
  groups = decode_groups(layout.stage_of, group)
  c_rows = delivery_chunk_rows(kv, group, row)
  auto = None
  if kv.placement == "auto" and len({id(m) for m in meshes}) > 1:
    raise ValueError("kv.placement auto plans one mesh for every layer; use split mode tensor or none with it")
  if kv.placement == "auto":
    free = free_device_bytes(meshes[0].local_devices)
    auto = auto_plan(model_config, kv, batch, capacity, prefill_chunk, groups, tensor, free)
    streamed = auto.streamed
    logging.info(
        "kv placement auto: %d of %d layers resident (%.1f MiB per layer per device, %d layers per group, budget %s "
        "from %s), %d streamed",
        auto.resident_layers,
        num_layers,
        layer_bytes / 2**20,
        group,
        "none" if auto.budget_bytes is None else f"{auto.budget_bytes / 2**20:.0f} MiB",
        auto.budget_source,
        num_layers - auto.resident_layers,
    )
  else:
    streamed = (kv.placement == "host",) * num_layers
  if any(streamed):
    needed = cache_lib.host_bytes_per_process(meshes[0], layer_bytes, sum(streamed))
    fmt = KVFormat.of(model_config, kv.dtype)
    memory.RESERVED.reserve(needed, sum(streamed), model_config, fmt, batch, rows)
  return Placement(streamed, groups, auto, c_rows)


def auto_plan(
    model_config: ModelConfig,
    kv: KVConfig,
    batch: int,
    capacity: int,
    prefill_chunk: int,
    groups: tuple[tuple[int, ...], ...],
    devices: int,
    free: int | None,
) -> Plan:
  """kv.placement auto's plan of a cache of the same arguments (place's; groups: its decode groups, heads over
  `devices`) where the fullest device has `free` bytes free (None: unknown): its budget less the ring and the
  workspace (the one that place gives; jaxkv.apps.plan prints it for a device that is not here)."""
  rows = cache_lib.rows_bound(capacity, kv.block)
  row = cache_lib.row_bytes(model_config, kv.dtype, batch, devices)
  layer_bytes = row * rows
  group = group_layers(kv.group_layers, kv.host_attention, layer_bytes)
  c_rows = delivery_chunk_rows(kv, group, row)
  ring = ring_bytes(
      kv.pipeline_depth,
      chunked.slot_bytes(
          min(group, model_config.num_layers) * layer_bytes, c_rows, row, KVFormat.of(model_config, kv.dtype).row_bytes
      ),
  )
  growth = chunked_growth(kv, c_rows, rows)
  workspace = workspace_bytes(model_config, kv.dtype, batch, rows, prefill_chunk, group, devices, growth)
  budget, source = device_budget(free, kv.device_budget_gib, ring, workspace, kv.headroom_mib)
  auto = plan(groups, layer_bytes, budget, source)
  return dataclasses.replace(auto, free_bytes=free, ring_bytes=ring, workspace_bytes=workspace)


def chunked_growth(kv: KVConfig, c_rows: int, rows: int, decode: bool = False) -> bool:
  """Whether windows of up to `rows` rows grow from their delivery chunks of c_rows rows (jaxkv.chunked): those past
  two chunks do, smaller ones grow whole, two at a time but together at most a window. Host attention's windows
  are split on the devices where a prefill stores them (two windows), and in decode (`decode`) grow into one buffer
  like the others (jaxkv.host.decode.Growth)."""
  return bool(c_rows) and 2 * (c_rows + kv.block) <= rows and (decode or not kv.host_attention)


def decode_plan(
    model_config: ModelConfig,
    kv: KVConfig,
    batch: int,
    capacity: int,
    devices: int,
    prefill: Placement,
    impl: str,
) -> Plan | None:
  """auto's plan for the decode that follows a prefill into a cache placed as `prefill` (its placement, heads over
  `devices`), where nothing prefills into the cache again (jaxkv.engine.Engine.generate): the budget of the same
  free memory less the same ring and decode_workspace_bytes (the resident windows allocated at the largest window;
  impl: the decode attention that runs), and as many more of the streamed groups resident (`promoted`, spread evenly
  among them) as it holds (with host attention, the remaining streamed layers keep their split). None where it
  promotes nothing, and where there is no such plan: nothing streamed (every window stays as the cache allocates
  it), or a budget given (kv.device_budget_gib)."""
  before = prefill.plan
  if before is None or before.budget_source != "free device memory" or not any(before.streamed):
    return None
  rows = cache_lib.rows_bound(capacity, kv.block)
  group = max(map(len, prefill.groups))
  growth = chunked_growth(kv, prefill.chunk_rows, rows, decode=True)
  joins = prefill.chunk_rows if growth and kv.host_attention else 0
  workspace = decode_workspace_bytes(model_config, kv.dtype, batch, rows, group, devices, growth, impl, joins)
  budget, source = device_budget(before.free_bytes, None, before.ring_bytes, workspace, kv.headroom_mib)
  room = budget // max(before.layer_bytes, 1) - before.resident_layers
  streamed = [g for g in prefill.groups if before.streamed[g[0]]]
  for kept in range(len(streamed) + 1):  # The fewest streamed groups left whose promotion fits.
    promoted = [g for g, s in zip(streamed, spread(len(streamed), len(streamed) - kept)) if not s]
    if sum(map(len, promoted)) <= room:
      break
  up = {l for g in promoted for l in g}
  if not up:
    return None
  return Plan(
      tuple(s and l not in up for l, s in enumerate(before.streamed)),
      before.layer_bytes,
      budget,
      source,
      before.free_bytes,
      before.ring_bytes,
      workspace,
      promoted=tuple(sorted(up)),
      prefill_workspace_bytes=before.workspace_bytes,
  )


def delivery_chunk_rows(kv: KVConfig, group: int, row_bytes: int) -> int:
  """The rows of a delivery chunk (jaxkv.chunked.chunk_rows of kv.delivery_chunk_mib, row_bytes a row per device):
  0 (whole windows) in decode groups of several layers, or with kv.delivery_chunk_mib 0."""
  if group > 1 or not kv.delivery_chunk_mib:
    return 0
  return chunked.chunk_rows(kv.delivery_chunk_mib, row_bytes, kv.block)


def free_device_bytes(devices) -> int | None:
  """Free memory of the fullest device (bytes_limit - bytes_in_use), or None where stats are missing. The devices
  must be this process's."""
  free = []
  for d in devices:
    stats = d.memory_stats() if hasattr(d, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
      return None
    free.append(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
  return min(free) if free else None


def largest_free_block(devices) -> int | None:
  """The smallest, over `devices` (this process's), of the largest free block of device memory, or None where a
  device does not report it (CPU; CUDA's async allocator reports 0)."""
  blocks = [
      (d.memory_stats() or {}).get("largest_free_block_bytes") if hasattr(d, "memory_stats") else None for d in devices
  ]
  return min(blocks) if blocks and all(blocks) else None


def spread(num_layers: int, resident: int) -> tuple[bool, ...]:
  """streamed[l] with `resident` layers (False) spread evenly: layer floor((i + 1/2) * L / n) for i < n."""
  keep = {int((i + 0.5) * num_layers / resident) for i in range(resident)} if resident else set()
  return tuple(l not in keep for l in range(num_layers))


def workspace_bytes(
    model_config: ModelConfig,
    kv_dtype: str,
    batch: int,
    rows: int,
    prefill_chunk: int,
    group: int,
    devices: int,
    chunked_growth: bool,
) -> int:
  """Device memory per device that the KV (windows of `rows` rows, decode groups of `group` layers, heads over
  `devices`) must leave free beside the ring: the windows that grow at a page boundary, one group's with
  chunked_growth (streamed windows delivered in chunks, one layer a group, each grown from its chunks into one buffer
  and landed before the next grows, jaxkv.chunked; a resident window's grown one beside the old; windows of up to a
  chunk, at most half of `rows`, grow whole two at a time), else two (a group's windows grow inside its call, the
  grown beside the delivered, and are stored while the next group's grow); a prefill call's temporaries, one block,
  the larger of the attention's copy of a layer's window in the model dtype (cuDNN: reordered; XLA: joined to the
  chunk) and the MLP's rows of the chunk (x, gate, up and their product: B x C x (D + 3 F / devices) values), and
  the hidden states of the chunks it computes layer by layer (model.prefill_span, up to `rows`); one
  layer's window more, for the holes that windows growing one after another leave, each a chunk or a page smaller
  than the next; the prefill scores. docs/design.md ("Residency planner") has the out-of-memory errors that decided
  it."""
  layer = cache_lib.row_bytes(model_config, kv_dtype, batch, devices) * rows
  window_values = cache_lib.row_bytes(model_config, "model", batch, devices) * rows  # Unpacked to the model dtype.
  itemsize = jnp.dtype(model_config.dtype).itemsize
  mlp_rows = batch * prefill_chunk * (model_config.d_model + 3 * model_config.mlp_dim // devices) * itemsize
  span_rows = min(rows, model.prefill_span(model_config, batch, prefill_chunk) * prefill_chunk) if prefill_chunk else 0
  hidden = batch * span_rows * model_config.d_model * itemsize  # A span's hidden states (Engine.prefill).
  prefill = max(window_values, mlp_rows) + hidden if prefill_chunk else 0
  growth = (1 if chunked_growth else 2) * group * layer
  return growth + prefill + layer + WORKSPACE_SCORE_BLOCKS * model.SCORE_BUDGET_BYTES


def decode_workspace_bytes(
    model_config: ModelConfig,
    kv_dtype: str,
    batch: int,
    rows: int,
    group: int,
    devices: int,
    chunked_growth: bool,
    impl: str,
    join_rows: int = 0,
) -> int:
  """Device memory per device that decode alone needs beside the ring where every resident window is allocated at
  the largest window (jaxkv.cache.KVCache's full_rows, after a prefill: decode_plan): the windows that grow at a
  page boundary (as workspace_bytes counts them; join_rows more rows where host attention's heads take rows of
  their grown tails a delivery chunk at a time, jaxkv.cache.KVCache.store_split_tail), and the decode attention's
  copies of a window in the model dtype (impl, jaxkv.decode_attention): XLA_LEAVES_WINDOWS where the XLA leaves
  gather it, one more where a quantized window is unpacked first (the kernel reads float rows, and int8 rows packed,
  in place). No window for holes: every resident window is replaced by one of its own size, and a streamed one
  grows into a buffer no larger. No prefill term, no scores."""
  row = cache_lib.row_bytes(model_config, kv_dtype, batch, devices)
  window_values = cache_lib.row_bytes(model_config, "model", batch, devices) * rows
  fmt = KVFormat.of(model_config, kv_dtype)
  copies = (XLA_LEAVES_WINDOWS if impl == "xla" else 0) + (fmt.quantized and not da.reads_packed(impl, fmt))
  return ((1 if chunked_growth else 2) * group * rows + join_rows) * row + copies * window_values


def device_budget(
    free_bytes: int | None, override_gib: float | None, ring_bytes: int, workspace: int, headroom_mib: int
) -> tuple[int | None, str]:
  """(bytes the KV may take per device, where the figure comes from); see the module docstring."""
  if override_gib is not None:
    if override_gib < 0:
      raise ValueError(f"kv.device_budget_gib must be >= 0 (or unset for automatic), got {override_gib}")
    budget = int(override_gib * 2**30)
    if free_bytes is not None and budget > free_bytes:
      raise ValueError(
          f"kv.device_budget_gib={override_gib} is more than the free memory of the fullest device "
          f"({free_bytes / 2**30:.2f} GiB); lower it or leave it unset for the automatic figure"
      )
    return budget, "kv.device_budget_gib"
  if free_bytes is None:
    return None, "no device memory limit"
  return max(free_bytes - ring_bytes - workspace - headroom_mib * 2**20, 0), "free device memory"


def plan(groups: tuple[tuple[int, ...], ...], layer_bytes: int, budget_bytes: int | None, source: str) -> Plan:
  """As many whole groups (decode_groups) resident as the budget holds, spread among the streamed ones."""
  num_layers = sum(map(len, groups))
  fits = num_layers if budget_bytes is None else budget_bytes // max(layer_bytes, 1)
  for kept in range(len(groups), -1, -1):
    by_group = spread(len(groups), kept)
    if sum(len(g) for g, s in zip(groups, by_group) if not s) <= fits:
      break
  streamed = tuple(s for g, s in zip(groups, by_group) for _ in g)
  return Plan(streamed, layer_bytes, budget_bytes, source)


def predict_step_ms(streamed_bytes_per_step: float, link_gbps: float, compute_ms: float) -> float:
  """Decode step time when transfers overlap compute: max(streamed bytes / link, compute)."""
  return max(1e3 * streamed_bytes_per_step / (link_gbps * 1e9), compute_ms)
