"""LiT tower locking (model.lock_image / model.lock_text, OpenCLIP's --lock-image, --lock-text ...) end to end: a
locked tower's parameters stay bitwise at their start (random init or --model.pretrained's), the other tower trains,
the optimizer holds no state for the locked ones; open_clip's groups; frozen BatchNorm statistics; 1 process = 2
processes, and DDP = DeepSpeed ZeRO-2/3, with a locked tower; exact resume, and a resume with other lock settings
refused; OpenCLIP's flags; what a tower cannot take is one line, exit 2, by `--check` too.

Short runs in this process (tiny-vit, tiny-vit-hf and a tiny ModifiedResNet written here, a few steps of 8 samples)
and one 2-process spawn for every multi-process run."""

from __future__ import annotations

import contextlib
import functools
import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fastclip.train.cli import main
from fastclip.train.config import load_config

from dist_utils import run_distributed
from helpers import (
    EMBEDDED,
    assert_same,
    assert_same_training_state,
    load,
    overrides,
    removed_unless_failed,
    step_dir,
    the_error_line,
    train_records,
)

REPO = Path(__file__).resolve().parents[1]
STEPS = 4  # checkpoints at 2 and 4
TEXT_CFG = json.loads((REPO / "configs" / "models" / "tiny-vit.json").read_text())["text_cfg"]
# open_clip's ModifiedResNet (RN50's kind: BatchNorm layers, attention pooling), as small as it goes
TINY_RN = {"embed_dim": 64, "vision_cfg": {"image_size": 32, "layers": [1, 1, 1, 1], "width": 16}, "text_cfg": TEXT_CFG}
IMAGE = "model.lock_image"
TEXT = {"model.lock_text": "true", "model.lock_text_freeze_layer_norm": "true"}
MOMENTUM = {"model.ema_momentum": 0.9}  # an EMA copy of the towers: its locked part must stay as the towers'


def args(data, run, **extra) -> list[str]:
    return ["--config", str(EMBEDDED), *overrides(data, run, **{"train.max_steps": STEPS, **extra})]


