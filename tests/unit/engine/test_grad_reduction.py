"""The dtype gradients are reduced in (``parallel.grad_reduce_dtype``) and accumulated in
(``parallel.grad_accum_dtype``): what the engine's DeepSpeed config asks for, and that the planner's memory
model assumes the same (no process group)."""

from __future__ import annotations

import pytest
from harness.multiproc import one_layer_config

from goat_dist.config import ConfigError
from goat_dist.engine.build import deepspeed_config
from goat_dist.plan import memory


def ds(stage: int, precision: str, accum: int = 1, *extra: str) -> dict:
    cfg = one_layer_config(f"parallel.zero_stage={stage}", f"train.precision={precision}", *extra)
    return deepspeed_config(cfg, accum)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_reduces_gradients_in_fp32_by_default_and_in_bf16_when_chosen(stage):
    assert ds(stage, "bf16")["communication_data_type"] == "fp32"
    chosen = ds(stage, "bf16", 4, "parallel.grad_reduce_dtype=bf16")
    assert chosen["communication_data_type"] == "bf16"
    assert chosen["data_types"] == {"grad_accum_dtype": "fp32"}  # the accumulation is its own key


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp32_runs_leave_deepspeeds_fp32_defaults_alone(stage):
    for key in ("fp32", "bf16"):
        config = ds(stage, "fp32", 4, f"parallel.grad_reduce_dtype={key}")
        assert "communication_data_type" not in config and "data_types" not in config
        assert config["bf16"] == {"enabled": False}


def test_bf16_accumulates_in_fp32_at_every_stage_unless_bf16_is_chosen():
    """Every ZeRO stage accumulates micro-batches in fp32 by default; ``parallel.grad_accum_dtype=bf16``
    keeps DeepSpeed's bf16 sums; one micro-batch accumulates nothing, unless a batch ramp-up will have more
    (the optimizer is chosen once)."""
    for stage in range(4):
        assert ds(stage, "bf16", 4).get("data_types") == {"grad_accum_dtype": "fp32"}, stage
        assert "data_types" not in ds(stage, "bf16", 4, "parallel.grad_accum_dtype=bf16"), stage
        assert "data_types" not in ds(stage, "bf16", 1), stage
        ramp = ds(stage, "bf16", 1, "train.global_batch_size=64", "train.batch_rampup=[16,16,1000]")
        assert ramp.get("data_types") == {"grad_accum_dtype": "fp32"}, stage


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("key", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_planner_assumes_the_engines_gradient_dtypes(stage, key, precision):
    """``plan.memory``'s reduce width and fp32 accumulation are the engine config's, with the planner's
    own micro-batch count (global 8 = micro 2 x DP 2 x 2 micro-batches; at DP 4, one)."""
    over = [f"parallel.grad_reduce_dtype={key}", "train.global_batch_size=8"]
    cfg = one_layer_config(f"parallel.zero_stage={stage}", f"train.precision={precision}", *over)
    for replicas, accum in ((2, 2), (4, 1)):
        config = deepspeed_config(cfg, accum)
        wire = config.get("communication_data_type", "fp32" if precision == "fp32" else "bf16")
        assert memory._reduce_bytes(cfg) == {"fp32": 4, "bf16": 2}[wire]
        fp32_accum = config.get("data_types", {}).get("grad_accum_dtype") == "fp32"
        assert memory._fp32_accumulation(cfg, replicas) == fp32_accum, (replicas, accum)


def test_the_keys_are_validated():
    for key in ("grad_reduce_dtype", "grad_accum_dtype"):
        with pytest.raises(ConfigError, match=f"parallel.{key}"):
            one_layer_config(f"parallel.{key}=fp16")
        assert getattr(one_layer_config().parallel, key) == "fp32"
