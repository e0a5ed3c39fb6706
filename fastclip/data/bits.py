"""A set of non-negative sample indices as a bitmap, allocated in 8 KiB chunks of 65,536 indices as they are
touched: one bit per index in a touched chunk, instead of a Python int and tuple per sample (~100+ bytes).
Used by `fastclip data scan` (every index of the data set) and by each loader worker (the indices it served
this epoch). A shard's indices are mostly contiguous, so a shard touches one or two chunks.
"""

from __future__ import annotations

import numpy as np

_SHIFT = 16
_MASK = (1 << _SHIFT) - 1
_CHUNK_BYTES = (1 << _SHIFT) // 8


class IndexBits:
    def __init__(self):
        self._chunks: dict[int, bytearray] = {}

    def _chunk(self, c: int) -> bytearray:
        chunk = self._chunks.get(c)
        if chunk is None:
            chunk = self._chunks[c] = bytearray(_CHUNK_BYTES)
        return chunk

    def add(self, index: int) -> bool:
        """Add one index (>= 0); False if it was already there."""
        chunk = self._chunk(index >> _SHIFT)
        off = index & _MASK
        byte, bit = off >> 3, 1 << (off & 7)
        if chunk[byte] & bit:
            return False
        chunk[byte] |= bit
        return True

    def __contains__(self, index: int) -> bool:
        chunk = self._chunks.get(index >> _SHIFT)
        off = index & _MASK
        return chunk is not None and bool(chunk[off >> 3] & (1 << (off & 7)))

    def add_many(self, indices: np.ndarray) -> np.ndarray:
        """Add indices (>= 0) in order; returns a bool mask of those already present, before or earlier in
        `indices` (the first copy of a repeated index is the one kept)."""
        idx = np.asarray(indices, dtype=np.int64)
        dup = np.zeros(len(idx), dtype=bool)
        if not len(idx):
            return dup
        _, first = np.unique(idx, return_index=True)
        dup[:] = True
        dup[first] = False  # later copies within `indices`
        chunk_ids = idx >> _SHIFT
        for c in np.unique(chunk_ids).tolist():
            sel = np.nonzero(chunk_ids == c)[0]
            arr = np.frombuffer(self._chunk(c), dtype=np.uint8)
            off = idx[sel] & _MASK
            byte, bit = off >> 3, np.left_shift(1, off & 7).astype(np.uint8)
            dup[sel] |= (arr[byte] & bit) != 0
            np.bitwise_or.at(arr, byte, bit)
        return dup

    @property
    def nbytes(self) -> int:
        return len(self._chunks) * _CHUNK_BYTES