def trained(argv: list[str]) -> str:
    """Run `fastclip train ARGV` here; its stdout (the start line)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(argv)
    assert status == 0, out.getvalue()[-3000:]
    return out.getvalue()


def initial_towers(argv: list[str]) -> dict:
    """The towers a run of ARGV starts from with random init: built as build_net builds them (seeded by train.seed)."""
    from fastclip.train.net import build_towers, seed_all

    cfg = load_config(EMBEDDED, argv[2:])
    seed_all(cfg.train.seed)
    return build_towers(cfg).model.state_dict()


def saved_model(arch: str, path: Path, seed: int, batch_norm_stats: bool = False) -> Path:
    """A state dict of `arch` (another seed than the runs'): what --model.pretrained starts a run from. With
    batch_norm_stats, BatchNorm statistics and step counters as a trained tower has them."""
    from fastclip.models import build_model

    torch.manual_seed(seed)
    model = build_model(arch).model
    if batch_norm_stats:
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.normal_()
                module.running_var.uniform_(0.5, 2.0)
                module.num_batches_tracked.fill_(7)
    torch.save(model.state_dict(), path)
    return path


@pytest.fixture(scope="module")
def single(tiny_embedded, tmp_path_factory, request):
    """The one-process runs: each tower locked, whole and in part, from random init and from a file; tiny-vit-hf's
    text tower; a tiny ResNet with and without frozen BatchNorm statistics; a stop + resume; a compiled run."""
    root = tmp_path_factory.mktemp("locks")
    data = tiny_embedded
    rn = root / "tiny-rn.json"
    rn.write_text(json.dumps(TINY_RN))
    vit_file = saved_model("tiny-vit", root / "vit.pt", seed=1)
    # LiT's usual start, a pretrained image model alone: an image tower's own state dict (open_clip's model.visual)
    image_file = root / "visual.pt"
    torch.save({k[len("visual.") :]: v for k, v in load(vit_file).items() if k.startswith("visual.")}, image_file)
    rn_file = saved_model(str(rn), root / "rn.pt", seed=2, batch_norm_stats=True)
    g1 = {IMAGE: "true", "model.lock_image_unlocked_groups": 1, **MOMENTUM}
    runs = {
        "image": args(data, root / "image", **{IMAGE: "true", "model.pretrained": vit_file}),
        "image_g1": args(data, root / "image_g1", **g1),
        "image_only": args(data, root / "image_only", **{IMAGE: "true", "model.pretrained": image_file}),
        "text": args(data, root / "text", **TEXT),
        "text_l1": args(data, root / "text_l1", **TEXT, **{"model.lock_text_unlocked_layers": 1}),
        "hf": args(data, root / "hf", **{"model.arch": "tiny-vit-hf", "model.lock_text": "true"}),
        "rn_frozen_bn": args(
            data,
            root / "rn_frozen_bn",
            **{
                "model.arch": rn,
                IMAGE: "true",
                "model.pretrained": rn_file,
                "model.lock_image_freeze_bn_stats": "true",
            },
        ),  # fmt: skip
        "rn": args(data, root / "rn", **{"model.arch": rn, IMAGE: "true", "model.pretrained": rn_file}),
        # stopped after step 3 with the last checkpoint at 2 (as a crash leaves it), resumed to STEPS
        "split": args(data, root / "split", **g1, **{"train.max_steps": 3, "checkpoint.at_end": "false"}),
        "split@": args(data, root / "split", **g1, **{"train.resume": "latest"}),
    }
    said = {name: trained(argv) for name, argv in runs.items()}
    # a run unlocked again, from the frozen-BatchNorm run's towers (which keep no BatchNorm step counter)
    frozen_towers = step_dir(root / "rn_frozen_bn", STEPS) / "model.pt"
    from_frozen = args(
        data, root / "from_frozen", **{"model.arch": rn, "train.max_steps": 1, "model.pretrained": frozen_towers}
    )
    said["from_frozen"] = trained(from_frozen)
    # model.compile (torch.compile of the towers' encoders) with aot_eager: dynamo and AOTAutograd, which see the
    # frozen parameters, without inductor's C++ build (30+ s of CPU here)
    compiled = args(data, root / "compiled", **g1, **{"model.compile": "true", "train.max_steps": 2})
    eager_compile = torch.compile
    torch.compile = functools.partial(eager_compile, backend="aot_eager")
    try:
        said["compiled"] = trained(compiled)
    finally:
        torch.compile = eager_compile
    runs["compiled"] = compiled
    yield from removed_unless_failed(
        request,
        root,
        SimpleNamespace(
            root=root, runs=runs, said=said, vit_file=vit_file, image_file=image_file, rn_file=rn_file, rn=rn
        ),
    )


def final(run: Path, step: int = STEPS) -> dict:
    return load(step_dir(run, step) / "model.pt")


def image_names(state: dict) -> list[str]:
    return [k for k in state if k.startswith("visual.")]


def text_names(state: dict) -> list[str]:
    """open_clip's CLIP keeps its text tower's parts as its own attributes: everything but visual.* and the scale."""
    return [k for k in state if not k.startswith("visual.") and k != "logit_scale"]


def unchanged(state: dict, start: dict, names) -> list[str]:
    return [k for k in names if torch.equal(state[k], start[k])]


def optimizer_holds(model: dict) -> tuple[int, int]:
    """(tower parameters, their elements) the saved optimizer has state for; every entry of its state is one of
    its groups' parameters."""
    opt = model["optimizer"]
    indices = [i for g in opt["param_groups"] for i in g["params"]]
    assert sorted(opt["state"]) == sorted(indices)
    towers = [i for g in opt["param_groups"] if g["name"] != "temperature" for i in g["params"]]
    return len(towers), sum(opt["state"][i]["exp_avg"].numel() for i in towers)


def numel(state: dict, names) -> int:
    return sum(state[k].numel() for k in names)


# ----------------------------------------------------------------------------- one process
def test_a_locked_image_tower_keeps_the_pretrained_weights_while_the_text_tower_trains(single):
    start, end = load(single.vit_file), final(single.root / "image")
    image, text = image_names(end["state_dict"]), text_names(end["state_dict"])
    assert len(image) == 32 and len(text) == 29
    assert unchanged(end["state_dict"], start, image) == image  # bitwise the file's
    assert unchanged(end["state_dict"], start, text) == []  # every text parameter moved
    assert optimizer_holds(end) == (len(text), numel(start, text))  # nothing for the 432,128 locked ones
    assert numel(start, image) == 432_128
    # the start line: which tower, its groups, what trains (7,165,441 parameters, 6,733,312 outside visual.*)
    assert (
        f"tiny-vit (7.2M parameters, towers from {single.vit_file}), image tower locked (0 of 4 groups unlocked): "
        "6.73M of 7.17M parameters train, 1 process(es)" in single.said["image"]
    )


def test_an_image_towers_own_file_starts_the_locked_image_tower_and_the_text_tower_at_random_init(single):
    """LiT's start: --model.pretrained names an image tower alone (keys without "visual."): that tower is the file's,
    bitwise, to the end; the text tower starts at the run's random init and trains; the start line says both."""
    file, end = load(single.image_file), final(single.root / "image_only")
    start = initial_towers(single.runs["image_only"])
    state = end["state_dict"]
    image, text = image_names(state), text_names(state)
    assert sorted("visual." + k for k in file) == sorted(image) and len(image) == 32
    assert all(torch.equal(state["visual." + k], v) for k, v in file.items())
    assert not any(torch.equal(state[k], start[k]) for k in text)  # trained from the run's own init
    assert optimizer_holds(end) == (len(text), numel(start, text))
    assert (
        f"tiny-vit (7.2M parameters, image tower from {single.image_file}, text tower random init), image tower "
        "locked (0 of 4 groups unlocked)" in single.said["image_only"]
    )


def test_an_image_tower_file_is_told_from_a_whole_model_and_checked_against_the_tower(tmp_path):
    """image_tower_state: "visual."-prefixed keys or a tower's own names are an image tower's file, a whole model's
    is not; a file of another image tower is one ConfigError naming the file and the tower."""
    from fastclip.models import build_model
    from fastclip.train.config import ConfigError
    from fastclip.train.preflight import fit_pretrained, image_tower_state, pretrained_words

    model = build_model("tiny-vit").model
    own = model.state_dict()
    visual = {k: v for k, v in own.items() if k.startswith("visual.")}
    bare = {k[len("visual.") :]: v for k, v in visual.items()}
    assert image_tower_state(own, visual) == visual and image_tower_state(own, bare).keys() == visual.keys()
    assert image_tower_state(own, own) is None and image_tower_state(own, {"token_embedding.weight": 0}) is None
    assert pretrained_words(own, bare, "v.pt") == "image tower from v.pt, text tower random init"
    assert pretrained_words(own, own, "w.pt") == "towers from w.pt"
    ssl_keys = ["visual.conv1.weight", "projector.0.weight"]  # an ssl run's towers: no text tower
    assert pretrained_words(ssl_keys, {"conv1.weight": 0}, "s.pt") == "image tower from s.pt, the rest random init"
    fitted = fit_pretrained(model, bare, "v.pt")
    assert fitted.keys() == own.keys() and all(torch.equal(fitted[k], own[k]) for k in own)
    other = {k: v for k, v in build_model("tiny-vit-64").model.state_dict().items() if k.startswith("visual.")}
    with pytest.raises(ConfigError, match=r"^config key 'model.pretrained': o.pt \(an image tower\) does not fit "
                       r"the architecture's image tower: .*of another shape"):  # fmt: skip
        fit_pretrained(model, other, "o.pt")


def test_one_unlocked_image_group_is_the_projection_which_trains_alone(single):
    start, end = initial_towers(single.runs["image_g1"]), final(single.root / "image_g1")
    state = end["state_dict"]
    image, text = image_names(state), text_names(state)
    assert [k for k in image if k not in unchanged(state, start, image)] == ["visual.proj"]
    assert unchanged(state, start, text) == []
    assert optimizer_holds(end) == (len(text) + 1, numel(start, text) + 128 * 64)
    assert (
        "random init), image tower locked (1 of 4 groups unlocked): 6.74M of 7.17M parameters train"
        in (single.said["image_g1"])
    )
    # the EMA copy of a locked parameter is the parameter (lerp toward an equal value)
    momentum = end["momentum_towers"]
    assert unchanged(momentum, start, image) == [k for k in image if k != "visual.proj"]


@pytest.mark.parametrize("name, trains", [("text", []), ("text_l1", ["text_projection"])])
def test_a_locked_text_tower_stays_and_the_image_tower_trains(single, name, trains):
    start, end = initial_towers(single.runs[name]), final(single.root / name)
    state = end["state_dict"]
    image, text = image_names(state), text_names(state)
    assert [k for k in text if k not in unchanged(state, start, text)] == trains
    assert unchanged(state, start, image) == []
    assert optimizer_holds(end) == (len(image) + len(trains), numel(start, image) + numel(start, trains))
    assert f"text tower locked ({len(trains)} of 4 layer groups unlocked)" in single.said[name]


def test_a_locked_hugging_face_text_tower_keeps_its_layer_norms_trainable_as_open_clip_does(single):
    """tiny-vit-hf (a 2-layer BERT): lock_text_freeze_layer_norm false leaves the LayerNorms, and open_clip never
    locks the projection; every other weight of the BERT stays."""
    start, end = initial_towers(single.runs["hf"]), final(single.root / "hf")
    state = end["state_dict"]
    bert = [k for k in state if k.startswith("text.transformer.")]
    norms = [k for k in bert if "LayerNorm" in k.split(".")]
    assert len(bert) == 37 and len(norms) == 10
    assert unchanged(state, start, bert) == [k for k in bert if k not in norms]
    assert unchanged(state, start, norms + ["text.proj.weight"] + image_names(state)) == []
    assert "text tower locked (0 layer groups unlocked, LayerNorms trainable)" in single.said["hf"]


def test_frozen_batch_norm_statistics_stay_the_files_and_without_them_they_move(single):
    """A tiny ModifiedResNet from a file with trained BatchNorm statistics: locked with lock_image_freeze_bn_stats
    every image-tower tensor stays the file's, statistics included (FrozenBatchNorm2d: no step counter); locked
    without it the weights stay but the statistics follow the batches (BatchNorm in train mode)."""
    start = load(single.rn_file)
    frozen, plain = (final(single.root / run)["state_dict"] for run in ("rn_frozen_bn", "rn"))
    stats = [k for k in start if k.startswith("visual.") and k.endswith(("running_mean", "running_var"))]
    counters = [k for k in start if k.startswith("visual.") and k.endswith("num_batches_tracked")]
    assert len(stats) == 2 * len(counters) == 2 * 19  # stem 3, 4 blocks of 3 + a downsampling one
    kept = [k for k in image_names(start) if k not in counters]
    assert sorted(image_names(frozen)) == sorted(kept) and unchanged(frozen, start, kept) == kept
    assert unchanged(plain, start, stats) == [] and [int(plain[k]) for k in counters] == [7 + STEPS] * 19
    weights = [k for k in kept if k not in stats]
    assert unchanged(plain, start, weights) == weights
    assert unchanged(frozen, start, text_names(frozen)) == []
    assert "image tower locked (0 of 1 groups unlocked, BatchNorm statistics frozen)" in single.said["rn_frozen_bn"]
    # an unlocked run starts from those towers (their BatchNorm step counters as 0)
    again = final(single.root / "from_frozen", 1)["state_dict"]
    assert [int(again[k]) for k in counters] == [1] * 19


def test_a_stopped_and_resumed_run_with_a_lock_ends_bitwise_as_the_uninterrupted_one(single):
    full, split = step_dir(single.root / "image_g1", STEPS), step_dir(single.root / "split", STEPS)
    assert_same_training_state(full, split, 1)
    state, start = load(split / "model.pt")["state_dict"], initial_towers(single.runs["split"])
    image = image_names(state)
    assert unchanged(state, start, image) == [k for k in image if k != "visual.proj"]  # locked across the resume
    assert_same(load(full / "model.pt")["momentum_towers"], load(split / "model.pt")["momentum_towers"])
    assert [r["step"] for r in train_records(single.root / "split")] == list(range(1, STEPS + 1))


def test_compiled_towers_with_a_lock_train_as_eager_ones(single):
    """model.compile (aot_eager here): the same losses and weights as the eager run, the locked ones unchanged."""
    eager, compiled = final(single.root / "image_g1", 2), final(single.root / "compiled", 2)
    for k, v in eager["state_dict"].items():
        torch.testing.assert_close(compiled["state_dict"][k], v, rtol=1e-5, atol=1e-7, msg=lambda m: f"{k}: {m}")
    start = initial_towers(single.runs["image_g1"])
    image = image_names(start)
    assert unchanged(compiled["state_dict"], start, image) == [k for k in image if k != "visual.proj"]
    losses = [[r["loss"] for r in train_records(single.root / run)[:2]] for run in ("image_g1", "compiled")]
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)


