"""fastclip-tempnet: RGCL with per-anchor temperatures predicted by an MLP head per modality (float64, against
the objective written out directly)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastclip.losses import build_loss

N, D, RHO = 6, 5, 1.0
IDX = torch.tensor([0, 3, 4, 7, 8, 1])


def features(seed):
    gen = torch.Generator().manual_seed(seed)
    e1 = F.normalize(torch.randn(N, D, generator=gen, dtype=torch.float64), dim=1)
    e2 = F.normalize(e1 + 0.7 * torch.randn(N, D, generator=gen, dtype=torch.float64), dim=1)
    return e1, e2


def tempnet(seed=0):
    loss_fn = build_loss(
        "fastclip-tempnet", data_size=10, embed_dim=D, tempnet_hidden=7, rho=RHO, temperature=0.2
    ).double()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # the heads start constant; give them a slope so τ differs between anchors
        for head in (loss_fn.tempnet_img, loss_fn.tempnet_txt):
            head.out.weight.copy_(0.8 * torch.randn(head.out.weight.shape, generator=gen, dtype=torch.float64))
    return loss_fn


def direct_objective(loss_fn, e1, e2, eps=1e-14):
    """(1/2N) Σ_i [τ_i^img (log(ε+g1_i) + ρ) + τ_i^txt (log(ε+g2_i) + ρ)], τ from the heads on detached features."""
    tau_img = loss_fn.tempnet_img(e1.detach())
    tau_txt = loss_fn.tempnet_txt(e2.detach())
    sim = e1 @ e2.T
    pos = torch.diagonal(sim)
    off = ~torch.eye(N, dtype=torch.bool)
    g1 = (torch.exp((sim - pos[:, None]) / tau_img[:, None]) * off).sum(1) / (N - 1)
    g2 = (torch.exp((sim.T - pos[:, None]) / tau_txt[:, None]) * off).sum(1) / (N - 1)
    return ((tau_img * (torch.log(eps + g1) + RHO)).sum() + (tau_txt * (torch.log(eps + g2) + RHO)).sum()) / (2 * N)


def test_tempnet_gradients_are_the_objectives():
    e1, e2 = features(0)
    loss_fn = tempnet()
    x1, x2 = e1.clone().requires_grad_(), e2.clone().requires_grad_()
    loss_fn(x1, x2, IDX).backward()
    got = {name: p.grad.clone() for name, p in loss_fn.named_parameters()}
    tau = loss_fn.metrics["tau_quantiles"]
    assert tau[2] - tau[0] > 0.02  # the temperatures really differ between anchors

    loss_fn.zero_grad()
    w1, w2 = e1.clone().requires_grad_(), e2.clone().requires_grad_()
    objective = direct_objective(loss_fn, w1, w2)
    objective.backward()
    torch.testing.assert_close(x1.grad, w1.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(x2.grad, w2.grad, rtol=1e-10, atol=1e-12)
    for name, p in loss_fn.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-10, atol=1e-12, msg=name)
    torch.testing.assert_close(loss_fn.metrics["objective"], objective.detach(), rtol=1e-10, atol=1e-12)


def test_tempnet_predicts_bounded_temperatures_for_unseen_samples_and_round_trips():
    loss_fn = tempnet()
    e1, e2 = features(1)
    loss_fn(e1, e2, IDX)
    unseen = F.normalize(torch.randn(50, D, dtype=torch.float64), dim=1)
    tau = loss_fn.tempnet_img(unseen)
    assert ((tau > 0.01) & (tau < 1.0)).all() and tau.std() > 0
    fresh = build_loss(
        "fastclip-tempnet", data_size=10, embed_dim=D, tempnet_hidden=7, rho=RHO, temperature=0.2
    ).double()
    fresh.load_state_dict(loss_fn.state_dict())
    torch.testing.assert_close(fresh.tempnet_img(unseen), tau, rtol=0, atol=0)
    assert fresh.state_dict()["_extra_state"]["seen"].sum() == N
    assert sorted(loss_fn.tau_param_names()) == sorted(n for n, _ in loss_fn.named_parameters())


def test_tempnet_options():
    with pytest.raises(TypeError, match="embed_dim|does not take"):
        build_loss("fastclip-tempnet", data_size=10, similarity="atanh", embed_dim=4)
    with pytest.raises(ValueError, match="embed_dim"):
        build_loss("fastclip-tempnet", data_size=10)
    from fastclip.losses import LossInputError

    e1, e2 = features(0)
    with pytest.raises(LossInputError, match=f"features have d={D} but the temperature network was built for "):
        build_loss("fastclip-tempnet", data_size=10, embed_dim=D + 1).double()(e1, e2, torch.arange(N))
    head = build_loss("fastclip-tempnet", data_size=10, embed_dim=4).tempnet_txt
    torch.testing.assert_close(head(torch.randn(3, 4)), torch.full((3,), 0.03))  # starts at `temperature`


def test_export_writes_the_heads_beside_a_model_open_clip_loads(tmp_path):
    from fastclip.compat import import_open_clip
    from fastclip.eval.export import export_model
    from fastclip.models import build_model

    built = build_model("tiny-vit")
    heads = {
        k: v
        for k, v in build_loss("fastclip-tempnet", data_size=4, embed_dim=64).state_dict().items()
        if k.startswith("tempnet_")
    }
    step = tmp_path / "run" / "checkpoints" / "step_00000001"
    step.mkdir(parents=True)
    torch.save(
        {
            "state_dict": built.model.state_dict(),
            "arch": "tempnet-export-vit",
            "model_config": built.config,
            "loss": heads,
            "step": 1,
        },
        step / "model.pt",
    )
    (step.parent / "latest").write_text(step.name)
    written = export_model(tmp_path / "run", tmp_path / "out" / "model.pt")
    saved = torch.load(written["tempnet_file"], weights_only=True)["state_dict"]
    assert set(saved) == set(heads) and all(torch.equal(saved[k], heads[k]) for k in heads)
    open_clip = import_open_clip()
    open_clip.add_model_config(str(written["config_file"]))
    model, _, _ = open_clip.create_model_and_transforms("tempnet-export-vit", pretrained=str(written["file"]))
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in built.model.parameters())
