"""`fastclip train [--config FILE.yaml] [--section.key value ...]`

    fastclip train --config configs/embedded.yaml                                  # one process
    torchrun --nproc_per_node 2 -m fastclip train --config configs/embedded.yaml    # one node, 2 processes
    srun fastclip train --config configs/cc3m-fastclip-v3.yaml                      # SLURM (launch/slurm.sbatch)

Without --config the built-in defaults apply (the embedded recipe). `--print-config` shows the resolved config
and exits. `--check [--world-size N]` runs every check that needs no process group (config, device,
architecture, run folder, data for N processes, resume or pretrained file) and exits 0 or 2 without training:
the launchers run it before torchrun, so a configuration error is the first and only line the operator sees
(torchrun itself reports a worker's exit status 2 as its own failure, with a traceback, and exits 1). Configuration
errors are reported before anything is built, naming the key; exit status 2.
A run stopped for a known reason (a failed collective, too many NaN/Inf steps, an untrusted or unreadable
checkpoint: fastclip/train/errors.py) prints one line naming it; exit status 1. Stopped by a signal in
train.stop_signals (SIGUSR1, SIGTERM: preemption, the end of a SLURM time slot) after writing a checkpoint at
that step on every rank: exit status 75 (launch/slurm.sbatch requeues the job on it; fastclip/train/preemption.py).
"""

from __future__ import annotations

import sys

from fastclip.train.config import ConfigError, dump_config, load_config
from fastclip.train.errors import TrainingError
from fastclip.train.preemption import EXIT_PREEMPTED

USAGE = __doc__


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    while argv and argv[0] == "--":  # torchrun passes a separating "--" through to the script
        argv.pop(0)
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    config_path, print_only, rest = None, False, []
    check_only, world_size = False, 1
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("--config", "-c"):
            if i + 1 >= len(argv):
                print("fastclip train: --config needs a file", file=sys.stderr)
                return 2
            config_path, i = argv[i + 1], i + 2
        elif a.startswith("--config="):
            config_path, i = a.split("=", 1)[1], i + 1
        elif a == "--print-config":
            print_only, i = True, i + 1
        elif a == "--check":
            check_only, i = True, i + 1
        elif a == "--world-size":
            if i + 1 >= len(argv) or not argv[i + 1].isdigit() or int(argv[i + 1]) < 1:
                print("fastclip train: --world-size needs a number of processes >= 1", file=sys.stderr)
                return 2
            world_size, i = int(argv[i + 1]), i + 2
        else:
            rest.append(a)
            i += 1
    try:
        cfg = load_config(config_path, rest)
        if print_only:
            print(dump_config(cfg), end="")
            return 0
        if check_only:
            from fastclip.train import preflight
            from fastclip.train.trainer import check_inputs

            preflight.check_operator_input(cfg, create=False)  # --check leaves no run folder
            check_inputs(cfg, world_size)
            print(f"fastclip train: config ok for {world_size} process(es)")
            return 0
        from fastclip.train.trainer import train

        if train(cfg)["preempted"]:
            return EXIT_PREEMPTED
    except ConfigError as e:
        print(f"fastclip train: config error: {e}", file=sys.stderr)
        return 2
    except TrainingError as e:
        print(f"fastclip train: error: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
