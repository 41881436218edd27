"""jaxkv.digest: the background hashes equal sha256 over the rows' f32 little-endian bits, in order."""

import hashlib

import numpy as np
import pytest

from jaxkv import digest


def test_digests_equal_sha256_of_the_rows_in_the_order_given():
  rng = np.random.default_rng(0)
  steps = [rng.standard_normal((3, 1000)).astype(np.float32) for _ in range(5)]
  d = digest.Digests()
  whole, rows = d.new(), [d.new() for _ in range(3)]
  for lg in steps:
    d.update(whole, lg)
    for b in range(3):
      d.update(rows[b], lg[b])
  ref_whole = hashlib.sha256(b"".join(lg.astype("<f4").tobytes() for lg in steps)).hexdigest()
  ref_rows = [hashlib.sha256(b"".join(lg[b].astype("<f4").tobytes() for lg in steps)).hexdigest() for b in range(3)]
  assert d.hexdigest(whole) == ref_whole
  assert [d.hexdigest(h) for h in rows] == ref_rows
  d.close()


def test_a_failed_update_raises_at_hexdigest():
  d = digest.Digests()
  h = d.new()
  d.update(h, np.zeros((2, 4), np.float32))

  class Broken:

    def update(self, data):
      raise RuntimeError("broken hash")

  d.update(Broken(), np.zeros(4, np.float32))
  with pytest.raises(RuntimeError, match="broken hash"):
    d.hexdigest(h)
  d.close()