def test_resuming_with_other_lock_settings_is_one_line_naming_the_keys(single, capsys):
    """The checkpoint's optimizer state is for the parameters its locks left trainable: another lock is refused before
    anything is built, by the run and by --check, naming each key that differs and the values to resume with."""
    base = [*single.runs["image_g1"], "--train.resume", "latest", "--train.max_steps", "6"]
    text_flags = [f"--{k}={v}" for k, v in TEXT.items()]
    checkpoint = step_dir(single.root / "image_g1", STEPS)
    cases = [
        (["--model.lock_image_unlocked_groups", "0"],
         f"config key 'model.lock_image_unlocked_groups': 0 but checkpoint {checkpoint} was trained with 1: the locks "
         "decide which parameters train, and the checkpoint's optimizer state is for those; resume with "
         "--model.lock_image_unlocked_groups 1, or start a new run from its weights with --model.pretrained "
         f"{checkpoint / 'model.pt'}"),
        (["--model.lock_image", "false", "--model.lock_image_unlocked_groups", "0", *text_flags],
         "config keys 'model.lock_image', 'model.lock_image_unlocked_groups', 'model.lock_text', "
         "'model.lock_text_freeze_layer_norm': model.lock_image false, model.lock_image_unlocked_groups 0, "
         "model.lock_text true, model.lock_text_freeze_layer_norm true but checkpoint "
         f"{checkpoint} was trained with model.lock_image true, model.lock_image_unlocked_groups 1, model.lock_text "
         "false, model.lock_text_freeze_layer_norm false: the locks decide which parameters train, and the "
         "checkpoint's optimizer state is for those; resume with --model.lock_image true "
         "--model.lock_image_unlocked_groups 1 --model.lock_text false --model.lock_text_freeze_layer_norm false"),
    ]  # fmt: skip
    before = sorted(p.name for p in (single.root / "image_g1" / "checkpoints").iterdir())
    for changed, line in cases:
        for check in ([], ["--check"]):
            assert main([*base, *changed, *check]) == 2
            said = the_error_line(capsys.readouterr().err)
            assert said.startswith(f"fastclip train: config error: {line}"), said
    assert sorted(p.name for p in (single.root / "image_g1" / "checkpoints").iterdir()) == before
    assert len(train_records(single.root / "image_g1")) == STEPS


