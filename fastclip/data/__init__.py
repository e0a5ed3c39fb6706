"""fastclip.data: WebDataset shards with global sample indices -> training batches (images, token ids, indices,
group ids).

Writing shards (`fastclip data ...`, fastclip/data/cli.py):
    embedded   Fashion-MNIST + MNIST-5k (or MNIST-5k + Animal-MNIST) -> DIR/train, DIR/val, DIR/zeroshot.json
    folder     images + CSV/TSV/JSONL captions -> shards
    scan       existing img2dataset-style shards -> manifest.json, with index checks
    info       what a data spec resolves to

Training (fastclip/data/stream.py has the rules on order, ranks, workers and resume):
    stream = build_train_stream(cfg, rank=rank, world_size=world, preprocess=built.preprocess_train,
                                tokenizer=built.tokenizer)
        cfg: StreamConfig or any object/dict with train, batch_size, and optionally seed, workers,
             shuffle_buffer, resampled, samples_per_epoch, upsampling_factors, data_size, pin_memory,
             remote_retry_delays. Raises DataSpecError / ManifestError before training for a bad spec.
    stream.data_size              1 + the largest index (size the per-sample state from it)
    stream.batches_per_epoch      batches every rank serves in a whole epoch (the same on all ranks)
    stream.batches_remaining(e)   batches stream.epoch(e) will serve from the current position
    stream.epoch(e)               iterator of (images float [B,3,H,W], texts int64 [B,ctx], indices int64 [B],
                                  groups int64 [B]: json "group", else the index; format.py); uint8 images
                                  with pixels.on_device(preprocess)'s transform, to normalise on the device
    stream.grouped                whether a manifest says some samples share a group (the trainer then passes
                                  the groups to the loss)
    stream.state_dict() / stream.load_state_dict(sd)   position (plain types; torch.load(weights_only=True) ok)
    stream.counters               {reason: samples skipped, ..., "wrapped": samples served twice to fill batches,
                                  "remote_retries": retries of remote shard reads, "remote_shards_skipped": remote
                                  shard reads given up (their samples counted under unreadable_shard)}
    stream.drain_skips()          the skipped samples since the last call: {"shard", "key", "reason", "detail",
                                  "samples", "epoch", "rank"} (the last 100 are kept in stream.recent_skips)
    stream.samples_seen           samples this rank has served

Modules, in the order a sample travels: format.py (shard format), tario.py (tar read/write), writer.py and
sources/ (embedded, folder, scan, synthetic), manifest.py, catalog.py (patterns, `::`, manifests, checks), plan.py
(epoch
order, ranks, workers, windows, resume arithmetic), samples.py (checks, skip reasons), worker.py (one
worker's epoch), stream.py (the trainer's object), pixels.py (uint8 images, normalised on the device).

Evaluation reads held-out shards through format.py, tario.py and manifest.py: fastclip/eval/samples.py.
"""

from fastclip.data.catalog import Catalog, DataSpecError, expand_braces, resolve_catalog
from fastclip.data.manifest import Manifest, ManifestError, ShardInfo, read_manifest, write_manifest
from fastclip.data.samples import REASONS
from fastclip.data.stream import StreamConfig, StreamOptions, TrainStream, build_train_stream, state_for_new_world_size
from fastclip.data.writer import ShardWriter

__all__ = [
    "build_train_stream",
    "StreamConfig",
    "StreamOptions",
    "TrainStream",
    "state_for_new_world_size",
    "REASONS",
    "resolve_catalog",
    "expand_braces",
    "Catalog",
    "DataSpecError",
    "Manifest",
    "ShardInfo",
    "ManifestError",
    "read_manifest",
    "write_manifest",
    "ShardWriter",
]
