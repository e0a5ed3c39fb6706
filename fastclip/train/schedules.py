"""The learning-rate schedules of a run: the towers' lr and the temperature group's, set on the engine's parameter
groups before every step (fastclip/optim holds the schedule functions)."""

from __future__ import annotations

from fastclip.optim import ThresholdRule, get_lr, get_tau_lr
from fastclip.train.config import Config


class Schedules:
    """The lr of the towers and of the temperature group. They run on samples seen, counted in global batches
    of the current run: equal to the step count, and still the right place in the schedule after a resume at
    another world size. The step_thresh rule (optim.ThresholdRule) scales the temperature's step on device."""

    def __init__(self, cfg: Config, engine, *, total_steps: int, global_batch: int):
        self.o, self.engine, self.total_steps, self.global_batch = cfg.optim, engine, total_steps, global_batch
        self.thresh = ThresholdRule(
            engine.tau_params if self.o.lr_tau_schedule == "step_thresh" else [],
            threshold=self.o.tau_threshold,
            factor=self.o.tau_threshold_factor,
        )
        self.lr, self.lr_tau = 0.0, 0.0  # the last step's values

    def apply(self, samples_seen: int) -> None:
        o, at = self.o, samples_seen // self.global_batch
        self.lr = get_lr(
            at,
            base_lr=o.lr,
            warmup_steps=o.warmup_steps,
            total_steps=self.total_steps,
            lr_min=o.lr_min,
            kind=o.lr_schedule,
        )
        self.lr_tau = get_tau_lr(
            at,
            lr_tau=o.base_lr_tau,
            kind=o.lr_tau_schedule,
            warmup_steps=o.warmup_steps,
            total_steps=self.total_steps,
            lr_tau_min=o.lr_tau_min,
        )
        for g in self.engine.param_groups:
            g["lr"] = self.lr_tau if g["name"] == "temperature" else self.lr

    def effective_lr_tau(self) -> float:
        return self.lr_tau * self.thresh.factor_now()

    def state(self) -> dict:
        """Their horizon and last values, for reading (they are pure functions of samples_seen)."""
        return {
            "total_steps": self.total_steps,
            "global_batch": self.global_batch,
            "lr": self.lr,
            "lr_tau": self.effective_lr_tau(),
        }