# ----------------------------------------------------------------------------- open_clip's groups
@pytest.mark.parametrize("unlocked", [0, 1, 2, 3])
def test_the_unlocked_groups_are_open_clips_last_ones(unlocked):
    """tiny-vit's 4 groups per tower, as open_clip's lock counts them: image stem + ln_pre, block 0, block 1 +
    ln_post, proj; text embeddings, block 0, block 1 + ln_final, projection."""
    from fastclip.models import build_model
    from fastclip.models.locks import LockSettings, apply_locks

    model = build_model("tiny-vit").model
    model.logit_scale.requires_grad_(False)  # (as the trainer does: the loss owns the temperature)
    settings = LockSettings(
        lock_image=True,
        lock_image_unlocked_groups=unlocked,
        lock_text=True,
        lock_text_unlocked_layers=unlocked,
        lock_text_freeze_layer_norm=True,
    )
    if unlocked == 0:
        with pytest.raises(ValueError, match="nothing would train but the loss's temperature"):
            apply_locks(model, settings, "tiny-vit")
        return
    apply_locks(model, settings, "tiny-vit")
    image = [
        ["visual.proj"],
        ["visual.transformer.resblocks.1.", "visual.ln_post."],
        ["visual.transformer.resblocks.0."],
    ]
    text = [["text_projection"], ["transformer.resblocks.1.", "ln_final."], ["transformer.resblocks.0."]]
    want = tuple(p for groups in (image, text) for group in groups[:unlocked] for p in group)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == [n for n, _ in model.named_parameters() if n.startswith(want)] and trainable


