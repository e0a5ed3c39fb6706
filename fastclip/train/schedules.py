"""The learning-rate schedules of a run: the towers' lr and the temperature group's, set on the engine's parameter
groups before every step (fastclip/optim holds the schedule functions)."""

from __future__ import annotations

from fastclip.optim import ThresholdRule, get_lr, get_tau_lr
from fastclip.train.config import Config


class Schedules:
    """The lr of the towers and of the temperature group, as functions of samples seen. A schedule step is `unit`
    samples: the global batch the run began with, kept by its checkpoints, so that a resume at another world size
    or batch size goes on with the same lr at the same sample (optim.warmup_steps and the span count such steps);
    in a run that never changes its layout it is the step count. The step_thresh rule (optim.ThresholdRule) scales
    the temperature's step on device."""

    def __init__(self, cfg: Config, engine, *, epoch_length: int, global_batch: int):
        self.o, self.engine, self.global_batch = cfg.optim, engine, global_batch
        self.epochs, self.epoch_length = cfg.train.epochs, epoch_length
        self.total_steps = self.span(global_batch)
        self.unit = global_batch  # samples per schedule step (load_state_dict: the run's first global batch)
        self.thresh = ThresholdRule(
            engine.tau_params if self.o.lr_tau_schedule == "step_thresh" else [],
            threshold=self.o.tau_threshold,
            factor=self.o.tau_threshold_factor,
        )
        self.lr, self.lr_tau = 0.0, 0.0  # the last step's values

    def span(self, unit: int) -> int:
        """The epochs' span in steps of `unit` samples (each epoch's last batch filled, as the data layer serves
        it)."""
        return self.epochs * -(-self.epoch_length // unit)

    def position(self, samples_seen: int) -> int:
        """The schedule step at `samples_seen`."""
        return samples_seen // self.unit

    def apply(self, samples_seen: int) -> None:
        o, at = self.o, self.position(samples_seen)
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

    def state_dict(self) -> dict:
        """Their unit and span (in schedule steps), and the last values (for reading)."""
        return {
            "unit": self.unit,
            "total_steps": self.total_steps,
            "global_batch": self.global_batch,
            "lr": self.lr,
            "lr_tau": self.effective_lr_tau(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Keep the checkpoint's unit (one saved before units were: its global batch; none saved: this run's) and
        count the epochs' span in it: unchanged where the layout is."""
        saved = state if isinstance(state, dict) else {}
        unit = int(saved.get("unit", saved.get("global_batch", self.unit)))
        if unit != self.unit:
            self.unit, self.total_steps = unit, self.span(unit)
