"""Evaluation and export: zero-shot classification, image-text retrieval, model-only export, plots.

`run_evals` is what the trainer calls every N steps on every rank; `fastclip eval`, `fastclip export` and
`fastclip plot` live in `cli.py`, `export.py` and `plots.py`. Importing this package stays cheap (no open_clip,
no matplotlib): the heavy imports happen inside the functions that need them.
"""

from __future__ import annotations

from fastclip.eval.evaluate import EvalResults, evaluate, run_evals
from fastclip.eval.retrieval import retrieval_metrics
from fastclip.eval.samples import EvalDataError
from fastclip.eval.spec import ZeroShotSpec, load_zeroshot_spec
from fastclip.eval.zeroshot import evaluate_zeroshot, zeroshot_classifier

__all__ = [
    "run_evals",
    "evaluate",
    "EvalResults",
    "EvalDataError",
    "zeroshot_classifier",
    "evaluate_zeroshot",
    "retrieval_metrics",
    "ZeroShotSpec",
    "load_zeroshot_spec",
]
