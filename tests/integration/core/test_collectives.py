"""Collectives that a GPU run accepts: the process-group backend, and one control collective per step."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
from harness.multiproc import in_process_config

from goat_dist import distributed
from goat_dist.trainer.control import FINGERPRINT_MOD, agree


def test_cuda_run_creates_an_nccl_only_world(monkeypatch):
    """A CUDA run's world group is NCCL only, no gloo side (a mesh of world - 1 sockets per rank): the
    rare host-side collectives pass CPU tensors to ``collectives``, which copies them to the device for it
    (checked here by faking CUDA; the GPU suite runs it for real); every later group inherits NCCL
    (tests/integration/core/test_process_groups.py)."""
    seen = {}

    class Stop(Exception):
        pass

    def fake_init_process_group(backend=None, **kwargs):
        seen["backend"] = backend
        raise Stop

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", fake_init_process_group)
    monkeypatch.setattr(distributed, "apply_cpu_compat", lambda: False)
    monkeypatch.setattr(distributed, "_configure_cuda", lambda tp, run_dir: None)  # NCCL's env, not here
    with pytest.raises(Stop):
        distributed.init(tp=1)
    assert seen["backend"] == "nccl"  # no gloo side: host values are copied to the device (collectives)
    assert distributed.backend_for(False) == "gloo"


def test_agree_folds_the_step_into_one_vector(world1):
    control = agree(
        loss_sum=torch.tensor(6.0),
        micro_batches=3,
        nonfinite_loss=torch.tensor(0),
        nonfinite_grad=torch.tensor(1.0),
        fingerprint=FINGERPRINT_MOD + 5,
        skipped=2,
        valid_labels=7,
        signal="SIGTERM",
        save=False,
        stop="deadline",
        tp=1,
        dp=1,
    )
    assert control.loss == 2.0 and control.fingerprint == 5 and control.skipped == 2
    assert control.valid_labels == 7 and not control.unreadable and control.dropped  # dropped: the NaN grad
    assert control.nonfinite and control.nonfinite_grad == 1 and control.nonfinite_loss == 0
    assert control.signal and control.stop and not control.save and control.stop_reason == "SIGTERM"
    nan = agree(
        torch.tensor(float("nan")), 1, torch.tensor(1), torch.tensor(0.0), 0, 0, 5, False, False, False, 1, 1
    )
    assert nan.nonfinite_loss == 1 and nan.loss == 0.0  # the flag carries the NaN, the sum stays clean


def test_agree_carries_the_count_of_labels_with_loss(world1):
    """A finite step whose global batch has no label with loss is ``unreadable``, and its update dropped;
    one label with loss anywhere in the global batch is enough to train."""

    def step(valid_labels: int, skipped: int = 4):
        zero = torch.tensor(0.0)
        return agree(zero, 2, zero, zero, 0, skipped, valid_labels, False, False, False, tp=1, dp=1)

    empty = step(0)
    assert empty.valid_labels == 0 and empty.unreadable and empty.dropped and not empty.nonfinite
    assert empty.skipped == 4
    one = step(1)
    assert one.valid_labels == 1 and not one.unreadable and not one.dropped
    big = 2**40 + 3  # far more labels than any global batch: still exact in the float64 vector
    assert step(big, skipped=0).valid_labels == big


def test_one_control_collective_per_step(world1, builtin_cache, tmp_path, monkeypatch):
    """The hot loop makes one blocking collective of its own per step (DeepSpeed's gradient traffic
    aside): loss, fingerprint, skip count, non-finite flags and the stop/save decisions travel together."""
    from goat_dist.trainer import Trainer

    cfg = in_process_config(
        builtin_cache, tmp_path, "checkpoint.interval_minutes=60", "train.time_limit_minutes=600"
    )
    trainer = Trainer(cfg, callbacks=[])
    it = trainer.start_loop()
    trainer.loop.first_step = -10  # past the one-off memory measurement of the second step
    calls = []

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            frame = sys._getframe(1)  # the caller of goat_dist.collectives, the collectives' one home
            while frame is not None and frame.f_globals.get("__name__") == "goat_dist.collectives":
                frame = frame.f_back
            caller = frame.f_globals.get("__name__", "") if frame is not None else ""
            if caller.startswith("goat_dist"):
                calls.append((name, caller))
            return fn(*args, **kwargs)

        return wrapper

    for name in ("all_reduce", "broadcast", "all_gather", "barrier", "all_gather_object", "reduce"):
        monkeypatch.setattr(dist, name, counting(name, getattr(dist, name)))
    for _ in range(3):
        trainer.train_step(it)
    assert calls == [("all_reduce", "goat_dist.trainer.control")] * 3


PROBE_TIMEOUTS = """
import torch, torch.distributed as dist
from megatron.core import parallel_state
from goat_dist import distributed
distributed.init(tp=1, timeout_minutes=0.75)
cpu = torch.device("cpu")
world = dist.group.WORLD._get_backend(cpu).options._timeout.total_seconds()
tp = parallel_state.get_tensor_model_parallel_group()._get_backend(cpu).options._timeout.total_seconds()
print("TIMEOUTS", world, tp, parallel_state._DATA_PARALLEL_GROUP_GLOO is None)
"""


def test_every_group_gets_the_configured_timeout_and_no_megatron_gloo_duplicates():
    """parallel.timeout_minutes reaches the default group and megatron's groups (a mixed backend string
    would otherwise get torch's 30 minutes), a fraction of a minute unrounded (megatron's argument is
    typed as whole minutes: rounded up, its groups got 60 s); megatron's extra gloo groups are not
    created."""
    from harness.multiproc import marked_line

    assert marked_line(["-c", PROBE_TIMEOUTS], "TIMEOUTS").split() == ["45.0", "45.0", "True"]


def test_precision_auto_is_deepspeeds_bf16_mode_on_cuda_and_fp32_on_cpu(world1, builtin_cache, tmp_path):
    import torch
    from harness.multiproc import in_process_config

    from goat_dist.engine.build import deepspeed_config
    from goat_dist.engine.patches import PRIOR_FP32_STAGES
    from goat_dist.precision import autocast_context, resolve_precision
    from goat_dist.trainer.trainer import Trainer

    cuda = torch.device("cuda", 0)
    assert resolve_precision("auto", cuda) == "bf16"
    assert resolve_precision("auto", torch.device("cpu")) == "fp32"
    assert resolve_precision("fp32", cuda) == "fp32"
    # what the trainer builds on CUDA from "auto": DeepSpeed's bf16 mode (fp32 masters; the prior stays
    # fp32 under ZeRO 0-2), with bf16 autocast; not autocast over fp32 DeepSpeed weights
    on_cuda = in_process_config(builtin_cache, tmp_path / "cuda", "train.precision=auto")
    on_cuda.train.precision = resolve_precision(on_cuda.train.precision, cuda)
    assert deepspeed_config(on_cuda, 1)["bf16"] == {"enabled": True}
    assert on_cuda.parallel.zero_stage in PRIOR_FP32_STAGES
    assert autocast_context(on_cuda, cuda)().fast_dtype == torch.bfloat16
    cfg = in_process_config(builtin_cache, tmp_path / "run", "train.precision=auto", "train.max_steps=1")
    trainer = Trainer(cfg)
    assert trainer.cfg.train.precision == "fp32"  # resolved before the engine was built
    assert trainer.layout_record()["precision"] == "fp32"
    trainer.fit()
    assert "precision: fp32" in (tmp_path / "run" / "config.yaml").read_text()  # the saved config says so


def test_a_lost_peer_is_recorded_by_another_rank_when_rank0_is_silent(tmp_path, monkeypatch):
    """A collective that timed out names the timeout in last_exit.json; rank 0 may be the frozen one, so
    another rank writes the record when rank 0 has not within the grace period, and only then."""
    import json

    from goat_dist.trainer import entry

    error = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 60000ms for recv")
    reason = distributed.collective_failure(error, 1.0)
    assert reason.startswith("a collective timed out (parallel.timeout_minutes=1)") and "60000ms" in reason
    reset = RuntimeError("Read error [127.0.0.1]:1: Connection reset by peer")
    assert "lost its connection to a peer" in distributed.collective_failure(reset, 10.0)
    assert distributed.collective_failure(ValueError("bad value"), 1.0) is None

    cfg = in_process_config(tmp_path, tmp_path / "run")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(entry, "QUIET_RANK_GRACE_S", 0.3)
    entry._record_exit(cfg, "failed", "ValueError: mine alone", 3, 1)  # not a lost peer: rank 0's to say
    assert not (tmp_path / "run" / "last_exit.json").exists()
    entry._record_exit(cfg, "failed", reason, 3, 1, any_rank=True)  # rank 0 silent: this rank writes
    record = json.loads((tmp_path / "run" / "last_exit.json").read_text())
    assert record["status"] == "failed" and record["reason"] == reason and record["step"] == 3
    entry._record_exit(cfg, "failed", "another rank's reason", 3, 1, any_rank=True)  # one is there: kept
    assert json.loads((tmp_path / "run" / "last_exit.json").read_text())["reason"] == reason


def _requests_on_different_ranks(layout):
    """Rank 1 asks for a save, rank 0 for a stop; nothing else is unusual."""
    zero = torch.tensor(0.0)
    control = agree(
        zero, 1, zero, zero, 0, 0, 1, False, layout.rank == 1, "enough" if layout.rank == 0 else None, 1, 2
    )
    return {"save": control.save, "stop": control.stop, "reason": control.stop_reason}


@pytest.mark.slow
def test_a_request_on_one_rank_is_seen_by_every_rank_at_that_step():
    """``Trainer.request_save`` / ``request_stop`` ride in the step's one collective: a save asked on
    rank 1 and a stop asked on rank 0 both reach both ranks in the same ``agree``; a rank that did not
    ask knows only that another rank did."""
    from harness.distributed import run_distributed

    ranks = run_distributed(_requests_on_different_ranks, world=2)
    assert all(r["save"] and r["stop"] for r in ranks), ranks
    assert ranks[0]["reason"] == "enough"
    assert "another rank" in ranks[1]["reason"], ranks[1]
