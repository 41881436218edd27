"""Decode attention whose bits do not depend on the batch: end-anchored leaves folded by a fixed tree.

A decode step attends each sequence's rows [start_b, end] (jaxkv.cache), `end` being the row the step writes, the
same for the whole batch. The rows are cut into leaves of S = LEAF_ROWS rows counted back from `end`:

  leaf j = rows (end - (j + 1) S, end - j S],  j = 0, 1, 2, ...

A sequence's rows relative to its newest row are the same alone or in any batch (prompts are right-aligned), so its
leaf j holds the same rows of it whatever the batch's window length W and wherever its rows sit in the arrays. Each
leaf's partial is computed over exactly its S rows, by a computation whose shape depends on nothing else; rows before
start_b or outside the given buffers are masked, and a leaf with no row is the identity I = (-inf, 0, 0). The leaves
are folded by a pairwise tree in the order j = 0, 1, 2, ..., padded with identities to a power of two; x (+) I == x
bit for bit, so the identities past a sequence's oldest leaf (a longer batch window, more leaves) leave its bits as
they are. Only S (and for the kernel its tile and launch constants) enters the bits: the same for every model,
placement, batch and KV dtype.

Partials of n leaves (leaf axis first; B batch, K kv heads, G = H / K query heads per kv head, Dh head_dim):
  m f32[n, B, K, G]      the max of the leaf's masked scaled scores (-inf: no row)
  l f32[n, B, K, G]      sum over the leaf's rows of exp(s - m)
  o f32[n, B, K, G, Dh]  sum over the leaf's rows of exp(s - m) v (unnormalized)
Scores and softmax in f32; the weights meet V in its dtype, accumulated in f32 (as jaxkv.model.partial_attention).

Two implementations of the leaf partials, the same leaves and fold: "xla" (plain XLA: the rows of the leaves
gathered, [.., n, S, Dh], then one reduction per leaf: the reference, the CPU path) and "pallas" (a Pallas Triton
kernel on a CUDA GPU, one program per (sequence, kv head, leaf) reading its tiles of TILE_ROWS rows from the buffers
in place, in a fixed order, with fixed block sizes and no autotuning). `resolve` picks one per device.

The attention takes values [2, B, K, R, Dh] (unpacked), except that the kernel reads int8 rows packed
(KERNEL_UNPACKS: u8[2, B, K, R, Dh + Dh / 16], jaxkv.kv_quant) and unpacks each tile as kv_quant.unpack_int8 does,
to the same values, so with the same bits: at 1M rows a layer's window is read once, not read, written unpacked
(twice its bytes) and read again. `attention_rows` gives a caller the rows to pass, once per layer call.

Chunked delivery (jaxkv.chunked) reuses the pieces: a chunk of rows computes the leaves whose newest row it holds
(`leaf_partials` with first_leaf, traced, and num_leaves; the chunk's buffer starts a leaf before its rows, so each
such leaf lies wholly in it), the newest chunk with the open page computes the newest leaves, and `placed` puts every
chunk's partials at their leaves on the leaf axis, which is folded once (`fold`): the leaves and the fold of the
unchunked window, hence its bits.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxkv import kv_quant
from jaxkv import mesh as mesh_lib
from jaxkv.config import DECODE_ATTENTIONS, ModelConfig
from jaxkv.kv_quant import KVFormat

LEAF_ROWS = 256  # S: rows per leaf. The bits of every decode attention depend on it; change it and they change.
TILE_ROWS = 128  # The kernel's rows per tile (divides LEAF_ROWS); its bits depend on it.
NUM_WARPS, NUM_STAGES = 4, 2  # The kernel's launch: fixed, never autotuned.
MIN_QUERY_ROWS = 16  # The kernel's query block: G rows padded up to a power of two of at least this (pl.dot).
KERNEL_DTYPES = ("bfloat16", "float16", "float32")
KERNEL_UNPACKS = ("int8",)  # Stored formats the kernel reads packed, unpacking each tile (reads_packed).
PALLAS_CHECK_TOLERANCE = 1e-2  # Relative error (Frobenius) of the kernel's attention against the XLA leaves.


class Partials(NamedTuple):
  """Softmax partials: m f32[n, ...], l f32[n, ...], o f32[n, ..., Dh] (module docstring); `fold` drops the
  leaf axis."""

  m: jax.Array
  l: jax.Array
  o: jax.Array


def leaf_count(rows: int, leaf_rows: int = LEAF_ROWS) -> int:
  """Leaves that cover `rows` buffer rows that end at row `end`: ceil(rows / S)."""
  return max(1, -(-rows // leaf_rows))


def leaf_rows_of(first_row, end, first_leaf: int, num_leaves: int, leaf_rows: int = LEAF_ROWS) -> jax.Array:
  """i32[n, S]: the absolute rows of leaves first_leaf .. first_leaf + n - 1, oldest row of each first; minus
  first_row (i32[]), so that 0 is the buffers' first row."""
  j = first_leaf + jnp.arange(num_leaves, dtype=jnp.int32)
  return end + 1 - (j[:, None] + 1) * leaf_rows + jnp.arange(leaf_rows, dtype=jnp.int32)[None, :] - first_row


