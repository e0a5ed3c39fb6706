"""The linear probe and kNN at the trainer's evaluations (eval.linear_probe, eval.knn): on every rank, the same
numbers, without any rank waiting alone.

Every rank extracts its slice of the training features (the first eval.probe_max_train samples of
eval.probe_train) and the features are gathered, so every rank holds the same training and test features and
refuses the same bad input (one class, k above the training features) at once. Rank 0 alone fits and scores (the
other ranks would only repeat it on the same CPU); its numbers reach the others by one all-reduce, which also
carries a failure, so that no rank is left blocked.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from fastclip.eval.collectives import all_reduce_sum, rank_and_world
from fastclip.eval.probe import LabelledFeatures, ProbeDataError, check_probe_data, feature_kind, run_probe
from fastclip.eval.samples import EvalDataError


def probe_train_beside(val_dir) -> Path:
    """The default training data of the probe: the train/ folder beside the held-out one (an embedded root's)."""
    from fastclip.eval.samples import held_out_folder

    folder = held_out_folder(val_dir)
    return (folder if folder is not None else Path(val_dir)).parent / "train"


def metric_names(dataset: str, linear: bool, ks: tuple[int, ...]) -> list[str]:
    """`linear_probe/<dataset>/top1`, `knn/<dataset>/top1` (k in the name where there are several k)."""
    names = [f"linear_probe/{dataset}/top1"] if linear else []
    if len(ks) == 1:
        names.append(f"knn/{dataset}/top1")
    else:
        names += [f"knn/{dataset}/k{k}/top1" for k in ks]
    return names


@dataclass
class TrainingProbe:
    train_source: str
    linear: bool
    ks: tuple[int, ...]  # sorted, distinct
    max_train: int
    unnamed: str  # the dataset name of samples that name none (train and test alike): the held-out folder's

    def scores(self, model, preprocess, test: dict[str, LabelledFeatures], device, group, batch_size) -> dict:
        from fastclip.eval.evaluate import evaluate, unwrap_model

        train = evaluate(
            model,
            tokenizer=None,
            preprocess=preprocess,
            source=self.train_source,
            specs={},
            device=device,
            group=group,
            batch_size=batch_size,
            max_samples=self.max_train,
            retrieval=False,
            collect_features=self.unnamed,
        ).features
        names = sorted(test)
        for name in names:  # the same verdict on every rank: the same gathered features
            if name not in train:
                raise ProbeDataError(
                    f"probe on {name!r}: no labelled sample of it in the first {self.max_train} samples of "
                    f"{self.train_source}; set eval.probe_train to its training data"
                )
            check_probe_data(name, train[name], test[name], self.ks)
        keys = [key for name in names for key in metric_names(name, self.linear, self.ks)]
        values = torch.zeros(len(keys) + 1, dtype=torch.float64)
        rank, _ = rank_and_world(group)
        if rank == 0:
            kind = feature_kind(unwrap_model(model))
            try:
                row = []
                for name in names:
                    result = run_probe(name, train[name], test[name], linear=self.linear, ks=self.ks, kind=kind)
                    row += [result.linear_top1] if self.linear else []
                    row += [result.knn_top1[k] for k in self.ks]
                values[:-1] = torch.tensor(row, dtype=torch.float64)
            except Exception:  # noqa: BLE001 - said on every rank after the all-reduce, raised here
                values[-1] = 1.0
                all_reduce_sum(values.to(device), group)
                raise
        values = all_reduce_sum(values.to(device), group).cpu()
        if values[-1]:
            raise EvalDataError("the probe failed on rank 0; see its log")
        return dict(zip(keys, values[:-1].tolist()))
