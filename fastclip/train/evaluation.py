"""The scheduled evaluations of a run (eval.every_steps, eval.every_epochs, eval.at_end), on every rank: data.val's
zero-shot and retrieval (fastclip.eval.run_evals), eval.imagenet_val's zero-shot, eval.linear_probe / eval.knn, and
for ssl.enabled a kNN on data.val's labels (fastclip/train/ssl.py). Each logs one metrics record "eval/..."."""

from __future__ import annotations

from pathlib import Path

import torch

from fastclip.train.config import Config
from fastclip.train.errors import TrainingError
from fastclip.train.metrics import MetricsLogger, eval_line


class Evaluation:
    """The evaluations of one run: its towers, loss and engine (net: build_net's), device and logger."""

    def __init__(self, cfg: Config, net, device: torch.device, log: MetricsLogger):
        self.cfg, self.net, self.device, self.log = cfg, net, device, log
        self._imagenet = None  # (class names spec, file list source) for eval.imagenet_val, made at its first use

    def evaluate(self, step: int, samples_seen: int) -> None:
        """data.val (zero-shot and retrieval) and eval.imagenet_val (zero-shot), on every rank, under the run's
        autocast, as OpenCLIP evaluates. The global random states the rank files save (Python's, numpy's, torch's
        and the GPU's generators) are put back after it: the first linear probe's imports drew from Python's, an
        ImageNet DataLoader pass from torch's, so a run that evaluated saved other RNG states than one that did not."""
        from fastclip.checkpoint.rng import capture_rng_states, restore_rng_states

        states = capture_rng_states(self.device)  # what the rank files save (RNGStates)
        try:
            self._evaluate(step, samples_seen)
        finally:
            restore_rng_states(states, self.device)

    def _evaluate(self, step: int, samples_seen: int) -> None:
        cfg = self.cfg
        if cfg.data.val is None and cfg.eval.imagenet_val is None:
            return
        from fastclip.eval import EvalDataError, run_evals

        if cfg.ssl.enabled:  # images alone: kNN on data.val's labels (fastclip/train/ssl.py)
            return self._knn_evaluate(step, samples_seen)
        built = self.net.built
        amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision)
        results, what = {}, ""
        with self.net.engine.full_params(), torch.autocast(self.device.type, dtype=amp, enabled=amp is not None):
            try:  # ZeRO-3: whole parameters for the evaluation
                if cfg.data.val is not None:
                    what = f"data.val {cfg.data.val}, data.zeroshot {cfg.data.zeroshot}"
                    results = run_evals(
                        self.net.model,
                        tokenizer=built.tokenizer,
                        preprocess=built.preprocess_val,
                        val_dir=cfg.data.val,
                        zeroshot_file=cfg.data.zeroshot,
                        device=self.device,
                        batch_size=cfg.eval.batch_size,
                        max_samples=cfg.eval.max_samples,
                        loss_fn=self.net.loss_fn if cfg.eval.val_loss else None,
                        loss_batch_size=cfg.data.batch_size,
                        probe=self._training_probe(),
                    )
                if cfg.eval.imagenet_val is not None:
                    what = f"eval.imagenet_val {cfg.eval.imagenet_val}"
                    results.update(self._imagenet_zeroshot())
            except EvalDataError as e:  # the same on every rank (the same files); checkpoints are already written
                raise TrainingError(f"evaluation at step {step}: {e} ({what})") from None
        record = {"step": step, "samples_seen": samples_seen}
        record.update({f"eval/{k}": v for k, v in results.items() if isinstance(v, (int, float))})
        self.log.log(record, eval_line(record))

    def _training_probe(self):
        """eval.linear_probe / eval.knn's settings for run_evals (None: off)."""
        e = self.cfg.eval
        if not (e.linear_probe or e.knn):
            return None
        from fastclip.eval.samples import held_out_folder
        from fastclip.eval.training_probe import TrainingProbe, probe_train_beside

        return TrainingProbe(
            train_source=e.probe_train or str(probe_train_beside(self.cfg.data.val)),
            linear=e.linear_probe,
            ks=tuple(sorted(set(e.knn))),
            max_train=e.probe_max_train,
            unnamed=(held_out_folder(self.cfg.data.val) or Path("val")).name,
        )

    def _knn_evaluate(self, step: int, samples_seen: int) -> None:
        from fastclip.eval import EvalDataError
        from fastclip.train.ssl import knn_evaluate, probe_evaluate

        preprocess, probe = self.net.built.preprocess_val, self._training_probe()
        with self.net.engine.full_params():
            try:
                results = knn_evaluate(self.net.model, preprocess, self.cfg.data.val, self.device, self.cfg)
                if probe is not None:  # eval.linear_probe / eval.knn, on the same tower features
                    results.update(probe_evaluate(self.net.model, preprocess, probe, self.device, self.cfg))
            except EvalDataError as e:
                raise TrainingError(f"evaluation at step {step}: {e} (data.val {self.cfg.data.val})") from None
        record = {"step": step, "samples_seen": samples_seen}
        record.update({f"eval/{k}": v for k, v in results.items()})
        self.log.log(record, eval_line(record))

    def _imagenet_zeroshot(self) -> dict[str, float]:
        from fastclip.eval.evaluate import evaluate
        from fastclip.eval.imagenet import ImageNetSource, prepared, read_variant

        cfg = self.cfg
        if self._imagenet is None:  # the class names, templates and file list, kept for the later evaluations
            source = ImageNetSource(
                cfg.eval.imagenet_val,
                self.net.built.preprocess_val,
                workers=cfg.data.workers,
                batch_size=cfg.eval.batch_size,
            )
            # all 1,000, a variant's subset (ImageNet-R, -A), or ObjectNet's overlap with ImageNet
            self._imagenet = (read_variant(cfg.eval.imagenet_val, cfg.eval.imagenet_templates)[0], source)
        spec, source = self._imagenet
        results = evaluate(
            self.net.model,
            tokenizer=self.net.built.tokenizer,
            preprocess=prepared,
            source=source,
            specs={spec.name: spec},
            device=self.device,
            batch_size=cfg.eval.batch_size,
            retrieval=False,
        )
        flat = results.flat()
        if "skipped_samples" in flat:  # beside data.val's own count
            flat[f"zeroshot/{spec.name}/skipped_samples"] = flat.pop("skipped_samples")
        return flat
