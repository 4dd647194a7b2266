"""The ZeRO-3 prior sync (engine/zero3.py, the fp32 mirror) gathers after each change of the fp32 masters (an
optimizer step; and once at the first forward, for a checkpoint loaded before it), not at every forward:
the micro-batches of one step reuse the values of the last gather."""

from __future__ import annotations

import torch
from harness.multiproc import one_layer_config

from goat_dist.goat.prior import FP32_FORWARD
from goat_dist.model import GPT
from goat_dist.parallel.parallelize import parallelize


def test_zero3_prior_gathers_only_after_the_masters_changed(world1):
    from deepspeed.utils import safe_get_full_fp32_param

    cfg = one_layer_config("train.precision=bf16", "parallel.zero_stage=3")
    torch.manual_seed(0)
    model = GPT(cfg.model)
    engine = parallelize(model, cfg, grad_accum=2)
    mirror = engine.module.sync_prior_masters.__self__
    prior = [p for n, p in model.named_parameters() if ".prior." in n]
    assert mirror.gathers == 1  # at install
    tokens = torch.randint(0, 300, (2, 33), generator=torch.Generator().manual_seed(1))
    for step in range(2):
        for _ in range(2):  # two micro-batches: the masters do not change in between
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = engine(tokens[:, :-1], torch.arange(32).expand(2, -1), tokens[:, 1:])
            engine.backward(loss)
            engine.step()
        assert mirror.gathers == 2 + step  # the first forward gathered, the second did not
    engine.module.sync_prior_masters()  # after the last step: the new masters
    assert mirror.gathers == 4
    engine.module.sync_prior_masters()
    assert mirror.gathers == 4
    assert all(torch.equal(getattr(p, FP32_FORWARD), safe_get_full_fp32_param(p)) for p in prior)
