"""The epoch plan: which sample every (rank, worker, batch) gets. Pure arithmetic, no I/O.

1. Epoch sequence. The shards in an order drawn from (seed, epoch): a permutation, or with --resampled, draws
   with replacement (weights per source) until `samples_per_epoch` samples. Sample positions 0..L-1 run through
   the shards in that order (position = shard slot + ordinal inside the shard).
2. Segment. The part of the epoch sequence still to be served: the whole sequence, or after a resume at
   another layout, the good positions not yet served and those not yet read (see `remainder`). A list of [lo, hi)
   epoch intervals. Beside it, the "quiet" positions: good ones a worker had read before the resume but not
   served; they are served now, and what reading them counted (a tar's samples past its manifest) is not counted
   again.
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


class Segment:
    """Sorted, disjoint [lo, hi) intervals of the epoch sequence, served in order. After a resume at another layout
    there is one interval per run of samples an old worker left unserved in its window (up to ~window/2 per old
    worker, millions at scale): they are numpy arrays, lookups bisect."""

    def __init__(self, intervals=()):
        pairs = np.asarray(intervals, dtype=np.int64).reshape(-1, 2)
        self.lo, self.hi = pairs[:, 0].copy(), pairs[:, 1].copy()
        self._ends = np.concatenate([[0], np.cumsum(self.hi - self.lo)])  # segment position of each start, and the end
        self._tag: int | None = None

    @classmethod
    def full(cls, length: int) -> Segment:
        return cls(((0, length),) if length > 0 else ())

    @property
    def intervals(self) -> tuple[tuple[int, int], ...]:
        return tuple(zip(self.lo.tolist(), self.hi.tolist()))

    def __len__(self) -> int:  # intervals
        return len(self.lo)

    def __eq__(self, other) -> bool:
        return isinstance(other, Segment) and np.array_equal(self.lo, other.lo) and np.array_equal(self.hi, other.hi)

    def __repr__(self) -> str:
        return f"Segment({len(self)} intervals, {self.length} positions)"

    @property
    def length(self) -> int:
        return int(self._ends[-1])

    def as_array(self) -> np.ndarray:
        return np.stack([self.lo, self.hi], axis=1)

    def tag(self, epoch_length: int) -> int:
        """0 for a whole epoch; else a hash of the intervals (keeps random streams of a remainder apart)."""
        if self == Segment.full(epoch_length):
            return 0
        if self._tag is None:
            self._tag = zlib.crc32(repr(self.intervals).encode())
        return self._tag

    def find(self, epoch_pos: int) -> tuple[bool, int]:
        """(whether the epoch position lies in an interval, positions until that changes)."""
        i = int(np.searchsorted(self.lo, epoch_pos, side="right")) - 1
        if i >= 0 and epoch_pos < self.hi[i]:
            return True, int(self.hi[i]) - epoch_pos
        if i + 1 < len(self.lo):
            return False, int(self.lo[i + 1]) - epoch_pos
        return False, 1 << 62

    def to_epoch(self, pos: int) -> tuple[int, int]:
        """(epoch position of segment position pos, positions left in its interval)."""
        if not 0 <= pos < self.length:
            raise IndexError(f"segment position out of range ({self.length} positions)")
        i = int(np.searchsorted(self._ends, pos, side="right")) - 1
        offset = pos - int(self._ends[i])
        return int(self.lo[i]) + offset, int(self.hi[i] - self.lo[i]) - offset


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
    quiet: bool = False  # read before a resume at another layout: what reading it counts was counted then


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
    quiet: Segment | None = None,
) -> list[Run]:
    """Worker positions [start, start+count) as contiguous runs of shard samples (split where `quiet` begins or
    ends)."""
    runs, a, end = [], start, start + count
    while a < end:
        p = chunk_start + a  # virtual rank position
        item = p % n_rank
        epoch_pos, seg_room = segment.to_epoch(rank_lo + item)
        slot, ordinal, shard_room = seq.locate(epoch_pos)
        n = min(end - a, n_rank - item, seg_room, shard_room)
        if a < chunk_len:
            n = min(n, chunk_len - a)
        is_quiet, quiet_room = quiet.find(epoch_pos) if quiet is not None else (False, n)
        n = min(n, quiet_room)
        runs.append(Run(slot, ordinal, n, borrowed or a >= chunk_len or p >= n_rank, is_quiet))
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


@dataclass(frozen=True)
class WorkerProgress:
    """How far a worker got: its cursor (window, samples of it served) and which samples of that window it served
    (offsets from the window's first position)."""

    window: int
    consumed: int
    taken: tuple[int, ...]
    bad: tuple[int, ...] = ()  # offsets of that window read and found bad (counted, never to be served)


def remainder(
    segment: Segment,
    old: Layout,
    batches_done: int,
    progress: list[list[WorkerProgress]] | None = None,
    quiet: Segment | None = None,
) -> tuple[Segment, Segment]:
    """(positions still to serve, quiet positions) for a resume at another layout after `batches_done` batches at
    `old`; `quiet` is the segment's own (a second resume within the same epoch).

    With `progress` (every old rank's workers, in rank order): exact. Worker w of rank r with cursor (k, i) has
    served its windows before k whole, and of window k the samples in `taken`; those positions are done, and so
    are the window's bad ones (`bad`: counted when it was read, never served). The rest of window k was read but
    not served: it is served now, quietly (a read-time count, such as the samples a tar holds past its manifest,
    is not made twice). Nothing is served twice, nothing skipped, each bad sample counted once. (A worker past
    its chunk, in refill windows, has served its chunk whole; the refills are positions of other workers' chunks,
    served as counted wraps.)

    Without (a state saved before the taken samples were recorded): worker w made b_w batches of B good samples,
    so it consumed at least c = b_w * B positions of its chunk and therefore all of its first floor(c / window)
    windows. Those positions are done; everything else is served again, so nothing is skipped and at most
    world_size * workers * (window - 1) samples are served twice (and their bad samples counted twice).
    """
    L = segment.length
    nb = num_batches(L, old)
    done: list[tuple[int, int]] = []  # segment positions
    rest: list[tuple[int, int]] = []
    for r in range(old.world_size):
        lo, hi = rank_range(L, r, old.world_size)
        n_rank = hi - lo
        if n_rank == 0:
            continue
        for w in range(old.workers):
            chunk_start, chunk_len = worker_chunk(nb, old, w)
            served, unserved = _worker_done(
                chunk_len,
                old,
                n_rank,
                len(worker_batches(min(batches_done, nb), old.workers, w)),
                None if progress is None else progress[r][w],
            )
            for spans, into in ((served, done), (unserved, rest)):
                for a, b in spans:
                    a, b = chunk_start + a, min(chunk_start + b, n_rank)  # only unwrapped positions
                    if b > a:
                        into.append((lo + a, lo + b))
    todo = _to_epoch(segment, _complement(done, L))
    kept_quiet = _intersect(list(quiet.intervals), todo) if quiet is not None else []  # (a second resume)
    return Segment(todo), Segment(_union(_to_epoch(segment, rest) + kept_quiet))


def _worker_done(
    chunk_len: int, old: Layout, n_rank: int, made: int, progress: WorkerProgress | None
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(served, read but unserved) spans of worker positions, for `remainder`."""
    if progress is None:
        consumed = made * old.batch_size
        return [(0, chunk_len if consumed >= chunk_len else (consumed // old.window) * old.window)], []
    k, i = progress.window, progress.consumed
    inside = -(-chunk_len // old.window)
    if k >= inside:
        return [(0, chunk_len)], []
    start, length = window_span(k, chunk_len, old.window, n_rank)
    if i == 0:  # window k not read yet
        return [(0, start)], []
    # (a set: with duplicate indices in unscanned data a same-layout resume can serve an offset twice)
    done = sorted({o for o in (*progress.taken, *progress.bad) if 0 <= o < length})
    served = [(0, start)] + [(start + o, start + o + 1) for o in done]
    return _union(served), _complement([(o, o + 1) for o in done], length, start)


def _union(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _complement(spans: list[tuple[int, int]], length: int, base: int = 0) -> list[tuple[int, int]]:
    """[base, base + length) minus `spans` (given relative to base when base is nonzero: spans are offsets)."""
    out, cursor = [], 0
    for a, b in _union(spans) + [(length, length)]:
        if a > cursor:
            out.append((base + cursor, base + a))
        cursor = max(cursor, b)
    return out


def _intersect(xs: list[tuple[int, int]], ys: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Of two sorted, disjoint interval lists, the positions in both."""
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if b > a:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def _to_epoch(segment: Segment, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Segment position spans -> epoch intervals (sorted, merged)."""
    intervals: list[tuple[int, int]] = []
    for a, b in _union(spans):
        while a < b:
            epoch_pos, room = segment.to_epoch(a)
            n = min(room, b - a)
            if intervals and intervals[-1][1] == epoch_pos:
                intervals[-1] = (intervals[-1][0], epoch_pos + n)
            else:
                intervals.append((epoch_pos, epoch_pos + n))
            a += n
    return intervals
