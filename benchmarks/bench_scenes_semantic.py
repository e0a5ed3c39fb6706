"""Do the scenes need the glyphs? Both variants side by side: the class-blind oracle, the context, generation time.

    python benchmarks/bench_scenes_semantic.py          # 100,000 training scenes + val/test/novel of each variant
                                                        #   -> results/scenes_semantic.{json,md}
    python benchmarks/bench_scenes_semantic.py --quick  # 2,000 scenes each (CI smoke) -> benchmarks/out/

For `--source scenes` (classic) and `--source scenes-semantic`, generated as a user would (all cores), per split:
  - the class-blind oracle's R@1: it matches each image to the captions whose every named attribute except the
    glyph classes equals its own (fastclip/data/sources/scene_checks.py; ties broken at random, so its R@1 is
    the mean of 1 / tie-group size). It depends on the candidate pool: it is given at each split's size;
  - the share of captions longer than tiny-vit-64's 32-token context, with open_clip's tokenizer (cut: the model
    never reads their end), and the longest caption in tokens;
  - zero-shot chance on the glyph classes (1 / classes) and the most frequent class's share of the labelled
    (single-object) scenes, the level a constant guess reaches;
  - distinct captions (ties between identical captions cap any model's R@1 at about this share);
and the generation's wall and CPU seconds (the machine is shared: CPU seconds / cores is the time on free cores).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scenes import FULL, QUICK, measure, read_meta

from common import RESULTS, SMOKE_OUT, check_out, machine_info, write_json

VARIANTS = {"scenes": "classic", "scenes-semantic": "semantic"}  # --source -> variant
ARCH = "tiny-vit-64"
SPLITS = ("train", "val", "test", "novel")


def text_checks(data_dir: Path, variant: str, tokenizer, context: int) -> dict:
    from fastclip.data.sources.scene_checks import class_blind_key, class_blind_oracle_r1, token_lengths
    from fastclip.data.sources.scenes import glyph_pools

    summary = json.loads((data_dir / "scenes.json").read_text())
    vocab, _ = glyph_pools(summary["datasets"], _fashion_root(), summary["seed"])
    key = class_blind_key(variant, vocab)
    out = {}
    for split in SPLITS:
        metas = read_meta(data_dir / split)
        captions = [m["caption"] for m in metas]
        lengths = token_lengths(captions, tokenizer)
        labels = Counter(m["label"] for m in metas if "label" in m)
        out[split] = {
            "samples": len(captions),
            "class_blind_oracle_R1": class_blind_oracle_r1([key(c) for c in captions]),
            "context_cut_share": sum(n > context for n in lengths) / len(lengths),
            "max_tokens": max(lengths),
            "distinct_caption_share": len(set(captions)) / len(captions),
            "labelled": sum(labels.values()),
            "zeroshot_chance": 1 / len(summary["classes"]),
            "zeroshot_majority_share": max(labels.values()) / sum(labels.values()) if labels else None,
        }
    return out


def _fashion_root() -> str:
    from fastclip.data.sources.embedded import FASHION_MNIST_ROOT

    return FASHION_MNIST_ROOT


def markdown(r: dict) -> str:
    m = r["machine"]
    lines = [
        f"Class-blind oracle, context and generation of both scenes variants ({r['sizes']['num_train']:,} training "
        f"scenes; {m['cores']} cores, load average {m['loadavg'][0]:.1f} at the start: the machine is shared). "
        f"Oracle R@1 is at each split's size (random tie-breaking); cut = captions longer than {ARCH}'s "
        f"{r['context']}-token context with open_clip's tokenizer.",
        "",
        "| source | split | scenes | class-blind oracle R@1 | captions cut | longest (tokens) | distinct captions "
        "| zero-shot chance (majority class) |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for source, v in r["variants"].items():
        for split, s in v["splits"].items():
            majority = s["zeroshot_majority_share"]
            lines.append(
                f"| {source} | {split} | {s['samples']:,} | {100 * s['class_blind_oracle_R1']:.1f}% | "
                f"{100 * s['context_cut_share']:.1f}% | {s['max_tokens']} | {100 * s['distinct_caption_share']:.1f}% | "
                f"{100 * s['zeroshot_chance']:.0f}% ({'-' if majority is None else f'{100 * majority:.1f}%'}) |"
            )
    lines += [
        "",
        "| source | scenes | wall s | CPU s | CPU s / cores (free machine) | scenes / CPU s | 100k training scenes + "
        "9k held out on free cores |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for source, v in r["variants"].items():
        g = v["generation"]
        total = sum(g["sizes"].values())
        free, rate = g["cpu_s"] / g["cores"], total / g["cpu_s"]
        full = sum(FULL.values()) / rate / g["cores"]
        lines.append(
            f"| {source} | {total:,} | {g['wall_s']:.0f} | {g['cpu_s']:.0f} | {free:.0f} | {rate:,.0f} | {full:.0f} s |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--num-train",
        type=int,
        default=None,
        help="training scenes (default 100,000; --quick 2,000): fewer on a loaded machine, where the CPU seconds "
        "per scene still give the time on free cores; val/test/novel keep their sizes",
    )
    args = parser.parse_args(argv)
    check_out(parser, args.out)
    out = args.out or (SMOKE_OUT if args.quick else RESULTS)
    from fastclip.models import import_open_clip, resolve_arch

    name, config = resolve_arch(ARCH)
    config = config or import_open_clip().get_model_config(name)  # (None: already in open_clip's registry)
    tokenizer, context = import_open_clip().get_tokenizer(name), config["text_cfg"]["context_length"]
    sizes = dict(QUICK if args.quick else FULL)
    if args.num_train is not None:
        sizes["num_train"] = args.num_train
    result = {"machine": machine_info(), "sizes": sizes, "arch": ARCH, "context": context, "variants": {}}
    for source, variant in VARIANTS.items():
        data_dir = SMOKE_OUT / f"{source}_bench_data"
        generation = measure(sizes, data_dir, source)
        result["variants"][source] = {
            "generation": {k: generation[k] for k in ("sizes", "wall_s", "cpu_s", "cores", "bytes")},
            "splits": text_checks(data_dir, variant, tokenizer, context),
        }
        assert generation["splits"]["train"]["with_held_out_pair"] == 0, "a held-out pair leaked into training"
    write_json(out / "scenes_semantic.json", result)
    text = markdown(result)
    (out / "scenes_semantic.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