def merge(x: Partials, y: Partials) -> Partials:
  """x (+) y, elementwise over any leading shape: the partials of the union of their rows. The side with the larger
  max keeps its sums and the other's are added scaled by w = exp(m_small - m_big) <= 1: one product per sum, so a
  compiler that fuses multiplies into adds (FMA) treats every merge alike. Exact on identities: x (+) I == x and
  I (+) x == x bit for bit (w = exp(-inf) = 0), and I (+) I == I with no NaN (an all -inf max is shifted to 0)."""
  x_big = x.m >= y.m
  pick = lambda a, b, big: jnp.where(big.reshape(big.shape + (1,) * (a.ndim - big.ndim)), a, b)
  big = Partials(*(pick(a, b, x_big) for a, b in zip(x, y)))
  small = Partials(*(pick(b, a, x_big) for a, b in zip(x, y)))
  w = jnp.exp(small.m - jnp.where(big.m == -jnp.inf, 0.0, big.m))
  return Partials(big.m, big.l + w * small.l, big.o + w[..., None] * small.o)


def fold(p: Partials) -> Partials:
  """Partials of n leaves (leaf 0 first) -> the partials of all their rows (no leaf axis): a pairwise tree over the
  leaves padded with identities to a power of two, level by level p[0::2] (+) p[1::2]. A level's last leaf without
  a partner meets an identity, which leaves it as it is (x (+) I == x), so it is passed on unmerged and no identity
  is made. Leaves past the last non-identity one do not change the bits (module docstring)."""
  while p.m.shape[0] > 1:
    pairs = p.m.shape[0] // 2
    merged = merge(Partials(*(a[0 : 2 * pairs : 2] for a in p)), Partials(*(a[1 : 2 * pairs : 2] for a in p)))
    p = merged if p.m.shape[0] % 2 == 0 else Partials(*(jnp.concatenate([x, a[-1:]]) for x, a in zip(merged, p)))
  return Partials(*(a[0] for a in p))


def placed(num_leaves: int, pieces: Sequence[tuple[Partials, jax.Array | int]]) -> Partials:
  """The partials of leaves 0 .. num_leaves - 1 from pieces (partials of n_i leaves, their first leaf j_i, i32[] or
  int), each written over those before it (dynamic_update_slice on the leaf axis) into identities: where pieces
  overlap, the later one's leaves stand; leaves no piece covers are identities (I = (-inf, 0, 0), as a leaf with
  no row computes it)."""
  m0 = pieces[0][0].m
  out = Partials(
      jnp.full((num_leaves, *m0.shape[1:]), -jnp.inf, jnp.float32),
      jnp.zeros((num_leaves, *m0.shape[1:]), jnp.float32),
      jnp.zeros((num_leaves, *pieces[0][0].o.shape[1:]), jnp.float32),
  )
  for p, first in pieces:
    out = Partials(*(jax.lax.dynamic_update_slice_in_dim(a, b, first, axis=0) for a, b in zip(out, p)))
  return out


