"""Bridge to LAION's clip_benchmark (what DataComp scores with), offline on our own labelled data.

clip_benchmark reads local WebDataset folders through `--dataset wds/<name> --dataset_root DIR` when DIR has
`test/{0..n-1}.tar` + `test/nshards.txt`, `classnames.txt` and `zeroshot_classification_templates.txt`
(templates with "{c}"), or `dataset_type.txt` = "retrieval" with captions in `.txt`. `prepare` writes that
layout from our held-out shards (one folder per zero-shot dataset, plus `fastclip-val` for retrieval);
`run` calls clip_benchmark after the CPU-torch torchvision guard and after registering custom model configs,
which clip_benchmark's own command line cannot do:

    python -m fastclip.eval.clip_benchmark prepare --data data/embedded --out data/clip_benchmark
    python -m fastclip.eval.clip_benchmark run --model-config export/tiny-vit.json -- eval \\
        --model tiny-vit --pretrained export/model.pt --task zeroshot_classification \\
        --dataset wds/fashion-mnist --dataset_root data/clip_benchmark/fashion-mnist \\
        --no_amp --num_workers 0 --output fashion-mnist.json
    (retrieval: --task zeroshot_retrieval --dataset wds/fastclip-val --dataset_root data/clip_benchmark/fastclip-val)

clip_benchmark is not a dependency of fastclip. Its requirements pull scikit-learn, pycocoevalcap (100 MB)
and transformers; what its import needs, into an environment that already has torch and open_clip_torch:
    pip install --no-deps clip_benchmark==1.6.2 scikit-learn scipy joblib threadpoolctl narwhals cloudpickle \\
        pycocoevalcap requests urllib3 idna certifi charset-normalizer
"""

from __future__ import annotations

import io
import sys
import tempfile
from pathlib import Path

from fastclip.cli import OneLineParser
from fastclip.data.format import sample_key
from fastclip.data.tario import TarWriter
from fastclip.eval.evaluate import default_zeroshot_file
from fastclip.eval.samples import iter_samples
from fastclip.eval.spec import load_zeroshot_spec

SHARD_SIZE = 1000


class _ShardWriter:
    """`{0..n-1}.tar` of SHARD_SIZE samples each, keys counting from 0 (the layout clip_benchmark reads)."""

    def __init__(self, split_dir: Path):
        self.dir = split_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.count, self.tar = 0, None

    def write(self, files: dict[str, bytes]) -> None:
        if self.count % SHARD_SIZE == 0:
            self.close()
            self.tar = TarWriter(self.dir / f"{self.count // SHARD_SIZE}.tar")
        self.tar.add(sample_key(self.count), files)
        self.count += 1

    def close(self) -> None:
        if self.tar is not None:
            self.tar.close()
            self.tar = None

    def finish(self) -> int:
        self.close()
        shards = (self.count + SHARD_SIZE - 1) // SHARD_SIZE
        (self.dir / "nshards.txt").write_text(f"{shards}\n")
        return self.count


