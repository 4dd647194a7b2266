"""The project's AdamW: torch's fused kernel where the parameters allow it, the same update as the
per-parameter loop, and the plain path for a dry run's meta tensors."""

from __future__ import annotations

import torch

from goat_dist.config import TrainConfig
from goat_dist.optim import build_optimizer, param_groups


def small_model(device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)]
    return torch.nn.Sequential(*layers).to(device)


def test_fused_on_cpu_and_not_on_the_meta_device():
    opt, _ = build_optimizer(small_model(), TrainConfig())
    assert all(g["fused"] for g in opt.param_groups)
    opt, _ = build_optimizer(small_model("meta"), TrainConfig())
    assert not any(g["fused"] for g in opt.param_groups)


def test_fused_update_equals_the_per_parameter_loop():
    cfg = TrainConfig(lr=1e-2, weight_decay=0.1, warmup_steps=1)  # the schedule starts at lr
    models = [small_model(), small_model()]
    fused, _ = build_optimizer(models[0], cfg)
    loop = torch.optim.AdamW(
        param_groups(models[1], cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        foreach=False,
    )
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(5):
        for model, opt in zip(models, (fused, loop)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert not torch.equal(models[0][0].weight, small_model()[0].weight)  # it trained
