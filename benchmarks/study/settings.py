"""Whether `fastclip train` takes a run's settings: the trainer's own parser and checks, without starting it.

`check_settings` (run, before any run starts) passes every grid setting through them; `config_problem` is the same
for one setting, as the plan asks before it steps past a grid's edge (a value the config refuses is no step:
ema_momentum 0.999 -> 1.003 would fail every attempt, and its cell would never have a choice)."""

from __future__ import annotations

import json
from pathlib import Path

from . import records
from .spec import Spec, SpecError, resolve_setting, setting_id


def arch_arg(arch: str) -> str:
    """A model config path as the runs read it: relative to the repository root, where they run."""
    return str(records.REPO / arch) if arch.endswith(".json") and not Path(arch).is_absolute() else arch


def value_arg(v) -> str:
    """A config value as `fastclip train` parses it (YAML)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, (list, dict)):
        return json.dumps(v)
    return str(v)


_CHECKED: dict[tuple, str | None] = {}


def config_problem(spec: Spec, objective: str, batch: int, setting: dict, dataset: str) -> str | None:
    """What the trainer says against `setting` of `objective` at `batch` on `dataset` (the common keys, the
    objective's options, its loss and the data's arch with it), or None when it takes them."""
    from fastclip.train.config import ConfigError, load_config
    from fastclip.train.net import check_loss
    from fastclip.train.preflight import check_arch

    o = spec.objectives[objective]
    keys = {
        **spec.train,
        **resolve_setting(o.options, batch),
        **resolve_setting(setting, batch),
        "loss.name": o.loss,
        "model.arch": arch_arg(spec.datasets[dataset].arch),
        "data.batch_size": batch,
        "train.device": spec.device,
    }
    args = tuple(x for k, v in keys.items() for x in (f"--{k}", value_arg(v)))
    if args not in _CHECKED:
        try:
            cfg = load_config(None, list(args))
            check_arch(cfg)
            check_loss(cfg, data_size=2 * batch)
            _CHECKED[args] = None
        except (ConfigError, ValueError) as error:
            _CHECKED[args] = str(error)
    return _CHECKED[args]


def check_settings(spec: Spec) -> None:
    """Every grid setting of every objective at each batch it runs at, on every dataset, through config_problem:
    a misspelt key or a value the trainer refuses is one line now, not two failed attempts of every run. A key taken
    from another objective's choice is checked at that objective's first value."""
    for batch in spec.batches:
        for name in spec.objectives_at(batch):
            objective = spec.objectives[name]
            stand_in = {k: spec.objectives[src].settings(batch)[0][k] for k, src in objective.from_choice.items()}
            for setting in objective.settings(batch):
                for dataset in spec.datasets:
                    if problem := config_problem(spec, name, batch, {**setting, **stand_in}, dataset):
                        where = f"objectives.{name} at batch {batch}, {setting_id(setting)}, datasets.{dataset}"
                        raise SpecError(f"{spec.path}: {where}: {problem}")