def normalized(p: Partials) -> tuple[jax.Array, jax.Array]:
  """Folded partials -> o f32[..., Dh] = O / L and lse f32[...] = m + log L (L > 0: some row attended)."""
  return p.o / p.l[..., None], p.m + jnp.log(p.l)


def reads_packed(impl: str, fmt: KVFormat | None) -> bool:
  """Whether the attention `impl` takes rows stored in `fmt` packed: the kernel ("pallas") reads KERNEL_UNPACKS
  formats packed and unpacks each tile; every other impl and format takes values (fmt.unpack)."""
  return impl == "pallas" and fmt is not None and fmt.name in KERNEL_UNPACKS


def attention_rows(impl: str, fmt: KVFormat, stored: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
  """The rows that leaf_partials and attend (impl, kv_format=fmt) take for rows stored in fmt [2, B, K, R_i, E]:
  those as stored where the kernel reads them packed (reads_packed), else their values [2, B, K, R_i, Dh]. A caller
  that attends several times (a verify pass's tokens) calls it once, before its loop: rows unpacked once."""
  return tuple(stored) if reads_packed(impl, fmt) else tuple(fmt.unpack(p) for p in stored)


def leaf_partials(
    q,
    parts: Sequence[jax.Array],
    first_row,
    start,
    end,
    num_leaves: int,
    *,
    first_leaf: int = 0,
    impl: str = "xla",
    mesh: jax.sharding.Mesh | None = None,
    leaf_rows: int = LEAF_ROWS,
    interpret: bool = False,
    kv_format: KVFormat | None = None,
) -> Partials:
  """The partials of leaves first_leaf .. first_leaf + num_leaves - 1 (module docstring).

  q [B, K, G, Dh] in the values' dtype; parts: buffers [2, B, K, R_i, E] of consecutive rows, the first starting at
  absolute row first_row (i32[]): as attention_rows(impl, kv_format, ...) gives them, packed (E = kv_format.width,
  uint8) where reads_packed(impl, kv_format), else values (E = Dh; kv_format None: values); start i32[B]; end i32[]
  (the newest row). Rows outside the buffers or before start[b] are masked. impl "xla" or "pallas" (at most two
  parts: a window and the open page of P rows, `end` in the page, which is read for the first ceil(P / S) leaves
  only); mesh: the devices the arrays are sharded over by kv head (the kernel runs per shard under shard_map; None:
  unsharded); interpret: run the kernel in Pallas's interpreter (CPU tests).
  """
  packed = reads_packed(impl, kv_format)
  width = kv_format.width if packed else q.shape[-1]
  if any(p.shape[-1] != width for p in parts):
    form = f"{kv_format.name} packed" if packed else "values"
    raise ValueError(f"leaf partials ({impl}): rows must be {form}, [..., {width}], got {[p.shape for p in parts]}")
  if impl == "xla":
    return _xla_leaf_partials(q, parts, first_row, start, end, num_leaves, first_leaf, leaf_rows)
  if impl != "pallas":
    raise ValueError(f"leaf partials: impl must be xla or pallas, got {impl!r}")
  call = functools.partial(
      _pallas_leaf_partials,
      num_leaves=num_leaves,
      first_leaf=first_leaf,
      leaf_rows=leaf_rows,
      interpret=interpret,
      unpack=kv_format.name if packed else None,
  )
  bounds = jnp.stack([jnp.asarray(end, jnp.int32), jnp.asarray(first_row, jnp.int32)])
  if mesh is None:
    return call(q, tuple(parts), start, bounds)
  heads = mesh_lib.spec(mesh_lib.BATCH, mesh_lib.KV_HEADS, None, mesh_lib.HEAD_DIM)
  stats = mesh_lib.spec(None, mesh_lib.BATCH, mesh_lib.KV_HEADS, None)
  out = Partials(stats, stats, mesh_lib.spec(None, mesh_lib.BATCH, mesh_lib.KV_HEADS, None, mesh_lib.HEAD_DIM))
  rows = mesh_lib.spec(*mesh_lib.CACHE_AXES)
  return jax.shard_map(
      call,
      mesh=mesh,
      in_specs=(heads, (rows,) * len(parts), mesh_lib.P(), mesh_lib.P()),
      out_specs=out,
      check_vma=False,
  )(q, tuple(parts), start, bounds)


def attend(
    q,
    parts: Sequence[jax.Array],
    first_row,
    start,
    end,
    *,
    impl: str = "xla",
    mesh: jax.sharding.Mesh | None = None,
    leaf_rows: int = LEAF_ROWS,
    interpret: bool = False,
    kv_format: KVFormat | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Attention over every row of the buffers (leaf_partials' arguments; `end` in the last buffer) -> o f32[B, K, G,
  Dh], normalized, and lse f32[B, K, G]: the leaves that cover the buffers, folded."""
  n = leaf_count(sum(p.shape[3] for p in parts), leaf_rows)
  kw = dict(impl=impl, mesh=mesh, leaf_rows=leaf_rows, interpret=interpret, kv_format=kv_format)
  return normalized(fold(leaf_partials(q, parts, first_row, start, end, n, **kw)))


def _xla_leaf_partials(q, parts, first_row, start, end, num_leaves, first_leaf, leaf_rows) -> Partials:
  """leaf_partials in plain XLA: the leaves' rows gathered into [2, B, K, n, S, Dh] (rows outside the buffers read
  as a clipped row and masked), then the scores, max, sum and V product of each leaf over its S rows."""
  kv = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=3)  # [2, B, K, R, Dh]
  _, b, k, r, dh = kv.shape
  at = leaf_rows_of(first_row, end, first_leaf, num_leaves, leaf_rows)  # [n, S], buffer positions.
  rows = jnp.take(kv, jnp.clip(at, 0, r - 1).reshape(-1), axis=3).reshape(2, b, k, num_leaves, leaf_rows, dh)
  valid = (at >= 0) & (at < r) & (at + first_row >= start[:, None, None])  # [B, n, S]
  s = jnp.einsum("bkgd,bknsd->nbkgs", q, rows[0], preferred_element_type=jnp.float32) * (1.0 / math.sqrt(dh))
  s = jnp.where(valid.transpose(1, 0, 2)[:, :, None, None, :], s, -jnp.inf)
  m = jnp.max(s, axis=-1)  # [n, B, K, G]
  e = jnp.exp(s - jnp.where(m == -jnp.inf, 0.0, m)[..., None])
  o = jnp.einsum("nbkgs,bknsd->nbkgd", e.astype(kv.dtype), rows[1], preferred_element_type=jnp.float32)
  return Partials(m, pairwise_sum(e), jnp.where((m == -jnp.inf)[..., None], 0.0, o))


def pairwise_sum(x):
  """x [..., S] -> its sum over the last axis in a fixed pairwise tree (padded with zeros to a power of two), level
  by level in elementwise adds: the same bits whatever the other axes' sizes. A reduce does not promise that: XLA's
  CPU backend vectorizes it by the whole shape, so a leaf's sum changed with the batch's size on a sharded mesh."""
  size = 1 << max(x.shape[-1] - 1, 0).bit_length()
  x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])
  while x.shape[-1] > 1:
    x = x[..., 0::2] + x[..., 1::2]
  return x[..., 0]


def _pallas_leaf_partials(q, parts, start, bounds, *, num_leaves, first_leaf, leaf_rows, interpret, unpack) -> Partials:
  """leaf_partials with the Pallas kernel (`_leaf_kernel`; unpack: the parts' packed format, KERNEL_UNPACKS, or None
  for values). bounds i32[2] = end, first_row (the kernel's bounds add first_leaf). The last buffer (the open page,
  P rows) holds rows of the first ceil(P / S) leaves only: those run with every buffer, each tile read from the
  buffers that hold its rows; the older leaves read the other buffers only (one load per tile: half the shared
  memory of a program, more programs per multiprocessor). Which leaf runs which way depends on j alone, so the bits
  stay those of the leaf. Without a window the page stands in for it (a second copy, whose rows lie past `end`). A
  traced first_leaf (a chunk's leaves, jaxkv.chunked: one buffer, which holds every row of its leaves) runs every
  leaf with every buffer."""
  if len(parts) == 1:
    parts = (parts[0], parts[0])
  run = functools.partial(_pallas_call, q, start, bounds, leaf_rows=leaf_rows, interpret=interpret, unpack=unpack)
  if not isinstance(first_leaf, int):
    return run(parts, first_leaf, num_leaves)
  near = min(first_leaf + num_leaves, -(-parts[-1].shape[3] // leaf_rows))  # Leaves [first_leaf, near) reach P.
  calls = []
  if near > first_leaf:
    calls.append(run(parts, first_leaf, near - first_leaf))
  if first_leaf + num_leaves > near:
    older = max(first_leaf, near)
    calls.append(run(parts[:-1], older, first_leaf + num_leaves - older))
  return calls[0] if len(calls) == 1 else Partials(*(jnp.concatenate(a) for a in zip(*calls)))


def _pallas_call(q, start, bounds, parts, first_leaf, num_leaves, *, leaf_rows, interpret, unpack) -> Partials:
  """The kernel over leaves first_leaf .. first_leaf + num_leaves - 1 (int or i32[]) of consecutive buffers `parts`
  (the first at row first_row): grid (B, K, n), one leaf of one (sequence, kv head) per program; unpack "int8":
  packed int8 rows, passed as byte pairs (`_byte_pairs`). Pallas's interpreter reads a dynamic slice that starts
  below 0 from row 0 (clamped), so there each buffer gets TILE_ROWS zero rows in front (`lead`); on the GPU the
  loads are masked in place."""
  b, k, g, dh = q.shape
  gp = max(MIN_QUERY_ROWS, pl.next_power_of_2(g))
  lead = TILE_ROWS if interpret else 0
  sizes = tuple(p.shape[3] for p in parts)
  if unpack == "int8":
    parts = tuple(map(_byte_pairs, parts))
  if lead:
    parts = tuple(jnp.pad(p, ((0, 0),) * 3 + ((lead, 0), (0, 0))) for p in parts)
  kernel = functools.partial(
      _leaf_kernel,
      sizes=sizes,
      lead=lead,
      leaf_rows=leaf_rows,
      scale=1.0 / math.sqrt(dh),
      precision=jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None,
      unpack=unpack,
  )
  rows_spec = lambda a, kv: pl.BlockSpec((None, None, None, *a.shape[3:]), lambda i, h, j, kv=kv: (kv, i, h, 0, 0))
  stat_spec = pl.BlockSpec((None, None, None, gp), lambda i, h, j: (j, i, h, 0))
  m, l, o = pl.pallas_call(
      kernel,
      grid=(b, k, num_leaves),
      in_specs=[
          pl.BlockSpec((None,), lambda i, h, j: (i,)),
          pl.BlockSpec((3,), lambda i, h, j: (0,)),
          pl.BlockSpec((None, None, gp, dh), lambda i, h, j: (i, h, 0, 0)),
      ]
      + [rows_spec(a, kv) for a in parts for kv in (0, 1)],
      out_specs=[stat_spec, stat_spec, pl.BlockSpec((None, None, None, gp, dh), lambda i, h, j: (j, i, h, 0, 0))],
      out_shape=[
          jax.ShapeDtypeStruct((num_leaves, b, k, gp), jnp.float32),
          jax.ShapeDtypeStruct((num_leaves, b, k, gp), jnp.float32),
          jax.ShapeDtypeStruct((num_leaves, b, k, gp, dh), jnp.float32),
      ],
      compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
      interpret=interpret,
      name="jaxkv_decode_leaves",
  )(
      start,
      jnp.append(bounds, jnp.asarray(first_leaf, jnp.int32)),
      jnp.pad(q, ((0, 0), (0, 0), (0, gp - g), (0, 0))),
      *(a for a in parts for _ in (0, 1)),
  )
  return Partials(m[..., :g], l[..., :g], o[..., :g, :])


def _leaf_kernel(start_ref, bounds_ref, q_ref, *refs, sizes, lead, leaf_rows, scale, precision, unpack):
  """One leaf of one (sequence, kv head): its S rows as S / T tiles of T rows, oldest first, each tile read by a
  masked load from each buffer (rows outside a buffer read as zeros; a tile may straddle two), with an online
  softmax over the tiles. Tiles with no valid row are skipped: processing one would change nothing (its weights are
  exp(-inf) = 0), so the bits are those of the full loop. refs: a K ref and a V ref per buffer of sizes[i] rows,
  values [R_i, Dh] (unpack None) or int8 rows u16[R_i, (Dh + Dh / 16) / 2] (unpack "int8": `_load_int8`), then m_ref,
  l_ref f32[Gp] and o_ref f32[Gp, Dh]; q_ref [Gp, Dh] in the values' dtype."""
  *ins, m_ref, l_ref, o_ref = refs
  t_rows = TILE_ROWS
  end, first_row, first_leaf = bounds_ref[0], bounds_ref[1], bounds_ref[2]
  lo = end + 1 - (pl.program_id(2) + first_leaf + 1) * leaf_rows  # The leaf's oldest row.
  lowest = jnp.maximum(start_ref[...], first_row)  # Rows below are masked (or do not exist).
  first_tile = jnp.minimum(jnp.maximum(lowest - lo, 0) // t_rows, leaf_rows // t_rows)
  q = q_ref[...]
  gp, dh = q.shape
  lanes = jnp.arange(t_rows, dtype=jnp.int32)

  def body(t, carry):
    m_i, l_i, o_i = carry
    at = lo + t * t_rows - first_row  # Position of the tile's first row in the buffers.
    valid = lo + t * t_rows + lanes >= lowest
    inside = k = v = None
    for i, n_rows in enumerate(sizes):
      pos = at - sum(sizes[:i])
      here = valid & (pos + lanes >= 0) & (pos + lanes < n_rows)
      offset = jnp.minimum(jnp.maximum(pos, -t_rows), n_rows) + lead  # A tile outside the buffer reads nothing.
      if unpack == "int8":
        load = lambda ref: _load_int8(ref, offset, here, dh, q.dtype)
      else:
        load = lambda ref: plgpu.load(ref.at[pl.ds(offset, t_rows), :], mask=here[:, None], other=0.0)
      ki, vi = load(ins[2 * i]), load(ins[2 * i + 1])
      if inside is None:
        inside, k, v = here, ki, vi
      else:
        inside, k, v = inside | here, jnp.where(here[:, None], ki, k), jnp.where(here[:, None], vi, v)
    s = plgpu.dot(q, k, trans_b=True, precision=precision) * scale  # [Gp, T] f32.
    s = jnp.where(inside[None, :], s, -jnp.inf)
    m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
    shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m_i - shift)
    p = jnp.exp(s - shift[:, None])
    o_new = alpha[:, None] * o_i + plgpu.dot(p.astype(v.dtype), v, precision=precision)
    return m_new, alpha * l_i + jnp.sum(p, axis=1), o_new

  init = (
      jnp.full((gp,), -jnp.inf, jnp.float32),
      jnp.zeros((gp,), jnp.float32),
      jnp.zeros((gp, dh), jnp.float32),
  )
  m, l, o = jax.lax.fori_loop(first_tile, leaf_rows // t_rows, body, init)
  m_ref[...] = m
  l_ref[...] = l
  o_ref[...] = o


def _byte_pairs(rows):
  """Packed rows u8[..., E] -> u16[..., E / 2], the same bytes as little-endian pairs (byte 2i the low one): a
  reshape and a bitcast, no copy. The kernel reads int8 rows so because Pallas's Triton lowering offsets into an
  operand of at most 4 GiB with i32 counted in elements: a u8 operand past 2 GiB (one layer's int8 window at 1M
  rows, 8 kv heads) would overflow, u16 elements stay below 2**31."""
  return jax.lax.bitcast_convert_type(rows.reshape(*rows.shape[:-1], rows.shape[-1] // 2, 2), jnp.uint16)


def _load_int8(ref, offset, here, dh: int, dtype):
  """A tile of int8 rows, unpacked: ref u16[R, (Dh + Dh / 16) / 2], packed rows as byte pairs (`_byte_pairs`; the
  bytes of jaxkv.kv_quant: Dh int8 values, then each block of 32 values' float16 scale), T rows from row offset
  (i32[]) masked by here bool[T] (a masked row reads as zeros) -> [T, Dh] of dtype, the values
  kv_quant.unpack_int8 gives: int8 times the block's scale in f32, then cast. One [T, Dh / 2] load of the values,
  their bytes interleaved back to [T, Dh] (a join and a reshape: Triton's interleave); one [T, 1] load per block
  (its scale), each column's scale picked by selects."""
  t_rows, blocks = here.shape[0], dh // kv_quant.INT8_BLOCK
  rows, mask = pl.ds(offset, t_rows), here[:, None]
  load = lambda cols: plgpu.load(ref.at[rows, cols], mask=mask, other=0)
  scales = [  # f32[T, 1] per block.
      jax.lax.bitcast_convert_type(load(pl.ds(dh // 2 + j, 1)), jnp.float16).astype(jnp.float32) for j in range(blocks)
  ]
  block = jax.lax.div(jnp.arange(dh, dtype=jnp.int32), kv_quant.INT8_BLOCK)[None, :]  # i32[1, Dh]
  s = scales[-1]
  for j in reversed(range(blocks - 1)):
    s = jnp.where(block == j, scales[j], s)  # f32[T, Dh]
  pairs = load(pl.ds(0, dh // 2))  # u16[T, Dh / 2]: values 2i (low byte) and 2i + 1.
  values = jnp.stack([pairs.astype(jnp.uint8), (pairs >> 8).astype(jnp.uint8)], axis=-1).reshape(t_rows, dh)
  return (jax.lax.bitcast_convert_type(values, jnp.int8).astype(jnp.float32) * s).astype(dtype)


def resolve(choice: str, cfg: ModelConfig, fmt: KVFormat, device) -> str:
  """The decode attention that runs on `device` (a jax Device): "xla", "pallas" or "legacy".

  choice (engine.decode_attention): "xla" (the leaves in plain XLA); "pallas" (the kernel; ValueError where it
  cannot run); "auto", pallas where it can run and passes `pallas_check`, else xla; "legacy" (jaxkv.model's window
  and open page reduced whole and merged: the bits depend on the batch's window length). The kernel needs a CUDA GPU,
  KV values (unpacked, or int8 read packed: KERNEL_UNPACKS) in bfloat16, float16 or float32, and head_dim a power of
  two of at least 16; pallas_check runs it on rows as fmt's are read (int8 packed)."""
  if choice not in DECODE_ATTENTIONS:
    raise ValueError(f"engine.decode_attention must be one of {', '.join(DECODE_ATTENTIONS)}, got {choice!r}")
  if choice in ("xla", "legacy"):
    return choice
  missing = []
  if device.platform != "gpu" or getattr(device, "compute_capability", None) is None:
    missing.append(f"a CUDA GPU (the devices are {device.platform})")
  values = fmt.values_dtype.name
  packed = fmt.name if reads_packed("pallas", fmt) else None
  if values not in KERNEL_DTYPES:
    missing.append(f"KV values in {', '.join(KERNEL_DTYPES)} (kv.dtype {fmt.name} holds {values})")
  if cfg.head_dim < MIN_QUERY_ROWS or cfg.head_dim & (cfg.head_dim - 1):
    missing.append(f"head_dim a power of two of at least {MIN_QUERY_ROWS} (it is {cfg.head_dim})")
  return choose_kernel(
      "engine.decode_attention",
      choice,
      "pallas",
      missing,
      lambda: pallas_check(device, values, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, packed=packed),
      f"the Pallas decode kernel to run and match the XLA leaves on {device}",
      "decode attention: the XLA leaves, not the Pallas kernel",
  )


def choose_kernel(field: str, choice: str, kernel: str, missing: list[str], check, needs: str, fallback: str) -> str:
  """The last step of choosing an attention (this module's `resolve`, jaxkv.model.prefill_attention_impl): `kernel`
  where nothing is `missing` and check() returns None (else its error joins `missing` as `needs`: error); otherwise
  "xla", where a ValueError naming what is missing if the config `field` asked for the kernel, and a warning
  (`fallback`, which needs ...) where a CUDA GPU is there but cannot run it."""
  if not missing:
    error = check()
    if error is None:
      return kernel
    missing.append(f"{needs}: {error}")
  if choice == kernel:
    raise ValueError(f"{field} {kernel} needs {'; '.join(missing)}; use {field} auto or xla")
  if not missing[0].startswith("a CUDA GPU"):
    logging.warning("%s, which needs %s", fallback, "; ".join(missing))
  return "xla"


@functools.lru_cache(maxsize=None)
def pallas_check(
    device, dtype: str, heads: int, kv_heads: int, head_dim: int, interpret: bool = False, packed: str | None = None
) -> str | None:
  """Runs the kernel once on `device` in a small case of the model's heads: two sequences (one starting mid-window)
  in a window of 2 leaves and a half and an open page of 64 rows, values in `dtype` (packed: rows stored in that
  format of KERNEL_UNPACKS and read packed; the XLA leaves get their values). None when it runs, is within
  PALLAS_CHECK_TOLERANCE of the XLA leaves, and gives the second sequence alone (its rows moved down by a leaf and 13
  rows, in a window a leaf shorter) the bits it gets in the batch; else what went wrong. interpret: the kernel in
  Pallas's interpreter (CPU tests)."""
  rng = np.random.default_rng(0)
  w_rows, page, d = 5 * LEAF_ROWS // 2, 64, LEAF_ROWS + 13
  q = rng.standard_normal((2, kv_heads, heads // kv_heads, head_dim))
  rows = rng.standard_normal((2, 2, kv_heads, w_rows + page, head_dim))
  start, end = np.array([0, 300]), w_rows + 41
  alone = np.zeros((2, 1, kv_heads, w_rows - LEAF_ROWS + page, head_dim))
  alone[:, :, :, start[1] - d : end + 1 - d] = rows[:, 1:, :, start[1] : end + 1]

  fmt = KVFormat(packed or dtype, head_dim, dtype)

  def run(impl, q, rows, w, start, end):
    put = lambda a, dt=dtype: jax.device_put(jnp.asarray(a, dt), device)
    parts = (rows[:, :, :, :w], rows[:, :, :, w:])
    stored = [jax.device_put(fmt.pack(jnp.asarray(p, dtype)), device) for p in parts]
    o, _ = jax.jit(functools.partial(attend, impl=impl, interpret=interpret, kv_format=fmt))(
        put(q), attention_rows(impl, fmt, stored), 0, put(start, jnp.int32), end
    )
    return np.asarray(o, np.float32)

  try:
    got = run("pallas", q, rows, w_rows, start, end)
    got_alone = run("pallas", q[1:], alone, w_rows - LEAF_ROWS, start[1:] - d, end - d)
  except Exception as e:  # pylint: disable=broad-exception-caught  (any failure means: not here)
    return f"{type(e).__name__}: {str(e)[:300]}"
  ref = run("xla", q, rows, w_rows, start, end)
  err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
  if not err <= PALLAS_CHECK_TOLERANCE:
    return f"relative error {err:.3g} > {PALLAS_CHECK_TOLERANCE}"
  if not np.array_equal(got[1:], got_alone):
    return "a sequence alone gets other bits than in the batch"
  return None
