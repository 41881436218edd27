"""The KV cache: its layout, its placement, and the pure operations on its arrays (store, grow, insert a slot).

KVCache is data: arrays, their shardings and operations on them. It is given its layout (jaxkv.layout.Layout: the mesh
of each layer), its placement (jaxkv.residency.Placement: which windows are streamed, the decode groups, auto's plan,
planned and checked against host memory by jaxkv.residency.place before the cache is made) and, with host attention,
the policy that splits a streamed window (`head_share`, jaxkv.host.split.Split.share). Who dispatches what, and the
host-attention kernel's views of the rows, belong to the objects that use it (jaxkv.decode, jaxkv.host.decode).

Layout, per layer l (B = batch, K = kv heads, P = kv block rows, E = stored values per head row):

  window[l]: [2, B, K, A, E]  rows [W - A, W) of K (index 0) and V (index 1), W = n * P, A = window_rows(W) >= W
             (None while W = 0): with kv.window_buckets = k, m * 2^s blocks (m in [k, 2k)), rows below 0 zeros (a
             start padding that decode masks: every row of a sequence is >= its start >= 0); with 0, A = W; a
             resident window of a cache with full_rows (a generate's decode on its own plan): A = full_rows.
             Lives in the placement's memory: "device" or "pinned_host" (with "auto", per layer:
             jaxkv.residency). Sharded on K over the `tensor`
             mesh axis, so each device's shard (host or device) holds only that device's heads.
  open[l]:   [2, B, K, P, E]  rows [W, W + P), the block being written; always in device memory.
  start:     i32[B]  first valid row of each sequence (prompts are right-aligned: left padding).
  end:       the next row to write, the same for every sequence.

(start and end are the decode state's: jaxkv.meta.Meta.)

E and the dtype follow kv.dtype (jaxkv.kv_quant.KVFormat): E = head_dim values of a float dtype, or for int8, int4
and float8_e4m3fn the quantized values' bytes followed by their float16 scales, all in one uint8 array, so that a
layer's window is still ONE array (one transfer). Zero bytes decode to zeros in every format.

With kv.host_attention (placement "host" or "auto"), a streamed layer's window of W rows is stored as two pinned_host
arrays split at r1 = split_row(W) = floor(f W / P) P, f = head_share(the window's bytes per device): head[l]
[2, B, K, r1, E] rows [0, r1), attended on the host CPU during decode (jaxkv.host), and window[l] [2, B, K, W - r1, E]
rows [r1, W) (the tail), the only rows delivered.
head[l] is None while r1 = 0, and always for resident layers.

Decode compiles a program per window shape A: with buckets O(k log(capacity / P)) of them, not capacity / P. The
padding costs memory and delivered bytes (past the smallest bucket A / W < (k + 1) / k: 2x with k = 1, 1.25x with
k = 4) and changes no bits: decode attention's leaves are anchored at `end` and mask rows before start
(jaxkv.decode_attention), so the rows a leaf holds and its bits do not depend on A. A prefill's windows are exact
(A = W): prefill attention reduces over every row of its window, so its bits would follow A; its last chunk is
bucketed at its END instead (jaxkv.engine.last_chunk_rows), rows past the prompt that causal masking keeps out of
every prompt row's attention.

Row r of sequence b is valid when start[b] <= r < end. A decode step writes row `end` into the open page
(on device); when the open page is full, `grow` appends it to the window, which is stored back in its
placement in one explicit transfer. Host and device placement hold the same arrays in different memories,
so every delivery mode feeds the same compiled layer function the same values.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import distributed
from jaxkv import mesh as mesh_lib
from jaxkv.config import KVConfig, ModelConfig
from jaxkv.decode_attention import LEAF_ROWS
from jaxkv.host import attention as host_attention
from jaxkv.kv_quant import KVFormat


def grow(window, rows, to: int | None = None):
  """window [2, B, K, A, E] or None; rows [2, B, K, N, E] -> [2, B, K, A + N, E], or with `to` its last `to` rows
  (zero rows in front where to > A + N; the rows dropped where to < A + N must be the window's start padding)."""
  full = rows if window is None else jnp.concatenate([window, rows], axis=3)
  if to is None:
    return full
  return pad_front(full[:, :, :, max(full.shape[3] - to, 0) :], to)


def pad_front(window, rows: int):
  """window [2, B, K, W, E] -> [2, B, K, rows, E]: rows - W zero rows in front (rows >= W)."""
  return jnp.pad(window, ((0, 0),) * 3 + ((rows - window.shape[3], 0), (0, 0)))


MIN_BUCKET_ROWS = LEAF_ROWS  # The smallest window bucket: one decode leaf.


def window_rows(rows: int, block: int, capacity: int, buckets: int) -> int:
  """A, the rows allocated for a window of `rows` rows (whole blocks): `rows` itself with buckets = 0; else the
  fewest blocks of the form m * 2^s, m in [buckets, 2 buckets), that hold it and MIN_BUCKET_ROWS, at most the
  capacity rounded up to a block (buckets = 1: powers of two of blocks)."""
  if not buckets or not rows:
    return rows
  blocks, shift = max(-(-rows // block), -(-MIN_BUCKET_ROWS // block)), 0
  while -(-blocks >> shift) >= 2 * buckets:  # ceil(blocks / 2^shift), the multiple m of 2^shift blocks.
    shift += 1
  return min((-(-blocks >> shift) << shift) * block, rows_bound(capacity, block) - block)


def rows_bound(capacity: int, block: int) -> int:
  """Largest window plus open page a cache can reach: capacity rounded up to a block, plus a block."""
  return -(-capacity // block) * block + block


def row_bytes(model: ModelConfig, kv_dtype: str, batch: int, devices: int = 1) -> int:
  """Bytes of one stored cache row (K and V, all batch entries, packed scales included) held by each of
  `devices` head shards."""
  return 2 * batch * (model.num_kv_heads // devices) * KVFormat.of(model, kv_dtype).row_bytes


def host_bytes_per_process(mesh: jax.sharding.Mesh, layer_bytes: int, streamed_layers: int) -> int:
  """Pinned host bytes this process needs at full capacity: its devices' head shares (layer_bytes: one layer's
  window per device) of the streamed layers, plus one layer's window in flight while a grown window replaces the
  old one."""
  local = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
  return layer_bytes * local * (streamed_layers + 1)


@functools.lru_cache(maxsize=None)
def _split_fn(sharding: jax.sharding.Sharding):
  return jax.jit(lambda w, r1: (w[:, :, :, :r1], w[:, :, :, r1:]), static_argnums=1, out_shardings=(sharding,) * 2)


def split_rows(window: jax.Array, r1: int, sharding: jax.sharding.Sharding) -> tuple[jax.Array, jax.Array]:
  """window [2, B, K, W, E] on the devices -> (rows [0, r1), rows [r1, W)), both in `sharding` (device memory)."""
  return _split_fn(sharding)(window, r1)


# A delivery chunk's (K or V, sequence, head) runs are put one by one by DMA from this size up, else the chunk is cut
# by a jitted slice: each put costs a call, and 1 MiB runs (32 sequences of 32k) delivered 19.2 GB/s on the H200
# where 32 MiB runs (one sequence of 1M) delivered 47.6 and the slice 47.8 (docs/design.md, "Delivery chunks").
MIN_RUN_BYTES = 8 * 2**20


def delivers_runs(rows: int, head_row_bytes: int) -> bool:
  """Whether rows_to_device puts a chunk of `rows` rows as its runs (head_row_bytes: one head's stored row)."""
  return rows * head_row_bytes >= MIN_RUN_BYTES


@functools.lru_cache(maxsize=None)
def _stack_fn(device: jax.Device, shape: tuple[int, ...]):
  """(runs [R, E] on `device`, 2 * B * K of them in (K or V, sequence, head) order) -> [2, B, K, R, E] = shape."""
  return jax.jit(lambda runs: jnp.stack(runs).reshape(shape), out_shardings=jax.sharding.SingleDeviceSharding(device))


@functools.lru_cache(maxsize=None)
def _slice_fn(sharding: jax.sharding.Sharding, rows: int):
  return jax.jit(
      lambda w, first: jax.device_put(jax.lax.dynamic_slice_in_dim(w, first, rows, axis=3), jax.memory.Space.Device),
      out_shardings=sharding,
  )


def put_rows(window: jax.Array, first: int, rows: int, sharding: jax.sharding.Sharding) -> Callable[[], jax.Array]:
  """Issues the copy of rows [first, first + rows) of a window [2, B, K, W, E] (in pinned host memory) to the
  devices, in `sharding` (a delivery chunk, jaxkv.chunked); returns the function that gives the rows there. Where
  its runs are large enough (delivers_runs), each (K or V, sequence, head) run of the rows, contiguous in host
  memory, is copied now by a jax.device_put of a zero-copy numpy view of it (jaxkv.host.attention.shard_views): DMA
  on the runtime's host-to-device stream, beside the devices' compute; the function then stacks each device's runs
  in one call. That call waits for the runs' DMA in the devices' compute order, and holds up every call dispatched
  after it: the chunk's consumer makes it just before the call that reads the chunk (jaxkv.transport), not the
  thread that issues the copies ahead. Else one jitted slice copies the rows now: a program, run in the devices'
  compute order (34.6 GB/s against 54.1 for the runs on the H100, docs/design.md)."""
  if not delivers_runs(rows, window.shape[4] * window.dtype.itemsize):
    chunk = _slice_fn(sharding, rows)(window, first)
    return lambda: chunk
  puts = []
  for shard, (_, view) in zip(window.addressable_shards, host_attention.shard_views(window)):
    runs = [
        view[i, b, h, first : first + rows]
        for i in range(2)
        for b in range(view.shape[1])
        for h in range(view.shape[2])
    ]
    puts.append(
        (shard.device, view.shape, jax.device_put(runs, [jax.sharding.SingleDeviceSharding(shard.device)] * len(runs)))
    )

  def stacked() -> jax.Array:
    parts = [_stack_fn(device, (*v[:3], rows, v[4]))(on) for device, v, on in puts]
    return jax.make_array_from_single_device_arrays((*window.shape[:3], rows, window.shape[4]), sharding, parts)

  return stacked


def rows_to_device(window: jax.Array, first: int, rows: int, sharding: jax.sharding.Sharding) -> jax.Array:
  """Rows [first, first + rows) of a window [2, B, K, W, E] (in pinned host memory) -> on the devices, in
  `sharding`: put_rows' copy, stacked at once."""
  return put_rows(window, first, rows, sharding)()


@functools.lru_cache(maxsize=None)
def _grow_fn(sharding: jax.sharding.Sharding):
  return jax.jit(grow, out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _write_fn(sharding: jax.sharding.Sharding, skip: int = 0):
  """(buffer [2, B, K, A, E] donated, rows [2, B, K, N, E] on the devices, at) -> buffer with rows [skip, N) at row
  `at`, in place (in pinned host memory inside the call where `sharding` is there)."""
  to_host = sharding.memory_kind == "pinned_host"

  def write(buf, rows, at):
    rows = rows[:, :, :, skip:]
    if to_host:
      rows = jax.device_put(rows, jax.memory.Space.Host)
    return jax.lax.dynamic_update_slice_in_dim(buf, rows, at, axis=3)

  return jax.jit(write, out_shardings=sharding, donate_argnums=(0,))


def write_rows(buffer: jax.Array, rows: jax.Array, at: int, sharding: jax.sharding.Sharding, skip: int = 0):
  """buffer [2, B, K, A, E] (donated, in `sharding`: device or pinned host memory) with rows [skip, N) of rows
  [2, B, K, N, E] (on the devices) written at row `at`, in place."""
  return _write_fn(sharding, skip)(buffer, rows, at)


@functools.lru_cache(maxsize=None)
def _zeros_fn(shape: tuple[int, ...], dtype, sharding: jax.sharding.Sharding):
  return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _insert_fn(sharding: jax.sharding.NamedSharding):
  """insert(rows, new, b): rows [2, B, K, R, E] in `sharding` (donated); new [2, 1, K, R, E] on the devices -> rows
  with slot b = new, in place (into pinned host memory inside the call where `sharding` is there)."""
  to_host = sharding.memory_kind == "pinned_host"

  def insert(rows, new, b):
    if to_host:
      new = jax.device_put(new, jax.memory.Space.Host)
    return jax.lax.dynamic_update_slice(rows, new, (0, b, 0, 0, 0))

  return jax.jit(insert, out_shardings=sharding, donate_argnums=(0,))


@dataclasses.dataclass(frozen=True)
class Issued:
  """What an operation issued: bytes copied device -> host, and jitted calls and transfers."""

  d2h_bytes: int = 0
  calls: int = 0

  def __add__(self, other: Issued) -> Issued:
    return Issued(self.d2h_bytes + other.d2h_bytes, self.calls + other.calls)


class KVCache:
  """Holds the per-layer windows and open pages; see the module docstring for the layout."""

  def __init__(
      self,
      model: ModelConfig,
      kv: KVConfig,
      layout,
      batch: int,
      capacity: int,
      *,
      placement,
      head_share: Callable[[int], float] | None = None,
      buckets: int = 0,
      full_rows: int = 0,
  ):
    """layout (jaxkv.layout.Layout): the mesh of each layer. placement (jaxkv.residency.Placement, from
    residency.place with the same arguments): where each window lives, the decode groups and the auto plan.
    head_share: with host attention, the host's share f of a streamed window of that many bytes per device
    (jaxkv.host.split.Split.share); None without. buckets: window sizes per doubling (window_rows; 0 = exact
    windows); not with head_share. full_rows (whole blocks; 0: none): a resident layer's window, once placed by a
    prefill or promoted, is allocated at full_rows rows, the largest window its decode reaches, and keeps that size as
    it grows (a grown window replaces one of its own size, leaving no hole); streamed windows stay exact."""
    if buckets and head_share is not None:
      raise ValueError("window buckets need a cache without host attention")
    self.model, self.kv, self.layout = model, kv, layout
    self.buckets, self.full_rows = buckets, full_rows
    self.batch, self.capacity, self.block = batch, capacity, kv.block
    self.format = KVFormat.of(model, kv.dtype)
    meshes = [layout.mesh(l) for l in range(model.num_layers)]
    self.device_shardings = [mesh_lib.sharding(m, mesh_lib.CACHE_AXES, "device") for m in meshes]
    self.host_shardings = [mesh_lib.sharding(m, mesh_lib.CACHE_AXES, "pinned_host") for m in meshes]
    self.layer_bytes = self.row_bytes(mesh_lib.tensor_size(self.mesh)) * self.rows_bound()  # One window per device.
    # streamed[l]: window l in pinned host memory; groups: the decode groups; plan: auto's (else None).
    self.streamed, self.groups, self.plan = placement.streamed, placement.groups, placement.plan
    self.chunk_rows = placement.chunk_rows  # A delivery chunk's rows in decode (jaxkv.chunked; 0: whole windows).
    self.head_share = head_share
    self.windows: list[jax.Array | None] = [None] * model.num_layers
    self.heads: list[jax.Array | None] = [None] * model.num_layers  # Host-attended rows [0, r1).
    self.opens: list[jax.Array | None] = [None] * model.num_layers
    self.rows = 0  # W, the same for every layer.
    # The D2H copies of stored windows still in flight, a list per layer, oldest first (_copying).
    self._in_flight: collections.deque[list[jax.Array]] = collections.deque()

  @property
  def mesh(self) -> jax.sharding.Mesh:
    """Layer 0's mesh."""
    return self.layout.mesh(0)

  @property
  def device_sharding(self) -> jax.sharding.NamedSharding:
    return self.device_shardings[0]

  @property
  def host_sharding(self) -> jax.sharding.NamedSharding:
    return self.host_shardings[0]

  @property
  def dtype(self):
    return self.format.storage_dtype

  @property
  def row_width(self) -> int:
    """E."""
    return self.format.width

  def rows_bound(self) -> int:
    return rows_bound(self.capacity, self.block)

  def window_rows(self, rows: int, layer: int) -> int:
    """A, the rows allocated for layer's window of `rows` rows (module docstring; full_rows)."""
    if rows and self.full_rows and not self.streamed[layer]:
      return self.full_rows
    return window_rows(rows, self.block, self.capacity, self.buckets)

  def row_bytes(self, devices: int = 1) -> int:
    return row_bytes(self.model, self.kv.dtype, self.batch, devices)

  def host_bytes_per_process(self) -> int:
    return host_bytes_per_process(self.mesh, self.layer_bytes, sum(self.streamed))

  def layers_bytes_per_device(self, rows: int, streamed: bool = True) -> int:
    """Bytes that `rows` rows of every streamed layer (streamed=False: every resident one) take on the fullest
    device (its heads of the layers on it)."""
    per_device = collections.Counter()
    for l, s in enumerate(self.streamed):
      mesh = self.device_shardings[l].mesh
      for d in mesh.devices.flat if s == streamed else ():
        per_device[d] += self.row_bytes(mesh_lib.tensor_size(mesh)) * rows
    return max(per_device.values(), default=0)

  def clear(self) -> None:
    """Forgets every row: an empty cache (W = 0) with the same placement, for the next prompt."""
    n = self.model.num_layers
    self.windows, self.heads, self.opens, self.rows = [None] * n, [None] * n, [None] * n, 0

  def store_zeros(self, rows: int) -> None:
    """Stores zeros as rows [0, rows) of every layer's window: rows no prompt computes (left padding of a prompt
    prefilled alone, or a benchmark's synthetic context; decode reads and attends them like any rows)."""
    # Resident layers first: their windows lie side by side in device memory, so that the holes each one leaves when
    # it grows (a prefill chunk, a page) join its neighbours' (a streamed layer's zeros, moved to the host at once,
    # would sit between them and split the free memory into pieces each smaller than a grown window).
    for l in sorted(range(self.model.num_layers), key=lambda l: self.streamed[l]):
      self.store(l, self.device_zeros(l, rows))

  def store_empty_slots(self, rows: int) -> None:
    """A cache of `rows` rows (whole blocks) whose slots are then inserted one by one (insert_slot, jaxkv.serving):
    zeros as every slot's window (window_rows(rows) rows) and open page. With one slot the window is left for its
    insert to store whole."""
    if rows and self.batch > 1:
      for l in sorted(range(self.model.num_layers), key=lambda l: self.streamed[l]):  # As store_zeros.
        self.store(l, self.device_zeros(l, self.window_rows(rows, l)))
    shape = (2, self.batch, self.model.num_kv_heads, self.block, self.row_width)
    for l in range(self.model.num_layers):
      self.opens[l] = _zeros_fn(shape, self.dtype, self.device_shardings[l])()
    self.rows = rows

  def promote(self, layers: tuple[int, ...]) -> None:
    """Makes streamed layers resident (jaxkv.engine.Engine.place_for_decode, after a prefill; full_rows set): each
    one's window (pinned host: its head, with host attention, then its window, together rows [0, W)) moves into a
    zero buffer of full_rows rows on its devices, one delivery chunk at a time (a chunk's rows beside the buffer,
    not a second window); the cache changes only once every layer's has moved (a failed move, e.g. out of device
    memory, leaves every layer streamed). Their D2H copies must have landed (land_copies), and nothing may read or
    write the windows meanwhile."""
    moved = {}
    for l in layers:
      parts, sharding = [a for a in (self.heads[l], self.windows[l]) if a is not None], self.device_shardings[l]
      if not parts:
        moved[l] = None
        continue
      at = self.full_rows - sum(a.shape[3] for a in parts)
      buffer, _ = self._fill(l, self.device_zeros(l, self.full_rows), [(a, a.shape[3]) for a in parts], at, sharding)
      moved[l] = jax.block_until_ready(buffer)  # One layer's chunks on the devices at a time.
    for l, window in moved.items():
      self.windows[l], self.heads[l] = window, None
    self.streamed = tuple(s and l not in moved for l, s in enumerate(self.streamed))

  def store(self, layer: int, window_device: jax.Array | None) -> Issued:
    """Places layer `layer`'s window (a device array) in the cache's memory."""
    if window_device is None or not self.streamed[layer]:
      self.windows[layer] = window_device
      return Issued()
    r1 = self.split_row(window_device.shape[3])
    head, tail = split_rows(window_device, r1, self.device_shardings[layer]) if r1 else (None, window_device)
    self.heads[layer] = None if head is None else distributed.move(head, self.host_shardings[layer])
    self.windows[layer] = distributed.move(tail, self.host_shardings[layer])
    self._copying([self.windows[layer]] + ([self.heads[layer]] if r1 else []))
    return Issued(window_device.nbytes, 3 if r1 else 1)

  def store_group(self, layers: tuple[int, ...], windows_device: list[jax.Array]) -> Issued:
    """store() of several layers' windows (device arrays); without host attention the streamed ones move in one
    transfer call."""
    if self.head_share is not None:
      return sum((self.store(l, w) for l, w in zip(layers, windows_device)), Issued())
    moved = [i for i, l in enumerate(layers) if self.streamed[l]]
    for i, l in enumerate(layers):
      self.windows[l] = windows_device[i]
    if not moved:
      return Issued()
    hosts = distributed.move_many([windows_device[i] for i in moved], [self.host_shardings[layers[i]] for i in moved])
    for i, w in zip(moved, hosts):
      self.windows[layers[i]] = w
      self._copying([w])
    return Issued(sum(windows_device[i].nbytes for i in moved), 1)

  def _copying(self, copies: list[jax.Array]) -> None:
    """Records one layer's D2H copies, just issued, and waits for the oldest layers' while more layers than the
    largest decode group's are in flight: until a copy lands, the device window it reads stays allocated, and a loop
    that stores layer after layer faster than the link drains (a prefill's last chunk, a synthetic fill) would
    otherwise hold every layer's window on the devices at once, past the workspace (two groups' windows: one being
    made, one copied) that residency.place counts. A window larger than a delivery chunk lands before this returns:
    where windows are chunked the workspace counts one window, the one being made (residency.workspace_bytes)."""
    self._in_flight.append(copies)
    chunked = self.chunk_rows and copies[0].shape[3] > self.chunk_rows
    while len(self._in_flight) > (0 if chunked else max(map(len, self.groups))):
      # A copy donated since (a slot inserted in place: insert_slot) has landed.
      jax.block_until_ready([a for a in self._in_flight.popleft() if not a.is_deleted()])

  def land_copies(self) -> None:
    """Waits for every stored window's D2H copy still in flight (_copying): their device windows are then freed."""
    while self._in_flight:
      jax.block_until_ready([a for a in self._in_flight.popleft() if not a.is_deleted()])

  def device_zeros(self, layer: int, rows: int) -> jax.Array:
    """Zeros [2, B, K, rows, E] on the layer's devices, in its device sharding."""
    shape = (2, self.batch, self.model.num_kv_heads, rows, self.row_width)
    return _zeros_fn(shape, self.dtype, self.device_shardings[layer])()

  def split_row(self, rows: int) -> int:
    """r1 for a window of `rows` rows: floor(f rows / P) P, f = head_share of its bytes per device (0 without host
    attention)."""
    if self.head_share is None:
      return 0
    f = self.head_share(self.row_bytes(mesh_lib.tensor_size(self.mesh)) * rows)
    return int(f * rows) // self.block * self.block

  def head_rows(self, layer: int) -> int:
    return 0 if self.heads[layer] is None else self.heads[layer].shape[3]

  def full_window(self, layer: int, tail: jax.Array | None) -> jax.Array | None:
    """Layer's whole window [0, W) on the devices, given its tail (delivered) on the devices: the head is moved
    back and prepended (host attention; otherwise the tail is the whole window). Two calls where there is a head."""
    if self.heads[layer] is None:
      return tail
    head = distributed.move(self.heads[layer], self.device_shardings[layer])
    return _grow_fn(self.device_shardings[layer])(head, tail)

  def host_zeros(self, layer: int, rows: int) -> jax.Array:
    """Zeros [2, B, K, rows, E] in the layer's pinned host memory, each shard made on the host (no device buffer)."""
    shape, sharding = (2, self.batch, self.model.num_kv_heads, rows, self.row_width), self.host_shardings[layer]
    return jax.make_array_from_callback(shape, sharding, lambda _: np.zeros(sharding.shard_shape(shape), self.dtype))

  def store_split_tail(self, layer: int, tail: jax.Array, joined: int) -> Issued:
    """Stores a split layer's grown tail [2, B, K, W' - r1', E] (devices) whose split row moved from r1 to
    r1' = r1 + joined (joined >= 0, r1' <= W): rows [0, joined) of the old tail (pinned host) join the head first,
    which becomes a new pinned host array filled a delivery chunk at a time through the devices (chunks of the
    head's and those rows: at most a chunk on the devices beside the tail, never the whole window)."""
    issued = Issued()
    if joined:
      r1, host = self.head_rows(layer), self.host_shardings[layer]
      pieces = [(self.heads[layer], r1), (self.windows[layer], joined)] if r1 else [(self.windows[layer], joined)]
      self.heads[layer], chunks = self._fill(layer, self.host_zeros(layer, r1 + joined), pieces, 0, host)
      issued = Issued((r1 + joined) * self.row_bytes(), 2 * chunks)
    self.windows[layer] = distributed.move(tail, self.host_shardings[layer])
    self._copying([self.windows[layer]])
    return issued + Issued(tail.nbytes, 1)

  def _fill(
      self, layer: int, buffer: jax.Array, pieces: list[tuple[jax.Array, int]], at: int, sharding
  ) -> tuple[jax.Array, int]:
    """buffer [2, B, K, A, E] (donated, in `sharding`: the layer's device or pinned host memory) with the first
    `rows` rows of each (part, rows) of pieces (pinned host arrays [2, B, K, R, E]) written one after another from
    row `at`, a delivery chunk at a time through the devices (a chunk on them at a time, not the whole window).
    The last chunk of a piece ends at its last row, overlapping the one before where the rows are not a whole
    number of chunks: every chunk of a piece has one size, so a head that grows by a page at a time (decode) compiles
    no new copy. Returns it and the chunks moved."""
    device, chunks = self.device_shardings[layer], 0
    for part, rows in pieces:
      step = min(self.chunk_rows or rows, rows)
      for first in range(0, rows, max(step, 1)):
        first = min(first, rows - step)
        chunk = rows_to_device(part, first, step, device)
        buffer, chunks = write_rows(buffer, chunk, at + first, sharding), chunks + 1
      at += rows
    return buffer, chunks

  def store_tail(self, layer: int, tail: jax.Array) -> Issued:
    """Stores a grown tail [2, B, K, W - r1, E] (device) of a split layer: alone while the split row stays r1, else
    re-split with the head (moved back for it, once per move of the split row)."""
    r1 = self.head_rows(layer)
    if self.split_row(r1 + tail.shape[3]) == r1:
      self.windows[layer] = distributed.move(tail, self.host_shardings[layer])
      self._copying([self.windows[layer]])
      return Issued(tail.nbytes, 1)
    return Issued(0, 2) + self.store(layer, self.full_window(layer, tail))

  def insert_slot(self, layer: int, slot: int, window: jax.Array | None, open_page: jax.Array) -> Issued:
    """Replaces slot `slot` of layer `layer`: its window (window [2, 1, K, A, E] on the devices, A = window_rows(W),
    None while W = 0) and its open page [2, 1, K, P, E], each by one donated `dynamic_update_slice` where it lives
    (in place in pinned host memory for a streamed layer; a split layer's rows [0, r1) into its head). Nothing may
    read or write the layer's arrays meanwhile (jaxkv.engine.Generation.drop_pending); the other slots are not
    touched. Returns what it issued (the window's bytes copied to host memory, the calls)."""
    issued = Issued(calls=1)  # The open page's.
    if window is not None and self.windows[layer] is None:  # One slot and no rows yet: the whole window.
      issued += self.store(layer, window)
    elif window is not None:
      r1 = self.head_rows(layer)
      if r1:
        nbytes = window.nbytes
        host_rows, window = split_rows(window, r1, self.device_shardings[layer])
        self.heads[layer] = _insert_fn(self.host_shardings[layer])(self.heads[layer], host_rows, slot)
        issued += Issued(nbytes - window.nbytes, 2)
      where = self.host_shardings[layer] if self.streamed[layer] else self.device_shardings[layer]
      self.windows[layer] = _insert_fn(where)(self.windows[layer], window, slot)
      issued += Issued(window.nbytes if self.streamed[layer] else 0, 1)
    self.opens[layer] = _insert_fn(self.device_shardings[layer])(self.opens[layer], open_page, slot)
    return issued
