"""Non-finite losses: ``train.on_nonfinite=raise`` names step, data and parameter; ``skip`` drops exactly
that update. Real runs (1 process, and DP=2 with ZeRO-2), slow."""

from __future__ import annotations

import json
import math

import pytest
from harness.distributed import run_distributed
from harness.faults import NaNGradient, fault_env, fault_override
from harness.multiproc import (
    goat_train_command,
    in_process_config,
    one_layer_config,
    per_step,
    records,
    run,
)

from goat_dist.checkpoint.manager import write_manifest

pytestmark = pytest.mark.slow

LAYOUTS = [(1, []), (2, ["parallel.zero_stage=2"])]
IDS = ["1proc", "dp2-zero2"]


def train(nproc, layout, overrides, expect=0, fault=None):
    """A ``goat-dist train`` run; ``fault``: a ``harness.faults`` callback entry (``"NaNLoss:3:0:1"``)."""
    extra, env = ([fault_override(fault)], fault_env()) if fault else ([], {})
    return run(goat_train_command(nproc, [*layout, *overrides, *extra]), expect=expect, **env)


@pytest.mark.parametrize("nproc,layout", LAYOUTS, ids=IDS)
def test_raise_names_step_data_and_parameter(nproc, layout, tmp_path, builtin_cache):
    run_dir = tmp_path / "run"
    common = ["train.max_steps=6", f"data.cache_dir={builtin_cache}", f"run.dir={run_dir}"]
    bad_rank = nproc - 1  # the last data-parallel rank's first micro-batch of step 3
    out = train(nproc, layout, common, expect=None, fault=f"NaNLoss:3:0:{bad_rank}")
    assert out.returncode != 0
    err = out.stderr
    assert "step 3: non-finite loss" in err, err[-3000:]
    assert f"on rank {bad_rank} starting at global sample" in err and "shard " in err
    assert "first parameter with a non-finite gradient: embedding" in err
    assert max(per_step(run_dir)) == 2  # nothing after the failing step
    assert not (run_dir / "checkpoints" / "latest").exists()  # and no checkpoint from it
    assert json.loads((run_dir / "last_exit.json").read_text())["status"] == "failed"


@pytest.mark.parametrize("nproc,layout", LAYOUTS, ids=IDS)
def test_skip_equals_a_run_that_never_saw_the_update(nproc, layout, tmp_path, builtin_cache):
    """A: NaN in step 3, skipped. B: trained to step 2, then told that step 3's batch was consumed (the
    checkpoint's run state moved on by one global batch, model and optimizer untouched), resumed. From
    step 4 on both see the same data with the same weights, optimizer and LR schedule: equal losses."""
    a = tmp_path / "a"
    common = ["train.max_steps=7", f"data.cache_dir={builtin_cache}", "train.on_nonfinite=skip"]
    train(nproc, layout, [*common, f"run.dir={a}"], fault=f"NaNLoss:3:0:{nproc - 1}")
    logged = [r for r in records(a) if "loss" in r]
    assert [r["nonfinite_skipped"] for r in logged if r["step"] in (2, 3, 7)] == [0, 1, 1]
    assert math.isnan(next(r["loss"] for r in logged if r["step"] == 3))

    b = tmp_path / "b"
    train(nproc, layout, ["train.max_steps=2", *common[1:], f"run.dir={b}"])
    step_dir = b / "checkpoints" / "step_00000002"
    state = json.loads((step_dir / "trainer_state.json").read_text())
    state["step"] = state["run_state"]["step"] = 3
    state["run_state"]["consumed_samples"] += 8
    state["run_state"]["consumed_tokens"] += 8 * 64
    (step_dir / "trainer_state.json").write_text(json.dumps(state))
    write_manifest(step_dir, {"step": 3, "saved_at": 0})
    train(nproc, layout, [*common, f"run.dir={b}"])

    got, expected = per_step(b), per_step(a)
    for step in range(4, 8):
        assert got[step] == expected[step], f"step {step}: {got[step]} vs skipped run {expected[step]}"


def test_skip_raises_after_too_many_in_a_row(tmp_path, builtin_cache):
    run_dir = tmp_path / "run"
    overrides = [
        "train.max_steps=8",
        "train.on_nonfinite=skip",
        "train.max_nonfinite_in_row=2",
        f"data.cache_dir={builtin_cache}",
        f"run.dir={run_dir}",
    ]
    out = train(1, [], overrides, expect=None, fault="NaNLoss:3-8")
    assert out.returncode != 0
    assert "step 5: non-finite loss (3 non-finite steps in a row (limit 2))" in out.stderr, out.stderr[-3000:]


def test_no_checkpoint_from_nonfinite_weights(tmp_path, builtin_cache):
    run_dir = tmp_path / "run"
    overrides = [
        "train.max_steps=8",
        "checkpoint.interval=2",
        f"data.cache_dir={builtin_cache}",
        f"run.dir={run_dir}",
    ]
    out = train(1, [], overrides, expect=None, fault="NaNWeights:4")
    assert out.returncode != 0
    assert "refusing to save a checkpoint from non-finite weights" in out.stderr, out.stderr[-3000:]
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_00000002"