# ----------------------------------------------------------------------------- 2 processes
def _train_runs(rank, world_size, runs):
    from fastclip.train.trainer import train

    return [train(load_config(EMBEDDED, argv[2:]))["step"] for argv in runs]


def layout_free(data, run, world_size: int, **extra) -> list[str]:
    """Every step one whole epoch (80 samples) and the crop the whole image: each layout steps on the same batches."""
    return args(
        data,
        run,
        **{
            IMAGE: "true",
            "data.batch_size": 80 // world_size,
            "data.aug.scale": "[1.0, 1.0]",
            "optim.eps": 1e-4,  # zero-gradient parameters must not turn rounding noise into +-lr steps
            "train.max_steps": 3,
            "train.epochs": 3,
            **extra,
        },
    )


ZERO = {"train.distributed": "deepspeed"}


@pytest.fixture(scope="module")
def processes(tiny_embedded, tmp_path_factory, request):
    """A locked image tower at 1 process, and at 2 under DDP, DeepSpeed ZeRO-2 (stopped and resumed too) and ZeRO-3."""
    root, data = tmp_path_factory.mktemp("locks2"), tiny_embedded
    one = layout_free(data, root / "one", 1)
    trained(one)
    zero2, zero3 = {**ZERO, "deepspeed.stage": 2}, {**ZERO, "deepspeed.stage": 3}
    runs = {
        "ddp": layout_free(data, root / "ddp", 2),
        "zero2": layout_free(data, root / "zero2", 2, **zero2),
        "zero2_split": layout_free(data, root / "zero2_split", 2, **zero2, **{"train.max_steps": 2}),
        "zero2_split@": layout_free(data, root / "zero2_split", 2, **zero2, **{"train.resume": "latest"}),
        "zero3": layout_free(data, root / "zero3", 2, **zero3, **{"deepspeed.param_persistence_threshold": 0}),
    }
    needs_deepspeed = [name for name in runs if name.startswith("zero")]
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        runs = {name: argv for name, argv in runs.items() if name not in needs_deepspeed}
    steps = run_distributed(_train_runs, 2, list(runs.values()), timeout=600)
    assert steps == [[2 if name == "zero2_split" else 3 for name in runs]] * 2
    yield from removed_unless_failed(request, root, SimpleNamespace(root=root, one=one, runs=runs))


