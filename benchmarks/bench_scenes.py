"""The scenes data at its default size: generation time on this machine and how distinct its captions are.

    python benchmarks/bench_scenes.py            # 100,000 training scenes + val/test/novel -> results/scenes.{json,md}
    python benchmarks/bench_scenes.py --quick    # 2,000 scenes (CI smoke) -> benchmarks/out/

Runs `fastclip data embedded --source scenes` as a user would (all cores), then reads the written shards back
and counts distinct captions per split, distinct scene descriptions (attributes without the phrasing), the
(class, colour) pairs of each split, and checks that no held-out pair occurs in training.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from fastclip.data.manifest import read_manifest

from common import REPO, RESULTS, SMOKE_OUT, check_out, machine_info, write_json

FULL = dict(num_train=100_000, num_val=2_000, num_test=5_000, num_novel=2_000)
QUICK = dict(num_train=2_000, num_val=200, num_test=200, num_novel=200)


def read_meta(split_dir: Path) -> list[dict]:
    metas = []
    for shard in read_manifest(split_dir).shards:
        with tarfile.open(split_dir / shard.path) as tar:
            for member in tar:
                if member.name.endswith(".json"):
                    metas.append(json.loads(tar.extractfile(member).read()))
    return metas


def measure(sizes: dict, out_dir: Path, source: str = "scenes") -> dict:
    """Generate `source` (scenes or scenes-semantic) with `sizes` into `out_dir` on all cores; time and count it."""
    if out_dir.exists():
        shutil.rmtree(out_dir)
    cmd = [
        sys.executable,
        "-m",
        "fastclip",
        "data",
        "embedded",
        "--source",
        source,
        "--out",
        str(out_dir),
        *[x for k, v in sizes.items() for x in (f"--{k.replace('_', '-')}", str(v))],
    ]
    start, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    # CPU seconds of the generator and its workers: on a shared machine the wall time also counts others' work
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    summary = json.loads((out_dir / "scenes.json").read_text())
    held = {tuple(p) for p in summary["held_out_pairs"]}
    splits = {}
    for split in ("train", "val", "test", "novel"):
        metas = read_meta(out_dir / split)
        captions = [m["caption"] for m in metas]
        scenes = [
            json.dumps(sorted(map(tuple, m["scene"]["objects"])) + [m["scene"]["background"], m["scene"]["texture"]])
            for m in metas
        ]
        pairs = [{(o[0], o[1]) for o in m["scene"]["objects"]} for m in metas]
        counts = [len(m["scene"]["objects"]) for m in metas]
        splits[split] = {
            "samples": len(metas),
            "distinct_captions": len(set(captions)),
            "distinct_scenes": len(set(scenes)),
            "with_held_out_pair": sum(bool(p & held) for p in pairs),
            "objects": {n: counts.count(n) for n in (1, 2, 3)},
            "labelled": sum("label" in m for m in metas),
        }
    total = sum(sizes.values())
    return {
        "sizes": sizes,
        "wall_s": wall,
        "cpu_s": cpu,
        "scenes_per_s": total / wall,
        "cores": os.cpu_count(),
        "bytes": sum(p.stat().st_size for p in out_dir.rglob("*.tar")),
        "splits": splits,
        "held_out_pairs": len(held),
    }


def markdown(r: dict) -> str:
    lines = [
        f"`fastclip data embedded --source scenes` with {r['sizes']['num_train']:,} training scenes on "
        f"{r['cores']} cores: {r['wall_s']:.0f} s ({r['scenes_per_s']:,.0f} scenes/s, "
        f"{r['bytes'] / 2**20:.0f} MiB of shards); {r['held_out_pairs']} (class, colour) pairs held out of "
        f"training.",
        "",
        "| split | scenes | distinct captions | distinct scenes (attributes) | with a held-out pair | 1/2/3 objects |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for split, s in r["splits"].items():
        lines.append(
            f"| {split} | {s['samples']:,} | {s['distinct_captions']:,} "
            f"({100 * s['distinct_captions'] / s['samples']:.2f}%) | {s['distinct_scenes']:,} | "
            f"{s['with_held_out_pair']:,} | {s['objects'][1]}/{s['objects'][2]}/{s['objects'][3]} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    check_out(parser, args.out)
    out = args.out or (SMOKE_OUT if args.quick else RESULTS)
    result = {"machine": machine_info(), **measure(QUICK if args.quick else FULL, SMOKE_OUT / "scenes_bench_data")}
    assert result["splits"]["train"]["with_held_out_pair"] == 0, "a held-out pair leaked into training"
    assert result["splits"]["novel"]["with_held_out_pair"] == result["splits"]["novel"]["samples"]
    write_json(out / "scenes.json", result)
    text = markdown(result)
    (out / "scenes.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
