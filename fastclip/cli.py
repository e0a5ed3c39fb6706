"""`fastclip <command> ...`: one entry point, each command lives beside the code it drives."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "data": ("fastclip.data.cli", "write WebDataset shards with global indices, scan existing shards"),
    "train": ("fastclip.train.cli", "train with a FastCLIP loss or the OpenCLIP baseline (torchrun/SLURM aware)"),
    "eval": ("fastclip.eval.cli", "zero-shot classification and image-text retrieval"),
    "export": ("fastclip.eval.export", "write a model-only checkpoint that open_clip loads"),
    "plot": ("fastclip.eval.plots", "plot metrics of one or several runs"),
    "summary": ("fastclip.eval.summary", "what a run trained, how long, and how well, at a glance"),
    "reshard": ("fastclip.losses.sharded_state", "reshard saved per-sample state to another world size"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        width = max(map(len, COMMANDS))
        lines = [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
        print("usage: fastclip <command> [options]\n\ncommands:\n" + "\n".join(lines))
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nfastclip: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
