"""A loss of the user's own (``loss.name module:attribute``, tests/user_losses/margin_infonce.py): the library
builds it exact on any number of ranks, the trainer trains, checks, checkpoints and resumes it as its own, every
mistake in naming it is one line, and the study runs it and notices when its file changes."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fastclip.losses import UnknownLossError, build_loss
from fastclip.train.cli import main

from dist_utils import run_distributed
from helpers import EMBEDDED, REPO, assert_same_training_state, one_line_error, overrides, records

USER_LOSSES = Path(__file__).resolve().parent / "user_losses"
NAME = "margin_infonce:MARGIN_INFONCE"
TOL = dict(rtol=1e-10, atol=1e-10)


@pytest.fixture(autouse=True)
def user_path(monkeypatch):
    monkeypatch.syspath_prepend(str(USER_LOSSES))


def _features(n: int, d: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    image = F.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=1)
    text = F.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=1)
    return image, text


def _reference(image, text, margin: float, logit_scale: torch.Tensor) -> torch.Tensor:
    """The margin InfoNCE written out in float64: both directions' cross-entropy with the positive's logit
    lowered by s·m."""
    s = logit_scale.exp()
    logits = s * image @ text.T
    logits = logits - s * margin * torch.eye(len(image), dtype=logits.dtype)
    labels = torch.arange(len(image))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def test_a_users_loss_has_the_gradients_of_its_formula():
    image, text = _features(8)
    for margin in (0.0, 0.3):
        loss_fn = build_loss(NAME, margin=margin, temperature=0.1).double()
        x, y = image.clone().requires_grad_(), text.clone().requires_grad_()
        loss = loss_fn(x, y, torch.arange(8))
        loss.backward()
        xr, yr = image.clone().requires_grad_(), text.clone().requires_grad_()
        scale = loss_fn.logit_scale.detach().clone().requires_grad_()  # ln 10, as the loss stored it
        ref = _reference(xr, yr, margin, scale)
        ref.backward()
        torch.testing.assert_close(loss.detach(), ref.detach(), **TOL)
        torch.testing.assert_close(x.grad, xr.grad, **TOL)
        torch.testing.assert_close(y.grad, yr.grad, **TOL)
        torch.testing.assert_close(loss_fn.logit_scale.grad, scale.grad, **TOL)
    with torch.no_grad():  # the option reaches the loss
        higher, lower = (build_loss(NAME, margin=m)(image, text, torch.arange(8)) for m in (0.3, 0.0))
        assert higher > lower


def _ranks_run(rank, world_size):
    sys.path.insert(0, str(USER_LOSSES))  # (the processes fork from a server started before this test's path)
    image, text = _features(8, seed=1)
    rows = slice(rank * 4, rank * 4 + 4)
    loss_fn = build_loss(NAME, margin=0.2, temperature=0.07, validate="eager").double()
    x, y = image[rows].clone().requires_grad_(), text[rows].clone().requires_grad_()
    loss = loss_fn(x, y, torch.arange(8)[rows])
    loss.backward()
    for p in loss_fn.parameters():  # as DDP would
        torch.distributed.all_reduce(p.grad)
        p.grad /= world_size
    return {"loss": loss.detach(), "image": x.grad, "text": y.grad, "scale": loss_fn.logit_scale.grad}


def test_a_users_loss_is_exact_on_two_ranks():
    """Each rank's features get K·∂L/∂x_r, K the ranks: DDP's average over the ranks of their towers' gradients
    is then the one-process gradient (the library's contract); the loss's own τ gets the ranks' mean."""
    image, text = _features(8, seed=1)
    loss_fn = build_loss(NAME, margin=0.2, temperature=0.07).double()
    x, y = image.clone().requires_grad_(), text.clone().requires_grad_()
    loss = loss_fn(x, y, torch.arange(8))
    loss.backward()
    ranks = run_distributed(_ranks_run, 2)
    for r, got in enumerate(ranks):
        rows = slice(r * 4, r * 4 + 4)
        torch.testing.assert_close(got["loss"], loss.detach(), **TOL)
        torch.testing.assert_close(got["image"], 2 * x.grad[rows], **TOL)
        torch.testing.assert_close(got["text"], 2 * y.grad[rows], **TOL)
        torch.testing.assert_close(got["scale"], loss_fn.logit_scale.grad, **TOL)


def _train(data, run, name, steps=3, **extra):
    settings = {"train.max_steps": steps, "loss.rho": "null", "loss.gamma_min": "null",
                "loss.gamma_decay_epochs": "null", "loss.gamma_schedule": "null", **extra}  # fmt: skip
    return main(["--config", str(EMBEDDED), *overrides(data, run, name, **settings)])


def test_the_trainer_trains_a_users_loss_as_the_library_loss_it_equals(tiny_embedded, tmp_path):
    """At margin 0 and a fixed τ the user's loss is InfoNCE: the same run as openclip's (autograd) step for step;
    at margin 0.3 every step's loss is higher; the checkpoint records the options."""
    fixed = {"loss.temperature": 0.07, "loss.learn_temperature": False}
    assert _train(tiny_embedded, tmp_path / "openclip", "openclip", **fixed, **{"loss.impl": "autograd"}) == 0
    assert _train(tiny_embedded, tmp_path / "m0", NAME, **fixed, **{"loss.extra_options.margin": 0.0}) == 0
    assert _train(tiny_embedded, tmp_path / "m3", NAME, **fixed, **{"loss.extra_options.margin": 0.3}) == 0
    base, m0, m3 = ([r["loss"] for r in records(tmp_path / n) if "loss" in r] for n in ("openclip", "m0", "m3"))
    assert len(base) == 3 and m0 == pytest.approx(base, rel=1e-6, abs=0)
    assert all(a > b + 0.1 for a, b in zip(m3, m0))
    saved = torch.load(tmp_path / "m3" / "checkpoints" / "step_00000003" / "model.pt", weights_only=True)
    assert saved["config"]["loss"]["name"] == NAME and saved["config"]["loss"]["extra_options"] == {"margin": 0.3}


def test_a_users_loss_resumes_bitwise(tiny_embedded, tmp_path):
    """A learned τ: 4 steps straight, and 2 then a resume to 4, end with the same towers and τ, bitwise."""
    opts = {"loss.extra_options.margin": 0.2, "checkpoint.every_steps": 2}
    assert _train(tiny_embedded, tmp_path / "straight", NAME, steps=4, **opts) == 0
    assert _train(tiny_embedded, tmp_path / "split", NAME, steps=2, **opts) == 0
    assert _train(tiny_embedded, tmp_path / "split", NAME, steps=4, **opts, **{"train.resume": "latest"}) == 0
    steps = [tmp_path / n / "checkpoints" / "step_00000004" for n in ("straight", "split")]
    assert_same_training_state(*steps, world_size=1)
    end = torch.load(steps[0] / "model.pt", weights_only=True)
    assert float(end["loss"]["logit_scale"]) != pytest.approx(math.log(1 / 0.07), abs=1e-6)  # τ trained


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--loss.name", "no_such_module:X"], ["loss.name", "no module 'no_such_module'", "PYTHONPATH"]),
        (["--loss.name", "margin_infonce:NOPE"], ["loss.name", "has no 'NOPE'", "margin_infonce.py"]),
        (["--loss.name", "margin_infonce:MarginOptions"], ["the class MarginOptions", "not a fastclip.losses.Loss"]),
        (["--loss.name", "margin_infonce"], ["loss.name", "is not one of", "module:attribute"]),
        (["--loss.name", "margin_infonce:"], ["loss.name", "is not one of", "module:attribute"]),
        (["--loss.name", "my-losses:X"], ["loss.name", "is not one of", "module:attribute"]),
        (["--loss.name", "dcl", "--loss.extra_options.margin", "0.1"], ["loss.extra_options", "a loss of your own"]),
        (["--loss.extra_options.marginn", "0.1"], ["loss.extra_options.marginn", "does not take it",
                                                    "loss.extra_options.margin)"]),
        (["--loss.extra_options.margin", "2"], ["'loss.extra_options.margin'", "must be a number in [0, 1)"]),
        (["--loss.extra_options.temperature", "0.1"], ["loss.temperature is a key of its own"]),
        (["--loss.extra_options.data_size", "3"], ["loss.extra_options.data_size", "the trainer sets it"]),
        (["--loss.extra_options", "5"], ["'loss.extra_options'", "expected a mapping"]),
        # an option of the library's losses that this objective does not implement: refused, not ignored
        (["--loss.hard_negative_topk", "4"], ["loss.hard_negative_topk", "does not take it"]),
    ],
)  # fmt: skip
def test_every_mistake_in_naming_a_users_loss_is_one_line(tiny_embedded, tmp_path, capsys, args, words):
    base = overrides(tiny_embedded, tmp_path / "run", NAME, **{"loss.rho": "null", "loss.gamma_min": "null",
                     "loss.gamma_decay_epochs": "null", "loss.gamma_schedule": "null"})  # fmt: skip
    for check in (["--check"], []):
        one_line_error(capsys, main, ["--config", str(EMBEDDED), *base, *args, *check], *words)
    assert not (tmp_path / "run").exists()


