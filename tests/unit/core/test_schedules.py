"""The learning-rate schedules (``optim.lr_at``) and a training length in tokens (``train.max_tokens``)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from goat_dist.config import ConfigError, TrainConfig, load_config, save_config
from goat_dist.optim import lr_at
from goat_dist.rampup import batch_at, ramp_sizes, steps_for_tokens


def cfg(**kw) -> TrainConfig:
    base = dict(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110)
    return TrainConfig(**{**base, **kw})


def test_cosine_is_the_closed_form():
    c = cfg()
    for step in range(10, 111):
        progress = min((step - 10) / 100, 1.0)
        assert lr_at(step, c) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * progress)))
    assert [lr_at(s, c) for s in range(3)] == pytest.approx([0.1, 0.2, 0.3])  # warmup


def test_linear_and_constant():
    lin, const = cfg(lr_schedule="linear"), cfg(lr_schedule="constant")
    assert lr_at(60, lin) == pytest.approx(0.55) and lr_at(110, lin) == pytest.approx(0.1)
    assert {lr_at(s, const) for s in range(10, 200)} == {1.0}


@pytest.mark.parametrize("shape", ["linear", "cosine", "sqrt"])
def test_wsd_holds_then_decays_over_the_last_fraction(shape):
    c = cfg(lr_schedule="wsd", decay_fraction=0.2, decay_shape=shape, max_steps=100)
    assert all(lr_at(s, c) == 1.0 for s in range(10, 80))  # stable: warmup end .. max_steps - 20
    decay = [lr_at(s, c) for s in range(80, 101)]
    assert decay[0] == pytest.approx(1.0) and decay[-1] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(decay, decay[1:]))  # strictly down to min_lr
    middle = {"linear": 0.55, "cosine": 0.55, "sqrt": 0.1 + 0.9 * (1 - math.sqrt(0.5))}[shape]
    assert lr_at(90, c) == pytest.approx(middle)
    if shape == "cosine":
        assert lr_at(85, c) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.25)))


def test_wsd_decay_never_starts_inside_the_warmup():
    c = cfg(lr_schedule="wsd", decay_fraction=1.0, max_steps=50)
    assert lr_at(9, c) == pytest.approx(1.0) and lr_at(10, c) == pytest.approx(1.0)
    assert lr_at(50, c) == pytest.approx(0.1)


def test_the_scheduler_resumes_where_it_stopped():
    """LambdaLR's state is its step: a scheduler loaded from another's state gives the same rates."""
    c = cfg(lr_schedule="wsd", decay_fraction=0.5, max_steps=40)

    def make():
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=c.lr)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, c) / c.lr)

    opt, sched = make()
    rates = []
    for _ in range(40):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    opt2, sched2 = make()
    opt3, sched3 = make()
    for _ in range(25):
        opt3.step()
        sched3.step()
    opt2.load_state_dict(opt3.state_dict())  # as a checkpoint restores both
    sched2.load_state_dict(sched3.state_dict())
    resumed = []
    for _ in range(15):
        resumed.append(opt2.param_groups[0]["lr"])
        opt2.step()
        sched2.step()
    assert resumed == pytest.approx(rates[25:])


def test_max_tokens_sets_max_steps(tmp_path):
    c = load_config(None, ["train.max_tokens=100000", "train.global_batch_size=8", "model.seq_len=256"])
    assert c.train.max_steps == math.ceil(100000 / (8 * 256)) == 49
    save_config(c, tmp_path / "config.yaml")  # a run directory's config carries both, in agreement
    assert load_config(tmp_path / "config.yaml").train.max_steps == 49
    with pytest.raises(ConfigError, match=r"train.max_tokens=100000 is 49 steps .* train.max_steps=10"):
        load_config(None, ["train.max_tokens=100000", "train.max_steps=10"])
    assert load_config(None, ["train.max_steps=7"]).train.max_steps == 7  # max_tokens=0: steps decide


@pytest.mark.parametrize(
    "override,key",
    [("train.lr_schedule=step", "train.lr_schedule"), ("train.decay_shape=exp", "train.decay_shape"),
     ("train.decay_fraction=0", "train.decay_fraction"), ("train.max_tokens=-1", "train.max_tokens")],
)  # fmt: skip
def test_bad_schedule_keys_are_named(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_defaults_keep_the_cosine_schedule():
    assert dataclasses.asdict(TrainConfig())["lr_schedule"] == "cosine"


# ---- batch ramp-up --------------------------------------------------------------------------------------
def brute_steps(tokens: int, final: int, ramp, seq_len: int) -> int:
    samples = steps = 0
    while samples * seq_len < tokens:
        samples += batch_at(samples, final, ramp, seq_len)
        steps += 1
    return steps


def test_rampup_sizes_follow_the_samples_consumed():
    ramp, seq = [4, 4, 64 * 30], 64  # 3 levels below 16: 10 samples at each of 4, 8, 12
    assert [batch_at(s, 16, ramp, seq) for s in (0, 9, 10, 19, 20, 29, 30, 10**6)] == [
        4,
        4,
        8,
        8,
        12,
        12,
        16,
        16,
    ]
    assert ramp_sizes(16, ramp) == [4, 8, 12, 16] and ramp_sizes(16, None) == [16]
    assert batch_at(0, 16, None, seq) == 16


@pytest.mark.parametrize("ramp", [None, [4, 4, 64 * 30], [2, 6, 1000], [1, 1, 64 * 7]])
@pytest.mark.parametrize("tokens", [1, 64 * 5, 64 * 31, 64 * 1000 + 3])
def test_steps_for_tokens_counts_whole_steps(ramp, tokens):
    final = 8 if ramp == [1, 1, 64 * 7] else 20 if ramp == [2, 6, 1000] else 16
    assert steps_for_tokens(tokens, final, ramp, 64) == brute_steps(tokens, final, ramp, 64)


def test_max_tokens_counts_the_ramp():
    c = load_config(None, ["train.max_tokens=8192", "train.global_batch_size=8", "model.seq_len=64",
                           "train.batch_rampup=[4,4,2816]"])  # fmt: skip
    assert c.train.max_steps == 11 + math.ceil((8192 // 64 - 44) / 8) == 22


@pytest.mark.parametrize("ramp", ["[4,4]", "[0,4,100]", "[8,4,100]", "[3,2,100]", "[4,4,1.5]"])
def test_a_bad_rampup_is_named(ramp):
    with pytest.raises(ConfigError, match=r"train\.batch_rampup"):
        load_config(None, ["train.global_batch_size=8", f"train.batch_rampup={ramp}"])


def test_the_planner_names_the_ramp_and_sizes_the_trainer_would_refuse():
    from goat_dist.plan.hardware import gpu
    from goat_dist.plan.planner import make_plan

    fine = load_config(
        None, ["train.global_batch_size=64", "train.micro_batch_size=1", "train.batch_rampup=[16,16,100000]"]
    )
    notes = " ".join(make_plan(fine, 1, 8, gpu("h100-80gb"))["notes"])
    assert "3 smaller global batches first (16 to 48 sequences" in notes and "refuses" not in notes
    odd = load_config(
        None, ["train.global_batch_size=64", "train.micro_batch_size=1", "train.batch_rampup=[4,4,100000]"]
    )
    assert "[4, 12, 20, 28, 36, 44, 52, 60] are not divisible" in " ".join(
        make_plan(odd, 1, 8, gpu("h100-80gb"))["notes"]
    )


ISSUE_RAMP = ["train.batch_rampup=[4,4,40960]", "train.global_batch_size=8", "train.micro_batch_size=4"]


def test_a_ramp_the_layout_cannot_divide_is_named_with_a_fix():
    """The ramp's start, not train.global_batch_size (already 8), is what DP 2 x micro-batch 4 can't split."""
    from goat_dist.distributed import LayoutError
    from goat_dist.trainer.trainer import gradient_accumulation

    with pytest.raises(LayoutError) as err:
        gradient_accumulation(load_config(None, ISSUE_RAMP), 2)
    message = str(err.value)
    assert "train.batch_rampup=[4, 4, 40960] takes global batches of 4 sequences" in message
    assert "train.global_batch_size=4" not in message and "set train.global_batch_size" not in message
    assert "set train.micro_batch_size=2 (the largest that divides every size)" in message
    assert "train.batch_rampup=null" in message
    # where a ramp of multiples of micro-batch x DP exists, it is the fix named first, and it works
    cfg = load_config(None, ["train.global_batch_size=64", "train.micro_batch_size=1",
                             "train.batch_rampup=[4,4,100000]"])  # fmt: skip
    with pytest.raises(LayoutError, match=r"; set train\.batch_rampup=\[8,8,100000\] \(multiples of 8\)"):
        gradient_accumulation(cfg, 8)
    fixed = load_config(None, ["train.global_batch_size=64", "train.micro_batch_size=1",
                               "train.batch_rampup=[8,8,100000]"])  # fmt: skip
    assert gradient_accumulation(fixed, 8) == 8


def test_a_resume_checks_only_the_ramp_sizes_still_to_come(tmp_path):
    """Past the ramp (10 samples of 4 = 640 tokens of 64), only the final size must divide; mid-ramp, the
    sizes left still do."""
    import json

    from goat_dist.distributed import LayoutError
    from goat_dist.rampup import sizes_to_come
    from goat_dist.trainer.resolve import saved_consumed_samples
    from goat_dist.trainer.trainer import gradient_accumulation

    cfg = load_config(None, [*ISSUE_RAMP, "model.seq_len=64", "train.batch_rampup=[4,4,640]"])
    assert sizes_to_come(0, 8, [4, 4, 640], 64) == [4, 8] and sizes_to_come(10, 8, [4, 4, 640], 64) == [8]
    assert gradient_accumulation(cfg, 2, consumed_samples=10) == 1
    with pytest.raises(LayoutError, match=r"train\.batch_rampup"):
        gradient_accumulation(cfg, 2, consumed_samples=9)
    step = tmp_path / "step_00000003"
    step.mkdir()
    (step / "trainer_state.json").write_text(json.dumps({"step": 3, "run_state": {"consumed_samples": 12}}))
    assert saved_consumed_samples(step) == 12
    assert saved_consumed_samples(None) == 0 and saved_consumed_samples(tmp_path) == 0  # no record: from 0
