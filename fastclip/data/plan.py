"""The epoch plan: which sample every (rank, worker, batch) gets. Pure arithmetic, no I/O.

1. Epoch sequence. The shards in an order drawn from (seed, epoch): a permutation, or with --resampled, draws
   with replacement (weights per source) until `samples_per_epoch` samples. Sample positions 0..L-1 run through
   the shards in that order (position = shard slot + ordinal inside the shard).
2. Segment. The part of the epoch sequence still to be served: the whole sequence, or after a resume at
   another layout, the positions not yet consumed (see `remainder`). A list of [lo, hi) epoch intervals.
3. Ranks. Rank r gets segment positions [L*r/W, L*(r+1)/W): shards are split at sample granularity, so ranks
   differ by at most one sample whatever the shard sizes. Every rank serves `ceil(L / (W*B))` batches: a rank
   whose range is shorter than that wraps around within its own range (its "virtual" positions p >= n_r map to
   p mod n_r); those samples are counted as `wrapped`. (With fewer samples left than ranks, which only the
   rest of an epoch after a resume can have, a rank with an empty range borrows the whole segment.)
4. Workers. Batch j of a rank is made by logical worker j % workers. Worker w owns the contiguous chunk of
   its rank's virtual positions that its batches need; if it loses samples to bad data it reads on past its
   chunk (refill windows of at most a chunk, also counted as wrapped: see `window_span`). Every position of the
   rank's range lies, unwrapped, in exactly one
   worker's chunk, and that worker reads all of it: it alone counts the position's bad samples, so each lost
   sample is counted once per epoch whatever the wraps and refills re-read.
5. Windows. A worker reads its positions in windows of `window` (the shuffle buffer; the last window of its
   chunk is cut at the chunk's end) and serves each window in an order drawn from (seed, epoch, rank, worker,
   window): a seeded shuffle whose state is just (window, consumed), so a resume re-reads at most one window.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np

# tags keep the random streams for different purposes apart
TAG_SHARDS, TAG_WINDOW, TAG_BATCH = 1, 2, 3


def rng_for(*words: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(w) for w in words]))


@dataclass(frozen=True)
class Layout:
    """What decides the batches besides the data and the seed; an exact resume needs the same layout."""

    world_size: int
    workers: int  # logical workers per rank (DataLoader workers, 1 when loading in the main process)
    batch_size: int
    window: int  # shuffle buffer: samples per window

    def as_dict(self) -> dict:
        return {
            "world_size": self.world_size,
            "workers": self.workers,
            "batch_size": self.batch_size,
            "window": self.window,
        }


@dataclass(frozen=True)
class EpochSequence:
    slots: np.ndarray  # shard id in each slot of the epoch order
    starts: np.ndarray  # epoch position of each slot's first sample; len(slots) + 1 entries
    length: int  # samples in the epoch (a resampled epoch is cut at samples_per_epoch)

    def locate(self, pos: int) -> tuple[int, int, int]:
        """(slot, ordinal in that shard, samples left in that slot from pos)."""
        slot = int(np.searchsorted(self.starts, pos, side="right")) - 1
        return slot, pos - int(self.starts[slot]), int(self.starts[slot + 1]) - pos


def epoch_sequence(
    sizes: list[int],
    seed: int,
    epoch: int,
    *,
    resampled: bool = False,
    samples_per_epoch: int | None = None,
    weights: list[float] | None = None,
) -> EpochSequence:
    sizes_arr = np.asarray(sizes, dtype=np.int64)
    rng = rng_for(seed, epoch, TAG_SHARDS)
    if not resampled:
        slots = rng.permutation(len(sizes_arr))
        length = int(sizes_arr.sum())
    else:
        length = int(samples_per_epoch if samples_per_epoch is not None else sizes_arr.sum())
        p = np.asarray(weights if weights is not None else np.ones(len(sizes_arr)), dtype=np.float64)
        p = np.where(sizes_arr > 0, p, 0.0)  # an empty shard would add nothing; never draw it
        if p.sum() <= 0:
            raise ValueError("resampled: no shard with samples and positive weight")
        p /= p.sum()
        drawn, total = [], 0
        while total < length:  # draw in blocks; the epoch is cut at `length`
            block = rng.choice(len(sizes_arr), size=max(16, 2 * len(sizes_arr)), p=p)
            for s in block:
                drawn.append(int(s))
                total += int(sizes_arr[s])
                if total >= length:
                    break
        slots = np.asarray(drawn, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes_arr[slots])]).astype(np.int64)
    return EpochSequence(slots, starts, length)


@dataclass(frozen=True)
class Segment:
    """Sorted, disjoint [lo, hi) intervals of the epoch sequence, served in order."""

    intervals: tuple[tuple[int, int], ...]

    @classmethod
    def full(cls, length: int) -> Segment:
        return cls(((0, length),) if length > 0 else ())

    @property
    def length(self) -> int:
        return sum(hi - lo for lo, hi in self.intervals)

    def tag(self, epoch_length: int) -> int:
        """0 for a whole epoch; else a hash of the intervals (keeps random streams of a remainder apart)."""
        if self.intervals == Segment.full(epoch_length).intervals:
            return 0
        return zlib.crc32(repr(self.intervals).encode())

    def to_epoch(self, pos: int) -> tuple[int, int]:
        """(epoch position of segment position pos, positions left in its interval)."""
        for lo, hi in self.intervals:
            if pos < hi - lo:
                return lo + pos, hi - lo - pos
            pos -= hi - lo
        raise IndexError(f"segment position out of range ({self.length} positions)")


def num_batches(segment_length: int, layout: Layout) -> int:
    return math.ceil(segment_length / (layout.world_size * layout.batch_size))


def rank_range(segment_length: int, rank: int, world_size: int) -> tuple[int, int]:
    return segment_length * rank // world_size, segment_length * (rank + 1) // world_size


def rank_span(segment_length: int, rank: int, world_size: int) -> tuple[int, int, bool]:
    """(first segment position, length, borrowed) of the range a rank serves from. A rank whose own range is
    empty (fewer samples left than ranks, e.g. the rest of an epoch after a resume) borrows the whole segment:
    it must still make its batches, and all it serves is a repeat."""
    lo, hi = rank_range(segment_length, rank, world_size)
    if hi > lo:
        return lo, hi - lo, False
    return 0, segment_length, True


def worker_batches(n_batches: int, workers: int, worker: int, first: int = 0) -> range:
    """Batch numbers (within the segment) made by a logical worker, from batch `first` on."""
    start = first + (worker - first) % workers
    return range(start, n_batches, workers)


def worker_chunk(n_batches: int, layout: Layout, worker: int) -> tuple[int, int]:
    """(first virtual rank position, number of positions) owned by a logical worker."""
    counts = [len(worker_batches(n_batches, layout.workers, w)) for w in range(layout.workers)]
    return layout.batch_size * sum(counts[:worker]), layout.batch_size * counts[worker]


@dataclass(frozen=True)
class Run:
    slot: int  # slot of the epoch sequence
    ordinal: int  # first sample's ordinal in the shard
    count: int
    wrapped: bool  # served a second time this epoch (rank wrap or read past the worker's chunk)


def worker_runs(
    seq: EpochSequence,
    segment: Segment,
    rank_lo: int,
    n_rank: int,
    chunk_start: int,
    chunk_len: int,
    start: int,
    count: int,
    borrowed: bool = False,
) -> list[Run]:
    """Worker positions [start, start+count) as contiguous runs of shard samples."""
    runs, a, end = [], start, start + count
    while a < end:
        p = chunk_start + a  # virtual rank position
        item = p % n_rank
        epoch_pos, seg_room = segment.to_epoch(rank_lo + item)
        slot, ordinal, shard_room = seq.locate(epoch_pos)
        n = min(end - a, n_rank - item, seg_room, shard_room)
        if a < chunk_len:
            n = min(n, chunk_len - a)
        runs.append(Run(slot, ordinal, n, borrowed or a >= chunk_len or p >= n_rank))
        a += n
    return runs


def window_span(k: int, chunk_len: int, window: int, n_rank: int) -> tuple[int, int]:
    """(first worker position, length) of window k. Windows tile the worker's chunk, the last one cut at the
    chunk's end so that a worker without bad samples serves exactly its chunk; refill windows follow, each at
    most a chunk long: worker w's first refill window is then the next worker's chunk, its second the one
    after, so the workers' refills draw on different samples (a window as long as the rank's range would let
    every worker pick from all of it: the same sample served three times, or read twice in one window)."""
    inside = -(-chunk_len // window)
    if k < inside:
        return k * window, min(window, chunk_len - k * window)
    refill = max(1, min(window, chunk_len, n_rank))
    return chunk_len + (k - inside) * refill, refill


def remainder(segment: Segment, old: Layout, batches_done: int) -> Segment:
    """The positions a resume at another layout still has to serve, after `batches_done` batches at `old`.

    Worker w of old rank r made len(worker_batches(nb, workers, w) below batches_done) batches of B good
    samples, so it consumed at least c = that * B positions of its chunk and therefore all of its first
    floor(c / window) windows. Those positions are done; everything else (including the partly served
    windows) is served again. So nothing is skipped and at most world_size * workers * (window - 1) samples are
    served twice, plus positions beyond c consumed because of bad samples.
    """
    L = segment.length
    nb = num_batches(L, old)
    done: list[tuple[int, int]] = []
    for r in range(old.world_size):
        lo, hi = rank_range(L, r, old.world_size)
        n_rank = hi - lo
        if n_rank == 0:
            continue
        for w in range(old.workers):
            made = len(worker_batches(min(batches_done, nb), old.workers, w))
            chunk_start, chunk_len = worker_chunk(nb, old, w)
            consumed = made * old.batch_size
            full = chunk_len if consumed >= chunk_len else (consumed // old.window) * old.window
            a, b = chunk_start, min(chunk_start + full, n_rank)  # only unwrapped positions
            if b > a:
                done.append((lo + a, lo + b))
    done.sort()
    todo, cursor = [], 0
    for a, b in done + [(L, L)]:
        if a > cursor:
            todo.append((cursor, a))
        cursor = max(cursor, b)
    intervals = []
    for a, b in todo:  # segment positions -> epoch intervals
        while a < b:
            epoch_pos, room = segment.to_epoch(a)
            n = min(room, b - a)
            if intervals and intervals[-1][1] == epoch_pos:
                intervals[-1] = (intervals[-1][0], epoch_pos + n)
            else:
                intervals.append((epoch_pos, epoch_pos + n))
            a += n
    return Segment(tuple(intervals))
