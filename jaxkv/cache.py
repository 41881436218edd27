"""The KV cache: its layout, its placement, and the pure functions that grow it.

KVCache is data: it is given its placement (jaxkv.residency.Placement: which windows are streamed, the decode groups,
auto's plan), which jaxkv.residency.place plans from free device memory and checks against host memory with this
module's host memory functions (the end of the file) before the cache is made.

Layout, per layer l (B = batch, K = kv heads, P = kv block rows, E = stored values per head row):

  window[l]: [2, B, K, W, E]  rows [0, W) of K (index 0) and V (index 1), W = n * P (None while W = 0).
             Lives in the placement's memory: "device" or "pinned_host" (with "auto", per layer:
             jaxkv.residency). Sharded on K over the `tensor`
             mesh axis, so each device's shard (host or device) holds only that device's heads.
  open[l]:   [2, B, K, P, E]  rows [W, W + P), the block being written; always in device memory.
  start:     i32[B]  first valid row of each sequence (prompts are right-aligned: left padding).
  end:       the next row to write, the same for every sequence.

E and the dtype follow kv.dtype (jaxkv.kv_quant.KVFormat): E = head_dim values of a float dtype, or for int8, int4
and float8_e4m3fn the quantized values' bytes followed by their float16 scales, all in one uint8 array, so that a
layer's window is still ONE array (one transfer). Zero bytes decode to zeros in every format.

With kv.host_attention (placement "host" or "auto"), a streamed layer's window of W rows is stored as two pinned_host
arrays split at r1 = split_row(W) = floor(f W / P) P, f = head_split.share of the window's bytes (set by
jaxkv.host_decode: the measured model or the override, jaxkv.host_split): head[l] [2, B, K, r1, E] rows [0, r1),
attended on the host CPU during decode (jaxkv.host_attention), and window[l] [2, B, K, W - r1, E] rows [r1, W) (the
tail), the only rows delivered.
head[l] is None while r1 = 0, and always for resident layers.

Row r of sequence b is valid when start[b] <= r < end. A decode step writes row `end` into the open page
(on device); when the open page is full, `grow` appends it to the window, which is stored back in its
placement in one explicit transfer. Host and device placement hold the same arrays in different memories,
so every delivery mode feeds the same compiled layer function the same values.
"""

from __future__ import annotations

import collections
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import distributed
from jaxkv import host_attention
from jaxkv import host_split
from jaxkv import mesh as mesh_lib
from jaxkv.config import KVConfig, ModelConfig
from jaxkv.kv_quant import KVFormat

DEFAULT_GPU_PINNED_POOL_GB = 64
POOL_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"


def grow(window, rows):
  """window [2, B, K, W, E] or None; rows [2, B, K, N, E] -> [2, B, K, W + N, E]."""
  return rows if window is None else jnp.concatenate([window, rows], axis=3)


def split_prefilled(window, chunk, *, w_rows: int, block: int):
  """After the last prefill chunk: rows [0, w_rows) become the window, [w_rows, w_rows + block) the open page.

  window [2, B, K, W0, E] or None; chunk [2, B, K, C, E] rows [W0, W0 + C), W0 <= w_rows <= W0 + C. Rows past the
  chunk are zeros (zero bytes decode to 0). The window is made from its two parts, never from a copy of all
  W0 + C rows: beside the old window the split holds one more (the workspace the residency planner counts).
  """
  w0 = 0 if window is None else window.shape[3]
  n = w_rows - w0  # The chunk's rows that join the window.
  head = grow(window, chunk[:, :, :, :n]) if n else window
  page = chunk[:, :, :, n : n + block]
  if page.shape[3] < block:
    page = jnp.pad(page, ((0, 0),) * 3 + ((0, block - page.shape[3]), (0, 0)))
  return head, page


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