def prepare(data, out, zeroshot_file=None, retrieval_name: str = "fastclip-val") -> dict[str, Path]:
    """Write clip_benchmark WDS folders under `out` from our labelled shards; returns name -> dataset root."""
    data, out = Path(data), Path(out)
    if (data / "val").is_dir():
        data = data / "val"
    zeroshot_file = zeroshot_file or default_zeroshot_file(data)
    specs = load_zeroshot_spec(zeroshot_file) if zeroshot_file else {}
    writers = {name: _ShardWriter(out / name / "test") for name in specs}
    retrieval = _ShardWriter(out / retrieval_name / "test")
    # captions of one image (json "group") become one sample whose .txt holds them a line each, as clip_benchmark
    # reads several captions; the image is the group's first caption's in index order, as `fastclip eval` scores it.
    # Those images wait in a spool file, not in memory (a captioned set's images would all be held until the end).
    first: dict[int, tuple[int, int, int]] = {}  # group -> (index, offset, length) of its first caption's PNG
    captions: dict[int, list[tuple[int, str]]] = {}  # group -> its (index, caption)s
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=out) as spool:
        for sample in iter_samples(data):
            png = io.BytesIO()
            sample.image.save(png, format="PNG")
            name = next(iter(specs)) if len(specs) == 1 else sample.dataset
            if sample.label is not None and name in writers:
                writers[name].write({"png": png.getvalue(), "cls": str(sample.label).encode()})
            if sample.caption is None:
                continue
            caption = " ".join(sample.caption.split())  # a line break inside would read as two captions there
            if sample.group is None:
                retrieval.write({"png": png.getvalue(), "txt": caption.encode()})
                continue
            order = -1 if sample.index is None else sample.index
            if sample.group not in first or order < first[sample.group][0]:
                first[sample.group] = (order, spool.seek(0, io.SEEK_END), spool.write(png.getvalue()))
            captions.setdefault(sample.group, []).append((order, caption))
        for group in sorted(first):
            _, offset, length = first[group]
            spool.seek(offset)
            in_order = sorted(captions[group], key=lambda oc: oc[0])
            retrieval.write({"png": spool.read(length), "txt": "\n".join(c for _, c in in_order).encode()})
    roots = {}
    for name, writer in writers.items():
        if writer.finish():
            root = out / name
            (root / "classnames.txt").write_text("\n".join(specs[name].classnames) + "\n")
            templates = [t.replace("{}", "{c}") for t in specs[name].templates]
            (root / "zeroshot_classification_templates.txt").write_text("\n".join(templates) + "\n")
            roots[name] = root
    if retrieval.finish():
        (out / retrieval_name / "dataset_type.txt").write_text("retrieval\n")
        roots[retrieval_name] = out / retrieval_name
    return roots


def _topk_accuracy(logits, target, topk=(1,)):
    """Fraction of rows whose target is among the k highest logits, for each k."""
    ranked = logits.topk(max(topk), dim=1).indices
    return [(ranked[:, :k] == target[:, None]).any(dim=1).float().mean().item() for k in topk]


def _patch_numpy_2_4() -> None:
    """clip_benchmark 1.6.2's top-k accuracy calls float() on a 1-element array, which NumPy >= 2.4 refuses
    (LAION-AI/CLIP_benchmark#147, open); swap in an equivalent that returns plain floats."""
    import numpy

    if tuple(int(p) for p in numpy.__version__.split(".")[:2]) >= (2, 4):
        from clip_benchmark.metrics import zeroshot_classification

        zeroshot_classification.accuracy = _topk_accuracy


def run(clip_benchmark_args: list[str], model_configs: list[str]) -> None:
    """Call clip_benchmark's command line in this process, with our model configs registered."""
    from fastclip.compat import import_open_clip

    open_clip = import_open_clip()  # before clip_benchmark imports torchvision
    for config in model_configs:
        open_clip.add_model_config(config)
    from clip_benchmark.cli import main as clip_benchmark_main

    _patch_numpy_2_4()

    saved = sys.argv
    sys.argv = ["clip_benchmark", *clip_benchmark_args]
    try:
        clip_benchmark_main()
    finally:
        sys.argv = saved


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    forwarded = []
    if "--" in argv:
        cut = argv.index("--")
        argv, forwarded = argv[:cut], argv[cut + 1 :]
    parser = OneLineParser(prog="python -m fastclip.eval.clip_benchmark", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="write clip_benchmark WDS folders from our held-out shards")
    p.add_argument("--data", required=True, help="embedded root or labelled shard folder")
    p.add_argument("--out", required=True)
    p.add_argument("--classnames", help="zeroshot.json (default: the one beside the data)")
    r = sub.add_parser("run", help="run clip_benchmark; its arguments follow '--'")
    r.add_argument("--model-config", action="append", default=[], help="<arch>.json written by fastclip export")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        for name, root in prepare(args.data, args.out, args.classnames).items():
            print(f"--dataset wds/{name} --dataset_root {root}")
        return 0
    run(forwarded, args.model_config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