@pytest.mark.parametrize(
    "stage,precision", [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (0, "bf16"), (2, "bf16")]
)
def test_a_nonfinite_gradient_drops_the_update_under_every_zero_stage(
    stage, precision, world1, builtin_cache, tmp_path
):
    """Finite loss, NaN gradient: the step's update is dropped (weights, Adam state and LR unchanged), the
    gradients are cleared, and the next step trains normally."""
    import torch

    from goat_dist.trainer import Trainer

    cfg = in_process_config(
        builtin_cache,
        tmp_path,
        f"train.precision={precision}",
        f"parallel.zero_stage={stage}",
        "train.on_nonfinite=skip",
    )
    trainer = Trainer(cfg, callbacks=[])
    it = trainer.start_loop()

    def snapshot():
        from deepspeed.utils import safe_get_full_fp32_param

        out = []
        for p in trainer.engine.module.parameters():
            full = safe_get_full_fp32_param(p)
            out.append((full if full is not None else p).detach().float().clone())
        return out

    assert not trainer.train_step(it).nonfinite
    trainer.state.step = 1
    before, lr = snapshot(), trainer.engine.lr
    trainer.add_callback(NaNGradient(2))  # only at step 2
    control = trainer.train_step(it)
    assert control.nonfinite_grad and not control.nonfinite_loss
    after = snapshot()
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "the update was applied"
    assert trainer.engine.lr == lr and trainer.state.nonfinite_skipped == 1
    trainer.state.step = 2
    assert not trainer.train_step(it).nonfinite  # gradients were cleared: nothing stale carries over
    assert any(not torch.equal(a, b) for a, b in zip(after, snapshot()))


def _zero3_padding_rank(layout) -> dict:
    """One rank of DP=2, ZeRO-3, bf16: NaN into every partition's padding (forward weights and fp32
    masters), then an Inf into one real element; what the checks see each time."""
    import torch
    from deepspeed.utils import safe_get_full_fp32_param

    from goat_dist.engine.zero3 import partition_span
    from goat_dist.model import GPT
    from goat_dist.observe.step_metrics import param_sumsq_share
    from goat_dist.parallel.parallelize import parallelize
    from goat_dist.trainer.nonfinite import first_nonfinite_weight

    cfg = one_layer_config("train.micro_batch_size=1", "parallel.zero_stage=3", "train.precision=bf16")
    torch.manual_seed(0)
    model = GPT(cfg.model)
    engine = parallelize(model, cfg, grad_accum=1)
    opt = engine.deepspeed.optimizer
    padded = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            _, real = partition_span(p)
            master = opt._get_fp32_opt_state_partition(p, release_swap_buffers=False)[0]
            if real < p.ds_tensor.numel():
                p.ds_tensor.view(-1)[real:] = float("nan")
                master.view(-1)[real:] = float("nan")
                padded.append(name)
    engine.module.sync_prior_masters()
    prior = [(n, p) for n, p in model.named_parameters() if ".prior." in n]
    result = {
        "prior_forward_is_master": [
            n for n, p in prior if torch.equal(p.fp32_forward, safe_get_full_fp32_param(p))
        ],
        "prior": [n for n, _ in prior],
        "padded": padded,
        "bad_with_padding_nan": first_nonfinite_weight(model),
        "norm_share": param_sumsq_share(model, 1, layout.dp, layout.dp_rank),
    }
    victim = next(n for n, p in model.named_parameters() if partition_span(p)[1] > 0 and n not in padded)
    with torch.no_grad():
        dict(model.named_parameters())[victim].ds_tensor.view(-1)[0] = float("inf")
    result["victim"], result["bad_with_real_inf"] = victim, first_nonfinite_weight(model)
    return result


def test_zero3_padding_is_not_a_nonfinite_weight():
    """DeepSpeed pads ZeRO-3 partitions with uninitialised memory; a NaN there once refused a final save of
    a healthy DP=2 ZeRO-3 run (``blocks.0.attn.prior.sink_mlp.fc2.bias``, one element: rank 1 holds only
    padding). NaN in every padding is ignored; an Inf in a real element is still named. In bf16, the prior's
    forward values gathered from the fp32 master partitions (engine/zero3.py) equal DeepSpeed's own gather."""
    ranks = run_distributed(_zero3_padding_rank, world=2)
    assert any(".prior." in name for name in ranks[1]["padded"]), ranks[1]["padded"]
    for r in ranks:
        assert r["bad_with_padding_nan"] is None
        assert math.isfinite(r["norm_share"])
        assert r["bad_with_real_inf"] == r["victim"]
        assert r["prior_forward_is_master"] == r["prior"] and len(r["prior"]) >= 5