def test_one_process_equals_two_with_a_locked_tower(processes):
    """The global batch's objective (the logged `loss` is each rank's own surrogate), the temperature and the
    gradient norm at every step, and the weights at the end, of the same run at 1 and at 2 processes."""
    one, two = processes.root / "one", processes.root / "ddp"
    for key, rel in (("objective", 1e-6), ("tau", 1e-6), ("grad_norm", 1e-5)):
        values = [[r[key] for r in train_records(run)] for run in (one, two)]
        assert len(values[0]) == 3 and values[1] == pytest.approx(values[0], rel=rel), key
    a, b = final(one, 3)["state_dict"], final(two, 3)["state_dict"]
    start = initial_towers(processes.one)
    for state in (a, b):
        assert unchanged(state, start, image_names(state)) == image_names(state)
        assert unchanged(state, start, text_names(state)) == []
    for k in text_names(a):
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=2e-6, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("name", ["zero2", "zero2_split", "zero3"])
def test_deepspeed_trains_a_locked_tower_as_ddp(processes, name):
    if name not in processes.runs:
        pytest.skip("deepspeed is not installed")
    ddp, zero = final(processes.root / "ddp", 3), final(processes.root / name, 3)
    start = initial_towers(processes.one)
    state = zero["state_dict"]
    assert state.keys() == ddp["state_dict"].keys()
    assert unchanged(state, start, image_names(state)) == image_names(state)
    for k, v in ddp["state_dict"].items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} {k}: {m}")
    losses = [[r["loss"] for r in train_records(processes.root / run)] for run in ("ddp", name)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    if name == "zero2_split":  # resumed from step 2: bitwise the uninterrupted ZeRO-2 run
        assert_same(state, final(processes.root / "zero2", 3)["state_dict"])


# ----------------------------------------------------------------------------- flags and operator errors
def test_openclip_lock_flags_map_to_the_model_keys():
    theirs = [
        "--lock-image",
        "--lock-image-unlocked-groups",
        "2",
        "--lock-image-freeze-bn-stats",
        "--lock-text",
        "--lock-text-unlocked-layers",
        "1",
        "--lock-text-freeze-layer-norm",
    ]
    ours = {
        "lock_image": True,
        "lock_image_unlocked_groups": 2,
        "lock_image_freeze_bn_stats": True,
        "lock_text": True,
        "lock_text_unlocked_layers": 1,
        "lock_text_freeze_layer_norm": True,
    }
    cfg = load_config(None, theirs)
    assert {k: getattr(cfg.model, k) for k in ours} == ours
    assert cfg.to_dict() == load_config(None, [x for k, v in ours.items() for x in (f"--model.{k}", str(v))]).to_dict()
    assert load_config(None, ["--lock-image=false"]).model.lock_image is False
    assert {k: getattr(load_config(None, []).model, k) for k in ours} == dict.fromkeys(ours, False) | {
        "lock_image_unlocked_groups": 0,
        "lock_text_unlocked_layers": 0,
    }


RN_PATH = "<tiny-rn>"  # replaced by the test's tiny ResNet config file
FAILS = [  # (arguments, key, words); also refused by the run itself where `run` is True
    (["--lock-image", "--lock-image-unlocked-groups", "-1"], "model.lock_image_unlocked_groups", "must be >= 0"),
    (["--lock-text", "--lock-text-unlocked-layers", "-2"], "model.lock_text_unlocked_layers", "must be >= 0"),
    (["--lock-image-unlocked-groups", "1"], "model.lock_image_unlocked_groups", "set model.lock_image true"),
    (["--lock-text-freeze-layer-norm"], "model.lock_text_freeze_layer_norm", "set model.lock_text true"),
    (["--lock-image", "--lock-image-unlocked-groups", "4"], "model.lock_image_unlocked_groups",
     "4 unlocks all 4 groups of tiny-vit's image tower, leaving nothing locked: use 0 to 3"),
    (["--lock-text", "--lock-text-freeze-layer-norm", "--lock-text-unlocked-layers", "9"],
     "model.lock_text_unlocked_layers", "9 unlocks all 4 layer groups of tiny-vit's text tower"),
    (["--lock-text"], "model.lock_text_freeze_layer_norm", "(open_clip asserts freeze_layer_norm): set it true"),
    (["--lock-image", "--lock-image-freeze-bn-stats"], "model.lock_image_freeze_bn_stats",
     "tiny-vit's image tower (VisionTransformer) has no BatchNorm layer"),
    (["--model.arch", RN_PATH, "--lock-image", "--lock-image-unlocked-groups", "1"],
     "model.lock_image_unlocked_groups", "(open_clip's ModifiedResNet) is locked whole only"),
    (["--model.arch", "tiny-vit-hf", "--lock-text", "--lock-text-unlocked-layers", "1"],
     "model.lock_text_unlocked_layers", "Hugging Face text tower (bert) whole only"),
    (["--model.arch", "coca_ViT-B-32", "--lock-image"], "model.lock_image", "(CoCa) has no image tower lock"),
    (["--lock-image", "--lock-text", "--lock-text-freeze-layer-norm"], "model.lock_image",
     "nothing would train but the loss's temperature"),
    (["--ssl.enabled", "true", "--data.zeroshot", "null", "--lock-image"], "model.lock_image",
     "would leave only the projector to train"),
    (["--ssl.enabled", "true", "--data.zeroshot", "null", "--lock-text"], "model.lock_text",
     "locks a text tower; ssl.enabled trains on images alone"),
]  # fmt: skip


@pytest.mark.parametrize("case", range(len(FAILS)))
def test_what_a_tower_cannot_take_is_one_line_by_check_and_by_the_run(tiny_embedded, tmp_path, capsys, case):
    given, key, words = FAILS[case]
    rn = tmp_path / "tiny-rn.json"
    rn.write_text(json.dumps(TINY_RN))
    given = [str(rn) if a == RN_PATH else a for a in given]
    run = tmp_path / "run"
    argv = [*args(tiny_embedded, run), *given]
    # by --check (the towers built on the meta device), and by the run (ViT-B-32's CoCa: --check alone, cheaply)
    for check in [["--check"]] + [[]] * ("coca_ViT-B-32" not in given):
        assert main([*argv, *check]) == 2
        line = the_error_line(capsys.readouterr().err)
        assert line.startswith(f"fastclip train: config error: config key '{key}': ") and words in line, line
        assert not run.exists()
