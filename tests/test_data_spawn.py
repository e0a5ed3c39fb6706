"""DataLoader workers started with the 'spawn' method (the default on macOS, and what some launchers set).

Such a worker unpickles the preprocess transforms (torchvision objects) before any worker_init_fn; on a CPU
torch with a CUDA torchvision wheel that import fails unless the compat guard already ran there, and the
loader then waits forever for the dead worker. The test runs in a subprocess with a deadline so a regression
fails instead of hanging the suite.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import sys, tempfile
    import torch.multiprocessing as mp
    if __name__ == "__main__":
        mp.set_start_method("spawn", force=True)
        from fastclip.data import build_train_stream
        from fastclip.data.cli import main as data_main
        from fastclip.models import build_model
        out = tempfile.mkdtemp()
        assert data_main(["embedded", "--out", out, "--max-per-class", "2", "--max-val-per-class", "1",
                          "--shard-size", "20"]) == 0
        built = build_model("tiny-vit")
        stream = build_train_stream({"train": out + "/train", "batch_size": 4, "workers": 1, "seed": 0},
                                    preprocess=built.preprocess_train, tokenizer=built.tokenizer)
        batches = list(stream.epoch(0))
        assert len(batches) == stream.batches_per_epoch == 10, len(batches)
        indices = sorted(int(i) for _, _, idx, _ in batches for i in idx)
        assert indices == list(range(40)), indices
        print("spawned-worker-ok")
""")


def test_spawned_loader_workers_start(tmp_path):
    script = tmp_path / "spawn_loader.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "spawned-worker-ok" in done.stdout