@functools.lru_cache(maxsize=None)
def _grow_fn(sharding: jax.sharding.Sharding):
  return jax.jit(grow, out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _zeros_fn(shape: tuple[int, ...], dtype, sharding: jax.sharding.Sharding):
  return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


class KVCache:
  """Holds the per-layer windows and open pages; see the module docstring for the layout."""

  def __init__(
      self,
      model: ModelConfig,
      kv: KVConfig,
      mesh: jax.sharding.Mesh,
      batch: int,
      capacity: int,
      layout=None,
      *,
      placement,
  ):
    """layout (jaxkv.layout.Layout): the mesh of each layer (split mode layer); default `mesh` for every layer.
    placement (jaxkv.residency.Placement, from residency.place with the same arguments): where each window lives,
    the decode groups and the auto plan."""
    meshes = [mesh if layout is None else layout.mesh(l) for l in range(model.num_layers)]
    self.model, self.kv, self.mesh, self.layout = model, kv, meshes[0], layout
    self.batch, self.capacity, self.block = batch, capacity, kv.block
    self.format = KVFormat.of(model, kv.dtype)
    self.dtype = self.format.storage_dtype
    self.row_width = self.format.width  # E.
    self.device_shardings = [mesh_lib.sharding(m, mesh_lib.CACHE_AXES, "device") for m in meshes]
    self.host_shardings = [mesh_lib.sharding(m, mesh_lib.CACHE_AXES, "pinned_host") for m in meshes]
    self.device_sharding, self.host_sharding = self.device_shardings[0], self.host_shardings[0]  # Layer 0's.
    self.layer_bytes = self.row_bytes(mesh_lib.tensor_size(self.mesh)) * self.rows_bound()  # One window per device.
    # streamed[l]: window l in pinned host memory; groups: the decode groups; plan: auto's (else None).
    self.streamed, self.groups, self.plan = placement.streamed, placement.groups, placement.plan
    # With host attention: how each streamed window's rows are split into its head and tail (split_row); set by
    # jaxkv.host_decode before anything is stored.
    self.head_split: host_split.Split | None = None
    # Jitted calls and transfers the host has issued for this cache (the engine's, the transport's deliveries and
    # the stores below), read and reset by jaxkv.transport.Transport.take_counters.
    self.dispatches = 0
    self.windows: list[jax.Array | None] = [None] * model.num_layers
    self.heads: list[jax.Array | None] = [None] * model.num_layers  # Host-attended rows [0, r1); set with set_head.
    self._head_views: list[list | None] = [None] * model.num_layers  # host_attention.kernel_views of heads[l].
    self.opens: list[jax.Array | None] = [None] * model.num_layers
    self.rows = 0  # W, the same for every layer.
    # The D2H copies of stored windows still in flight, a list per layer, oldest first (_copying).
    self._in_flight: collections.deque[list[jax.Array]] = collections.deque()
    self.prefill_summary: dict = {}  # The last prefill's attention and plan (jaxkv.engine.prefill_plan).

  def rows_bound(self) -> int:
    return rows_bound(self.capacity, self.block)

  def row_bytes(self, devices: int = 1) -> int:
    return row_bytes(self.model, self.kv.dtype, self.batch, devices)

  def host_bytes_per_process(self) -> int:
    return host_bytes_per_process(self.mesh, self.layer_bytes, sum(self.streamed))

  def streamed_bytes_per_device(self, rows: int) -> int:
    """Bytes that `rows` rows of every streamed layer take on the fullest device (its heads of the layers on it)."""
    per_device = collections.Counter()
    for l, streamed in enumerate(self.streamed):
      mesh = self.device_shardings[l].mesh
      for d in mesh.devices.flat if streamed else ():
        per_device[d] += self.row_bytes(mesh_lib.tensor_size(mesh)) * rows
    return max(per_device.values(), default=0)

  def store_zeros(self, rows: int) -> None:
    """Stores zeros as rows [0, rows) of every layer's window: rows no prompt computes (left padding of a prompt
    prefilled alone, or a benchmark's synthetic context; decode reads and attends them like any rows)."""
    shape = (2, self.batch, self.model.num_kv_heads, rows, self.row_width)
    # Resident layers first: their windows lie side by side in device memory, so that the holes each one leaves when
    # it grows (a prefill chunk, a page) join its neighbours' (a streamed layer's zeros, moved to the host at once,
    # would sit between them and split the free memory into pieces each smaller than a grown window).
    for l in sorted(range(self.model.num_layers), key=lambda l: self.streamed[l]):
      self.store(l, _zeros_fn(shape, self.dtype, self.device_shardings[l])())

  def store_zero_opens(self) -> None:
    """Zeros as every layer's open page (a cache whose slots are then filled one by one: jaxkv.serving)."""
    shape = (2, self.batch, self.model.num_kv_heads, self.block, self.row_width)
    for l in range(self.model.num_layers):
      self.opens[l] = _zeros_fn(shape, self.dtype, self.device_shardings[l])()

  def store(self, layer: int, window_device: jax.Array | None) -> int:
    """Places layer `layer`'s window (a device array) in the cache's memory. Returns bytes moved D2H."""
    if window_device is None or not self.streamed[layer]:
      self.windows[layer] = window_device
      return 0
    r1 = self.split_row(window_device.shape[3])
    head, tail = split_rows(window_device, r1, self.device_shardings[layer]) if r1 else (None, window_device)
    self.set_head(layer, None if head is None else distributed.move(head, self.host_shardings[layer]))
    self.windows[layer] = distributed.move(tail, self.host_shardings[layer])
    self.dispatches += 3 if r1 else 1
    self._copying([self.windows[layer]] + ([self.heads[layer]] if r1 else []))
    return window_device.nbytes

  def store_group(self, layers: tuple[int, ...], windows_device: list[jax.Array]) -> int:
    """store() of several layers' windows (device arrays); without host attention the streamed ones move in one
    transfer call. Returns bytes moved D2H."""
    if self.head_split is not None:
      return sum(self.store(l, w) for l, w in zip(layers, windows_device))
    moved = [i for i, l in enumerate(layers) if self.streamed[l]]
    for i, l in enumerate(layers):
      self.windows[l] = windows_device[i]
    if not moved:
      return 0
    hosts = distributed.move_many([windows_device[i] for i in moved], [self.host_shardings[layers[i]] for i in moved])
    for i, w in zip(moved, hosts):
      self.windows[layers[i]] = w
      self._copying([w])
    self.dispatches += 1
    return sum(windows_device[i].nbytes for i in moved)

  def _copying(self, copies: list[jax.Array]) -> None:
    """Records one layer's D2H copies, just issued, and waits for the oldest layers' while more layers than the
    largest decode group's are in flight: until a copy lands, the device window it reads stays allocated, and a loop
    that stores layer after layer faster than the link drains (a prefill's last chunk, a synthetic fill) would
    otherwise hold every layer's window on the devices at once, past the workspace (two groups' windows: one being
    made, one copied) that residency.place counts."""
    self._in_flight.append(copies)
    while len(self._in_flight) > max(map(len, self.groups)):
      # A copy donated since (a slot inserted in place: jaxkv.serving) has landed.
      jax.block_until_ready([a for a in self._in_flight.popleft() if not a.is_deleted()])

  def split_row(self, rows: int) -> int:
    """r1 for a window of `rows` rows: floor(f rows / P) P, f = head_split.share of its bytes per device (0 with
    host attention off)."""
    if self.head_split is None:
      return 0
    f = self.head_split.share(self.row_bytes(mesh_lib.tensor_size(self.mesh)) * rows)
    return int(f * rows) // self.block * self.block

  def set_head(self, layer: int, head: jax.Array | None) -> None:
    """Replaces layer's head rows [0, r1) (pinned host) and drops the kernel's views of the old ones."""
    self._head_views[layer] = None
    self.heads[layer] = head

  def head_views(self, layer: int) -> list:
    """The host kernel's zero-copy views of layer's head (host_attention.kernel_views), made once per head: the
    engine reads them every decode step, and making them (JAX calls per shard) with the kernel's checks cost the
    worker 0.08-0.09 ms a layer on the H200 host."""
    if self._head_views[layer] is None:
      self._head_views[layer] = host_attention.kernel_views(self.heads[layer], self.format)
    return self._head_views[layer]

  def head_rows(self, layer: int) -> int:
    return 0 if self.heads[layer] is None else self.heads[layer].shape[3]

  def full_window(self, layer: int, tail: jax.Array | None) -> jax.Array | None:
    """Layer's whole window [0, W) on the devices, given its tail (delivered) on the devices: the head is moved
    back and prepended (host attention; otherwise the tail is the whole window)."""
    if self.heads[layer] is None:
      return tail
    head = distributed.move(self.heads[layer], self.device_shardings[layer])
    self.dispatches += 2
    return _grow_fn(self.device_shardings[layer])(head, tail)

  def store_tail(self, layer: int, tail: jax.Array) -> int:
    """Stores a grown tail [2, B, K, W - r1, E] (device) of a split layer: alone while the split row stays r1, else
    re-split with the head (moved back for it, once per move of the split row). Returns bytes moved D2H."""
    r1 = self.head_rows(layer)
    if self.split_row(r1 + tail.shape[3]) == r1:
      self.windows[layer] = distributed.move(tail, self.host_shardings[layer])
      self.dispatches += 1
      self._copying([self.windows[layer]])
      return tail.nbytes
    return self.store(layer, self.full_window(layer, tail))


def pinned_pool_limit_bytes() -> int | None:
  """The pinned host pool cap of this process's backend, or None where there is none (CPU)."""
  env = os.environ.get(POOL_ENV)
  if env:
    return int(float(env) * 2**30)
  if jax.default_backend() == "gpu":
    return DEFAULT_GPU_PINNED_POOL_GB * 2**30
  return None


# The largest host cache this process has placed, bytes: on the GPU the pinned pool keeps the memory it grew to
# (a BFC allocator), so that MemAvailable no longer counts what the next cache of that size will reuse.
_POOL_HELD = [0]


def host_ram_for_cache() -> int | None:
  """Host bytes a new host cache may take: available_host_bytes() plus what the pinned pool may already hold."""
  available = available_host_bytes()
  return None if available is None else available + _POOL_HELD[0]


def available_host_bytes() -> int | None:
  """The host RAM available to a new allocation: MemAvailable of /proc/meminfo (Linux), else the free physical pages
  (os.sysconf), else None (unknown)."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024  # kB.
  except OSError:
    pass
  try:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (ValueError, OSError, AttributeError):
    return None


def reserve_host_memory(needed: int, layers: int, model: ModelConfig, fmt: KVFormat, batch: int, rows: int) -> None:
  """check_host_memory against host_ram_for_cache(), then counts `needed` as held by the pinned pool."""
  check_host_memory(needed, layers, model, fmt, batch, rows, host_ram_for_cache())
  _POOL_HELD[0] = max(_POOL_HELD[0], needed)


def check_host_memory(
    needed: int, layers: int, model: ModelConfig, fmt: KVFormat, batch: int, rows: int, available: int | None
) -> None:
  """Raises a one-line ValueError, before anything is allocated, when the host KV cache (`needed` bytes in this
  process, `layers` streamed layers) exceeds the host RAM `available` (None = unknown: not checked) or the pinned
  pool's cap."""
  gib = needed / 2**30
  what = (
      f"the host KV cache needs {gib:.2f} GiB of pinned host memory in this process "
      f"({layers} streamed layers x 2 x batch {batch} x {model.num_kv_heads} kv heads x {rows} rows x "
      f"{fmt.row_bytes} B per head row ({fmt.name}), plus one layer in flight)"
  )
  if available is not None and needed > available:
    raise ValueError(
        f"{what}, but this host has {available / 2**30:.2f} GiB of RAM available for it (MemAvailable, plus what "
        "the pinned pool already holds). Lower the batch "
        "or the capacity (--capacity, engine.capacity), store the KV in int8 or int4 (--kv_dtype=int8, int4), or "
        "keep more layers on the devices (--kv_placement=auto)."
    )
  limit = pinned_pool_limit_bytes()
  if limit is not None and needed > limit:
    raise ValueError(
        f"{what}, but the pinned pool is limited to {limit / 2**30:.2f} GiB. Raise it before starting, e.g. "
        f"{POOL_ENV}={int(np.ceil(gib)) + 1}, or lower the batch or the capacity (--capacity, engine.capacity)."
    )
