"""The project's AdamW: torch's fused kernel where the parameters allow it, the same update as the
per-parameter loop, and the plain path for a dry run's meta tensors."""

from __future__ import annotations

import pytest
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


class TinyGoat(torch.nn.Module):
    """The parameter names of ``model.GPT`` with a GOAT block (embedding, norms with biases, fused q/k/v,
    the prior, MLP), without megatron: what ``param_groups`` sorts."""

    def __init__(self):
        from goat_dist.goat.prior import GoatPrior

        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Embedding(32, 16)
        block = torch.nn.Module()
        block.attn_norm = torch.nn.LayerNorm(16)
        block.attn = torch.nn.Module()
        block.attn.prior = GoatPrior(2, pos_rank=2, abs_rank=2, training_seq_len=8)
        block.attn.qkv = torch.nn.Linear(16, 48)
        block.attn.proj = torch.nn.Linear(16, 16)
        block.mlp_norm = torch.nn.LayerNorm(16)
        block.mlp = torch.nn.Module()
        block.mlp.fc1 = torch.nn.Linear(16, 64)
        self.blocks = torch.nn.ModuleList([block])
        self.final_norm = torch.nn.LayerNorm(16)


def named_groups(choice: str) -> dict[str, tuple[float, list[str]]]:
    model = TinyGoat()
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        g["name"]: (g["weight_decay"], sorted(names[id(p)] for p in g["params"]))
        for g in param_groups(model, 0.1, prior_weight_decay=choice)
    }


P = "blocks.0.attn.prior."
MATRICES = [
    "embedding.weight",
    "blocks.0.attn.qkv.weight",
    "blocks.0.attn.proj.weight",
    "blocks.0.mlp.fc1.weight",
]
NORMS_AND_BIASES = [
    "blocks.0.attn_norm.weight",
    "blocks.0.attn_norm.bias",
    "blocks.0.attn.qkv.bias",
    "blocks.0.attn.proj.bias",
    "blocks.0.mlp_norm.weight",
    "blocks.0.mlp_norm.bias",
    "blocks.0.mlp.fc1.bias",
    "final_norm.weight",
    "final_norm.bias",
]
LAMBDAS = [P + "lambda_sym", P + "lambda_asym"]
GAIN_BUMP_SLOPE = [P + "sink_gain", P + "sink_bump", P + "recency_slope_raw"]
SINK_MLP = [P + f"sink_mlp.fc{i}.{kind}" for i in (1, 2) for kind in ("weight", "bias")]


def test_prior_weight_decay_none_decays_no_prior_parameter():
    assert named_groups("none") == {
        "decay": (0.1, sorted(MATRICES)),
        "no_decay": (0.0, sorted(NORMS_AND_BIASES)),
        "prior": (0.0, sorted(LAMBDAS + GAIN_BUMP_SLOPE + SINK_MLP)),
    }


def test_prior_weight_decay_c4_decays_gain_bump_and_slope_as_the_authors_script():
    assert named_groups("c4") == {
        "decay": (0.1, sorted(MATRICES)),
        "no_decay": (0.0, sorted(NORMS_AND_BIASES)),
        "prior": (0.0, sorted(LAMBDAS + SINK_MLP)),  # their lambda_* and key_bias.* (our sink_mlp.*)
        "prior_decay": (0.1, sorted(GAIN_BUMP_SLOPE)),
    }


def test_prior_weight_decay_all_decays_everything_as_the_passkey_script():
    assert named_groups("all") == {
        "decay": (0.1, sorted(MATRICES + NORMS_AND_BIASES)),
        "prior_decay": (0.1, sorted(LAMBDAS + GAIN_BUMP_SLOPE + SINK_MLP)),
    }


def test_prior_groups_stay_fp32_and_the_choice_reaches_the_optimizer():
    """bf16 models keep the prior fp32 (a group holds one dtype): a partly decayed prior is two fp32 groups;
    ``train.prior_weight_decay`` is what ``build_optimizer`` reads; a bad value is refused by name."""
    model = TinyGoat().to(torch.bfloat16)  # GoatPrior._apply keeps its parameters fp32
    opt, _ = build_optimizer(model, TrainConfig(prior_weight_decay="c4"))
    dtypes = {g["name"]: {p.dtype for p in g["params"]} for g in opt.param_groups}
    assert dtypes == {
        "decay": {torch.bfloat16},
        "no_decay": {torch.bfloat16},
        "prior": {torch.float32},
        "prior_decay": {torch.float32},
    }
    with pytest.raises(ValueError, match="prior_weight_decay"):
        param_groups(model, 0.1, prior_weight_decay="some")


def test_prior_weight_decay_is_a_checked_config_key():
    from goat_dist.config import ConfigError, load_config

    assert load_config(None, ["train.prior_weight_decay=c4"]).train.prior_weight_decay == "c4"
    with pytest.raises(ConfigError, match="train.prior_weight_decay"):
        load_config(None, ["train.prior_weight_decay=yes"])