def test_a_users_module_that_fails_to_import_is_named_with_its_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "broken_loss.py").write_text("import math\n\nraise RuntimeError('half written')\n")
    (tmp_path / "needs_more.py").write_text("import not_installed_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UnknownLossError, match=r"RuntimeError: half written \(.*broken_loss.py:3\)"):
        build_loss("broken_loss:X")
    # a module the user's module needs, missing: named as that, not as the user's module
    with pytest.raises(UnknownLossError, match="importing 'needs_more' failed: ModuleNotFoundError.*not_installed"):
        build_loss("needs_more:X")


def test_torchrun_trains_a_users_loss_on_two_ranks(tiny_embedded, tmp_path):
    """Every rank imports the user's module from PYTHONPATH and the pair blocks carry its gradient to every
    owner: a 2-process run trains, and its rank files and checkpoint are written."""
    run = tmp_path / "run"
    args = overrides(tiny_embedded, run, NAME, **{"train.max_steps": 2, "loss.rho": "null", "loss.gamma_min": "null",
                     "loss.gamma_decay_epochs": "null", "loss.gamma_schedule": "null",
                     "loss.extra_options.margin": 0.2})  # fmt: skip
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=f"{USER_LOSSES}:{REPO}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "fastclip", "train", "--", "--config", str(EMBEDDED), *args]  # fmt: skip
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"fastclip train: {NAME}," in out.stdout
    recs = [r for r in records(run) if "loss" in r]
    assert [r["step"] for r in recs] == [1, 2] and all(math.isfinite(r["loss"]) for r in recs)
    step = run / "checkpoints" / "step_00000002"
    assert sorted(p.name for p in step.iterdir()) == ["model.pt", "rank_0.pt", "rank_1.pt"]


def test_the_study_runs_a_users_loss_and_an_edit_of_its_file_makes_its_runs_stale(tmp_path, monkeypatch, tiny_embedded):
    monkeypatch.syspath_prepend(str(REPO))
    from test_study import write_spec

    from benchmarks.study import runner
    from benchmarks.study.spec import SpecError, load

    folder = tmp_path / "mine"
    folder.mkdir()
    source = (USER_LOSSES / "margin_infonce.py").read_text()
    (folder / "my_margin.py").write_text(source)
    monkeypatch.syspath_prepend(str(folder))
    path = write_spec(tmp_path)
    raw = json.loads(path.read_text())
    raw["objectives"]["base2"] = {
        "loss": "my_margin:MARGIN_INFONCE",
        "baseline": True,
        "grid": {"optim.lr": [1e-3, 5e-4], "loss.extra_options.margin": [0.1, 0.2]},
    }
    path.write_text(json.dumps(raw))  # fmt: skip
    spec = load(path)
    run = next(r for r in runner.plan(spec) if r.objective == "base2")
    cmd = runner.command(spec, run, tiny_embedded)
    assert cmd[cmd.index("--loss.name") + 1] == "my_margin:MARGIN_INFONCE"
    assert cmd[cmd.index("--loss.extra_options.margin") + 1] in ("0.1", "0.2")
    before = runner.deciding_args(cmd)
    assert before["loss.source"] == runner.loss_source("my_margin:MARGIN_INFONCE")
    (folder / "my_margin.py").write_text(source.replace("margin: float = 0.1", "margin: float = 0.15"))
    runner.loss_source.cache_clear()
    assert runner.deciding_args(cmd)["loss.source"] != before["loss.source"]  # other settings: the run is stale
    raw["objectives"]["base2"]["loss"] = "my_margin:NOT_THERE"
    path.write_text(json.dumps(raw))
    with pytest.raises(SpecError, match=r"objectives.base2.loss.*has no 'NOT_THERE'"):
        load(path)


MODULES = {  # the user's modules that go wrong in the ways a user's would
    "broken_loss.py": "import math\n\nraise RuntimeError('half written')\n",
    "needs_more.py": "import not_installed_dependency\n",
    "exits.py": "import sys\n\nsys.exit('no GPU here')\n",
    "lazy.py": "def __getattr__(name):\n    raise RuntimeError('lazy attribute failed')\n",
    "uses_library.py": "from fastclip.losses import build_loss\n\nBASE = build_loss('openclip', temperature=-1)\n",
    "odd.py": """
from dataclasses import dataclass

from fastclip.losses import LossEntry
from fastclip.losses.dcl import DCLLoss
from fastclip.losses.options import CommonOptions, InfoNCEOptions


@dataclass
class NotFrozen(InfoNCEOptions):
    margin: float = 0.1
""",
    "kinds.py": """
from dataclasses import dataclass

from fastclip.losses import LossEntry
from fastclip.losses.dcl import DCLLoss
from fastclip.losses.individual import FastCLIPV2Autograd, FastCLIPV2Loss
from fastclip.losses.options import IndividualTemperatureOptions, InfoNCEOptions, TempNetOptions
from fastclip.losses.tempnet import TempNetAutograd, TempNetLoss


@dataclass(frozen=True)
class Asserting(InfoNCEOptions):
    margin: float = 0.1

    def __post_init__(self):
        super().__post_init__()
        assert self.margin < 1, "margin must be below 1"


@dataclass(frozen=True)
class BoolBias(InfoNCEOptions):
    bias: bool = False


@dataclass(frozen=True)
class Bounded(InfoNCEOptions):
    margin: float = 0.1

    def __post_init__(self):
        super().__post_init__()
        if self.margin >= BOUND:  # (a test lowers BOUND: the user's file edited between a run and its resume)
            raise ValueError(f"margin must be below {BOUND}")


@dataclass(frozen=True)
class OwnNames(InfoNCEOptions):
    learn_bias: bool = True  # the library's siglip has one, LIBRARY_ONLY there; an option of its own here
    hard_negative_topk: int = 0  # narrower than the trainer's int | None key, which passes no null


@dataclass(frozen=True)
class NamedName(InfoNCEOptions):
    name: str = "x"


BOUND = 1.0
ASSERTING = LossEntry(Asserting, autograd=DCLLoss)
BOUNDED = LossEntry(Bounded, autograd=DCLLoss)
OWN_NAMES = LossEntry(OwnNames, autograd=DCLLoss)
NAMED_NAME = LossEntry(NamedName, autograd=DCLLoss)
LOSS_INSTANCE = LossEntry(InfoNCEOptions, autograd=DCLLoss(InfoNCEOptions()))
PLAIN = LossEntry(InfoNCEOptions, autograd=DCLLoss)
BOOL_BIAS = LossEntry(BoolBias, autograd=DCLLoss)
INSTANCE = LossEntry(Asserting(), autograd=DCLLoss)
MY_V2 = LossEntry(IndividualTemperatureOptions, FastCLIPV2Loss, FastCLIPV2Autograd)
MY_TEMPNET = LossEntry(TempNetOptions, TempNetLoss, TempNetAutograd)
""",
}


@pytest.fixture
def modules(tmp_path, monkeypatch):
    folder = tmp_path / "modules"
    folder.mkdir()
    for name, text in MODULES.items():
        (folder / name).write_text(text)
    monkeypatch.syspath_prepend(str(folder))
    return folder


def test_a_users_module_that_goes_wrong_is_one_line_naming_its_own_line(modules, capsys):
    """Each says what failed and where in the user's file (not the standard library's line the error surfaced
    at); an exit at import, a module __getattr__ that raises, an options instance and an option typed unlike the
    trainer's key of that name are one line too (they were tracebacks, or a message pointing elsewhere)."""
    cases = {
        "broken_loss:X": rf"RuntimeError: half written \({modules}/broken_loss.py:3\)",
        "needs_more:X": r"importing 'needs_more' failed: ModuleNotFoundError.*not_installed_dependency",
        "exits:X": rf"importing 'exits' failed: it exited \(no GPU here\) \({modules}/exits.py:3\)",
        "lazy:X": rf"reading 'X' of 'lazy' failed: RuntimeError: lazy attribute failed \({modules}/lazy.py:2\)",
        "odd:X": rf"cannot inherit non-frozen dataclass from a frozen one \({modules}/odd.py:9\)",
        "kinds:INSTANCE": r"must be a dataclass class \(options=YourOptions\), got an instance of Asserting",
        "kinds:BOOL_BIAS": r"option 'bias' of BoolBias is <class 'bool'>, but the trainer's loss.bias is",
        # an error that surfaces in fastclip (or torch): at the user's line that called it
        "uses_library:X": rf"temperature must be .*\({modules}/uses_library.py:3\)",
        "kinds:LOSS_INSTANCE": r"must be a fastclip.losses.ContrastiveLoss subclass .*got an instance of DCLLoss$",
        "kinds:NAMED_NAME": r"option 'name' of NamedName: loss.name is the trainer's own key \(it names the loss\)",
    }
    for name, words in cases.items():
        with pytest.raises(UnknownLossError, match=words):
            build_loss(name)
        assert main(["--check", "--loss.name", name]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err and "config key 'loss.name'" in err, err
    # an assert in the user's options: one line with the assertion's words, as a refused value is
    assert main(["--check", "--loss.name", "kinds:ASSERTING", "--loss.extra_options.margin", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("AssertionError: margin must be below 1") and len(err.splitlines()) == 1, err


def test_options_the_trainer_derives_are_given_by_option_not_by_loss_name(modules):
    """A loss of the user's own on per-sample temperatures gets optim.lr_tau, one with a temperature network the
    towers' embed_dim, as fastclip-v2 and fastclip-tempnet do (chosen by name, they got neither: lr_tau silently its
    default, embed_dim a contradiction between 'required' and 'the trainer sets it')."""
    from fastclip.train.config import load_config
    from fastclip.train.net import check_loss

    cfg = load_config(EMBEDDED, ["--loss.name", "kinds:MY_V2", "--optim.lr_tau", "0.05", "--loss.rho", "7.0"])
    assert check_loss(cfg, 10).options.lr_tau == 0.05
    cfg = load_config(EMBEDDED, ["--loss.name", "kinds:MY_TEMPNET", "--loss.rho", "7.0"])
    assert check_loss(cfg, 10).options.embed_dim == 64  # the tiny-vit's


def test_a_resume_that_drops_or_adds_an_extra_option_says_so():
    from fastclip.train.config import load_config
    from fastclip.train.preflight import changed_on_resume_note

    base = ["--loss.name", NAME, "--loss.rho", "null", "--loss.gamma_min", "null", "--loss.gamma_decay_epochs", "null",
            "--loss.gamma_schedule", "null"]  # fmt: skip
    with_margin = load_config(EMBEDDED, [*base, "--loss.extra_options.margin", "0.3"])
    without = load_config(EMBEDDED, base)
    said = "resumed with settings the checkpoint was not trained with: loss.extra_options.margin"
    assert said + " 0.3 -> 0.1" in changed_on_resume_note(without, with_margin.to_dict())
    assert said + " 0.1 -> 0.3" in changed_on_resume_note(with_margin, without.to_dict())
    assert (
        changed_on_resume_note(without, load_config(EMBEDDED, [*base, "--loss.extra_options.margin", "0.1"]).to_dict())
        is None
    )


def test_another_loss_name_over_a_file_leaves_out_the_files_extra_options_it_does_not_take(modules, tmp_path, capsys):
    from fastclip.train.config import load_config

    path = tmp_path / "margin.yaml"
    path.write_text(f"loss:\n  name: {NAME}\n  temperature: 0.05\n  extra_options: {{margin: 0.25}}\n")
    cfg = load_config(path, ["--loss.name", "kinds:PLAIN"])
    assert cfg.loss.extra_options == {} and cfg.loss.temperature == 0.05
    said = f"sets loss.extra_options.margin for {NAME}, which kinds:PLAIN does not take: left out"
    assert said in capsys.readouterr().err
    cfg = load_config(path, ["--loss.name", "kinds:ASSERTING"])  # another loss with a margin: kept
    assert cfg.loss.extra_options == {"margin": 0.25} and "left out" not in capsys.readouterr().err


def test_the_studys_source_hash_covers_a_package_whose_init_imports_the_loss(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    from benchmarks.study import runner

    package = tmp_path / "pkg" / "my_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from .core import MARGIN_INFONCE\n")
    source = (USER_LOSSES / "margin_infonce.py").read_text()
    (package / "core.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path / "pkg"))
    from fastclip.losses import user

    installed = user.installed_roots()  # the package as if pip-installed: among the installed roots
    monkeypatch.setattr(user, "installed_roots", lambda: installed | {(tmp_path / "pkg").resolve()})
    before = runner.loss_source("my_pkg:MARGIN_INFONCE")
    (package / "core.py").write_text(source.replace("margin: float = 0.1", "margin: float = 0.4"))
    runner.loss_source.cache_clear()
    assert runner.loss_source("my_pkg:MARGIN_INFONCE") != before


def test_options_of_a_users_own_are_settable_whatever_the_library_calls_its_own(modules):
    """An option the library marks LIBRARY_ONLY in one of its losses (siglip's learn_bias) is the user's to set when
    their class has it as a plain field; one narrower than the trainer's key (int for int | None) is accepted."""
    from fastclip.train.config import load_config
    from fastclip.train.net import check_loss

    cfg = load_config(EMBEDDED, ["--loss.name", "kinds:OWN_NAMES", "--loss.extra_options.learn_bias", "false",
                                 "--loss.hard_negative_topk", "3", "--loss.rho", "null"])  # fmt: skip
    options = check_loss(cfg, 10).options
    assert options.learn_bias is False and options.hard_negative_topk == 3


def test_a_resume_whose_saved_options_the_users_class_now_refuses_is_a_note_not_a_traceback(modules):
    """The user's options class changed between the run and its resume (here: a lower bound) so the saved config
    no longer resolves: both sides are compared as written, and only what changed is said."""
    import kinds

    from fastclip.train.config import load_config
    from fastclip.train.preflight import changed_on_resume_note

    base = ["--loss.name", "kinds:BOUNDED", "--loss.rho", "null", "--loss.gamma_min", "null",
            "--loss.gamma_decay_epochs", "null", "--loss.gamma_schedule", "null"]  # fmt: skip
    saved = load_config(EMBEDDED, [*base, "--loss.extra_options.margin", "0.5"]).to_dict()
    kinds.BOUND = 0.4
    try:
        now = load_config(EMBEDDED, [*base, "--loss.extra_options.margin", "0.3"])
        note = changed_on_resume_note(now, saved)
    finally:
        kinds.BOUND = 1.0
    assert note.endswith("not trained with: loss.extra_options.margin 0.5 -> 0.3"), note


def test_an_empty_extra_options_mapping_in_a_file_is_no_left_out_note(tmp_path, capsys):
    from fastclip.train.config import load_config

    path = tmp_path / "margin.yaml"
    path.write_text(f"loss:\n  name: {NAME}\n  extra_options: {{}}\n")
    load_config(path, ["--loss.name", "openclip"])
    assert "left out" not in capsys.readouterr().err
