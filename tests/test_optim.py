"""Parameter groups, the pure lr schedules, LAMB and the step_thresh rule."""

import math

import pytest
import torch

from fastclip.optim import Lamb, ThresholdRule, build_optimizer, get_lr, get_tau_lr, param_groups


def test_warmup_cosine_floor():
    kw = dict(base_lr=1.0, warmup_steps=10, total_steps=110, lr_min=0.1)
    assert get_lr(0, **kw) == pytest.approx(0.1)
    assert get_lr(9, **kw) == pytest.approx(1.0)
    assert get_lr(10, **kw) == pytest.approx(1.0)
    assert get_lr(60, **kw) == pytest.approx(0.1 + 0.5 * 0.9)  # half way down the cosine
    assert get_lr(110, **kw) == pytest.approx(0.1)
    assert get_lr(500, **kw) == pytest.approx(0.1)  # past the end: the floor
    assert get_lr(50, base_lr=2.0, warmup_steps=0, total_steps=100, kind="const") == 2.0
    lrs = [get_lr(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))  # monotone decay


def test_tau_schedules():
    kw = dict(lr_tau=0.5, warmup_steps=10, total_steps=100)
    assert get_tau_lr(0, kind="step_thresh", **kw) == 0.5  # no warmup
    assert get_tau_lr(0, kind="const", **kw) == pytest.approx(0.05)
    assert get_tau_lr(50, kind="const", **kw) == 0.5
    assert get_tau_lr(100, kind="cosine", **kw) == pytest.approx(0.0)


def test_groups_no_decay_on_gains_biases_and_temperature():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    frozen = torch.nn.Parameter(torch.ones(()), requires_grad=False)
    model.register_parameter("logit_scale", frozen)
    loss = torch.nn.Module()
    loss.logit_scale = torch.nn.Parameter(torch.tensor(2.0))
    groups = {g["name"]: g for g in param_groups(model, loss, lr=0.1, wd=0.2, lr_tau=0.01)}
    assert [p.shape for p in groups["decay"]["params"]] == [torch.Size([3, 4])]
    assert len(groups["no_decay"]["params"]) == 3 and groups["no_decay"]["weight_decay"] == 0
    assert groups["temperature"]["params"] == [loss.logit_scale]
    assert groups["temperature"]["lr"] == 0.01 and groups["temperature"]["weight_decay"] == 0
    assert all(p is not frozen for g in groups.values() for p in g["params"])
    # a loss without parameters (v1, v2) gives no temperature group
    assert "temperature" not in {g["name"] for g in param_groups(model, torch.nn.Module(), lr=0.1, wd=0.2, lr_tau=0.01)}


def test_lamb_step_matches_formula():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(5, 3))
    w0 = w.detach().clone()
    g = torch.randn(5, 3)
    opt = Lamb([w], lr=0.1, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01)
    w.grad = g.clone()
    opt.step()
    m_hat, v_hat = g, g * g  # after one step, bias-corrected moments are g and g^2
    update = m_hat / (v_hat.sqrt() + 1e-6) + 0.01 * w0
    expected = w0 - 0.1 * (w0.norm() / update.norm()) * update
    torch.testing.assert_close(w.detach(), expected, rtol=1e-6, atol=1e-7)
    # state is tensors only and round-trips through a weights_only load
    import io

    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    opt2 = Lamb([torch.nn.Parameter(w.detach().clone())], lr=0.1)
    opt2.load_state_dict(torch.load(buf, weights_only=True))
    assert float(opt2.state_dict()["state"][0]["step"]) == 1.0


def test_build_optimizer_rejects_unknown():
    with pytest.raises(ValueError, match="optim.optimizer"):
        build_optimizer("sgd", [{"params": [torch.nn.Parameter(torch.ones(1))]}], betas=(0.9, 0.9), eps=1e-8)


@pytest.mark.parametrize("opt_name", ["adamw", "lamb"])
def test_threshold_rule_equals_lr_over_factor(opt_name):
    """The on-device step_thresh rule gives the step AdamW/LAMB would take at lr_tau/3 (and lr_tau above)."""
    for tau_value, factor in ((0.02, 1 / 3), (0.05, 1.0)):
        p_rule = torch.nn.Parameter(torch.tensor([math.log(1 / tau_value)], dtype=torch.float64))
        p_ref = torch.nn.Parameter(p_rule.detach().clone())
        opt_rule = build_optimizer(
            opt_name, [{"params": [p_rule], "lr": 0.01, "weight_decay": 0.0}], betas=(0.9, 0.98), eps=1e-6
        )
        opt_ref = build_optimizer(
            opt_name, [{"params": [p_ref], "lr": 0.01 * factor, "weight_decay": 0.0}], betas=(0.9, 0.98), eps=1e-6
        )
        rule = ThresholdRule([p_rule], threshold=0.03, factor=3.0)
        for k in range(3):
            grad = torch.tensor([0.7 - 0.4 * k], dtype=torch.float64)
            p_rule.grad, p_ref.grad = grad.clone(), grad.clone()
            rule.before_step(torch.exp(-p_rule.detach()))
            opt_rule.step()
            rule.after_step()
            opt_ref.step()
        torch.testing.assert_close(p_rule.detach(), p_ref.detach(), rtol=0, atol=1e-12)
        assert rule.factor_now() == pytest.approx(factor)


def test_a_resume_at_another_layout_keeps_the_lr_of_each_sample():
    """The run's schedules (fastclip/train/schedules.py) count steps of the global batch it began with. 100 samples
    an epoch, 10 epochs, begun at a global batch of 24 (5 steps an epoch, the last filled: span 50), resumed at 48
    (3 steps an epoch): the span stays 50 steps of 24 (it was rescaled from the new layout's padded epochs to 60,
    the lr jumping 5.87e-4 -> 7.08e-4 at epoch 5 and ending at 2.9e-5, not 0)."""
    from types import SimpleNamespace

    from fastclip.train.config import Config
    from fastclip.train.schedules import Schedules

    cfg = Config()
    cfg.train.epochs, cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.lr_min = 10, 1e-3, 5, 0.0

    def schedules(global_batch):
        engine = SimpleNamespace(param_groups=[{"name": "towers", "lr": 0.0}], tau_params=[])
        return Schedules(cfg, engine, epoch_length=100, global_batch=global_batch)

    began, resumed = schedules(24), schedules(48)
    assert began.total_steps == 50 and resumed.total_steps == 30
    resumed.load_state_dict(began.state_dict())
    assert resumed.unit == 24 and resumed.total_steps == 50
    for samples in (0, 96, 600, 1200 - 48):
        began.apply(samples)
        resumed.apply(samples)
        assert resumed.lr == began.lr == get_lr(samples // 24, base_lr=1e-3, warmup_steps=5, total_steps=50)
    older = schedules(48)
    older.load_state_dict({"global_batch": 24, "total_steps": 50})  # saved before units were: its global batch
    assert older.unit == 24 and older.total_steps == 50
