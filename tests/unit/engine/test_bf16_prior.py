"""GOAT's prior stays fp32 under DeepSpeed's bf16 mode, which casts every parameter's ``.data`` directly
(bypassing ``GoatPrior._apply``). ZeRO-0/1/2: the prior is fp32 after ``parallelize`` and after training
steps, everything else bf16, and the prior still trains. ZeRO-3 cannot hold an fp32 group (one buffer of
one dtype for all partitions): its behaviour is stated at start and pinned here."""

from __future__ import annotations

import pytest
import torch
from harness.multiproc import one_layer_config

from goat_dist.model import GPT
from goat_dist.parallel.parallelize import parallelize


def config(stage: int):
    return one_layer_config("train.precision=bf16", f"parallel.zero_stage={stage}")


def bf16_engine(stage: int):
    cfg = config(stage)
    torch.manual_seed(0)
    model = GPT(cfg.model)
    return model, parallelize(model, cfg, grad_accum=1)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_prior_is_fp32_after_parallelize_and_training(stage, world1):
    model, engine = bf16_engine(stage)
    named = dict(model.named_parameters())
    prior = {n: p for n, p in named.items() if ".prior." in n}
    assert len(prior) >= 5  # lambda_*, sink_*, recency_slope_raw, the sink MLP
    assert {n: p.dtype for n, p in prior.items()} == dict.fromkeys(prior, torch.float32)
    assert {p.dtype for n, p in named.items() if n not in prior} == {torch.bfloat16}
    before = {n: p.detach().clone() for n, p in prior.items()}
    tokens = torch.randint(0, 300, (2, 33), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = engine(tokens[:, :-1], torch.arange(32).expand(2, -1), tokens[:, 1:])
        engine.backward(loss)
        engine.step()
    assert all(p.dtype == torch.float32 for p in prior.values())
    moved = [n for n, p in prior.items() if not torch.equal(p, before[n])]
    assert len(moved) >= len(prior) - 1, f"prior parameters that did not train: {set(prior) - set(moved)}"
    # an fp32 update smaller than bf16's spacing survives: the prior is not rounded after the step
    assert any(not torch.equal(p, p.bfloat16().float()) for p in prior.values())


def test_zero3_bf16_prior_computes_from_its_fp32_masters(world1):
    """ZeRO-3 keeps every partition in one buffer of one dtype, so the prior's parameters are bf16 there;
    the forward pass computes from their fp32 masters (engine/zero3.py), exactly, after parallelize and
    after training steps, and the lanes equal those of an fp32 prior holding the master values."""
    from deepspeed.utils import safe_get_full_fp32_param

    from goat_dist.goat.prior import FP32_FORWARD

    model, engine = bf16_engine(3)
    prior = {n: p for n, p in model.named_parameters() if ".prior." in n}
    assert {p.ds_tensor.dtype for p in prior.values()} == {torch.bfloat16}
    tokens = torch.randint(0, 300, (2, 33), generator=torch.Generator().manual_seed(1))
    for step in range(3):
        if step:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = engine(tokens[:, :-1], torch.arange(32).expand(2, -1), tokens[:, 1:])
            engine.backward(loss)
            engine.step()
            engine.module.sync_prior_masters()  # what the next forward does first
        for n, p in prior.items():
            used = getattr(p, FP32_FORWARD)
            assert used.dtype == torch.float32 and torch.equal(used, safe_get_full_fp32_param(p)), n
        # at least one value is not representable in bf16: the forward does not see the bf16 copy
        assert any(not torch.equal(getattr(p, FP32_FORWARD), p.float()) for p in prior.values())
    block = model.blocks[0].attn.prior
    twin = GPT(config(3).model).blocks[0].attn.prior  # a plain fp32 module holding the master values
    with torch.no_grad():
        for p, q in zip(block.parameters(), twin.parameters()):
            q.copy_(getattr(p, FP32_FORWARD))
    positions = torch.arange(32)[None]
    got = block.lanes(positions, True, scale=0.25)
    want = twin.lanes(positions, True, scale=0.25)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
