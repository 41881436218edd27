"""Prefix cache: the KV rows of prompt prefixes kept in host memory for reuse, least recently used evicted.

A prompt is cut in blocks of `block` tokens (engine.prefill_chunk) from its position 0. Block i's key chains the
tokens before it: key_i = sha256(key_{i-1} || tokens of block i), so a key names the whole prefix [0, (i + 1) block).
An entry holds block i's KV rows of every layer (whatever the caller stores: jaxkv.serving stores per layer
[2, 1, K, block, E] arrays in pinned host memory) and their bytes.

`match` walks a prompt's chain from block 0 and returns the entries of its longest cached prefix, pinned: eviction
skips them until `release`. `add` stores new blocks and evicts the least recently used unpinned entries while the
bytes exceed the budget; `drop` removes a chain's blocks (a slot's erase). A lookup touches its chain from the last
block to the first, so a chain's deepest block is its least recently used and goes first (a parent never leaves
before its children).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass
class Entry:
  """One block's rows (per layer) and their bytes; pins: slots copying from it now."""

  rows: list
  nbytes: int
  pins: int = 0


class PrefixCache:
  """An LRU store of prompt blocks under a byte budget; see the module docstring."""

  def __init__(self, budget_bytes: int, block: int):
    if budget_bytes <= 0 or block <= 0:
      raise ValueError(f"the prefix cache needs a positive budget and block, got {budget_bytes} B, {block}")
    self.budget_bytes, self.block = budget_bytes, block
    self._entries: collections.OrderedDict[bytes, Entry] = collections.OrderedDict()  # Least recent first.
    self.bytes = 0
    self.stats = collections.Counter(lookups=0, hits=0, hit_tokens=0, evictions=0, stored_blocks=0)

  def keys(self, prompt: Sequence[int], blocks: int) -> list[bytes]:
    """The chain of keys of the prompt's first `blocks` blocks."""
    keys, h = [], b""
    tokens = np.asarray(prompt, np.int64)
    for i in range(blocks):
      h = hashlib.sha256(h + tokens[i * self.block : (i + 1) * self.block].astype("<i8").tobytes()).digest()
      keys.append(h)
    return keys

  def usable_blocks(self, length: int) -> int:
    """Blocks of a prompt of `length` tokens that may come from the cache: whole blocks, leaving at least its last
    token to prefill (its hidden state gives the first token)."""
    return (length - 1) // self.block

  def match(self, prompt: Sequence[int]) -> tuple[list[bytes], list[Entry]]:
    """The keys of the prompt's usable blocks and the entries of its longest cached prefix (pinned; `release`
    them once copied). Counts a lookup, and a hit with its tokens when a block matched."""
    keys = self.keys(prompt, self.usable_blocks(len(prompt)))
    found = []
    for k in keys:
      e = self._entries.get(k)
      if e is None:
        break
      found.append(e)
    self._touch(keys[: len(found)])
    for e in found:
      e.pins += 1
    self.stats["lookups"] += 1
    if found:
      self.stats["hits"] += 1
      self.stats["hit_tokens"] += len(found) * self.block
    return keys, found

  def _touch(self, keys: Sequence[bytes]) -> None:
    """Makes a chain the most recently used, its first block most of all."""
    for k in reversed(keys):
      if k in self._entries:
        self._entries.move_to_end(k)

  def release(self, entries: Sequence[Entry]) -> None:
    for e in entries:
      e.pins -= 1

  def add(self, keys: Sequence[bytes], rows: Sequence[list], nbytes: int) -> None:
    """Stores blocks len(keys) - len(rows) .. of a chain (their parents were matched or stored before), each of
    `nbytes`, then evicts. A block larger than the budget is not stored."""
    if nbytes > self.budget_bytes:
      return
    for k, r in zip(keys[len(keys) - len(rows) :], rows):
      if k in self._entries:
        continue
      self._entries[k] = Entry(r, nbytes)
      self.bytes += nbytes
      self.stats["stored_blocks"] += 1
    self._touch(keys)
    self._evict()

  def _evict(self) -> None:
    for k in list(self._entries):  # Least recent first.
      if self.bytes <= self.budget_bytes:
        return
      e = self._entries[k]
      if e.pins:
        continue
      del self._entries[k]
      self.bytes -= e.nbytes
      self.stats["evictions"] += 1

  def entry(self, key: bytes) -> Entry | None:
    """The entry stored under `key` (None: none), neither counted as a lookup nor touched."""
    return self._entries.get(key)

  def drop(self, keys: Sequence[bytes]) -> int:
    """Removes the unpinned entries of `keys` (a block's children stay, unreachable until evicted); returns how many
    it removed."""
    dropped = 0
    for k in keys:
      e = self._entries.get(k)
      if e is not None and not e.pins:
        del self._entries[k]
        self.bytes -= e.nbytes
        dropped += 1
    return dropped

  def __len__(self) -> int:
    return len(self._entries)

  def __contains__(self, key: bytes) -> bool:
    return key in self._entries

  def summary(self) -> dict:
    """Telemetry: budget and bytes held, entries, and the counters since start."""
    return dict(budget_bytes=self.budget_bytes, bytes=self.bytes, entries=len(self._entries), **self.stats)
