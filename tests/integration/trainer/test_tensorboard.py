"""What a run writes to TensorBoard, read back with tensorboard's own EventAccumulator."""

from __future__ import annotations

import gzip
import json

import pytest
from harness.multiproc import goat_train_command, records, run
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

pytestmark = pytest.mark.slow

TB_RUN = ["train.max_steps=30", "log.interval=5", "log.tensorboard=true", "log.prior_interval=12",
          "train.eval_interval=15", "train.eval_batches=2"]  # fmt: skip
SCALARS = [
    "loss/train", "train/lr", "train/grad_norm", "train/params_norm",
    "perf/tokens_per_s", "perf/tflops_per_device", "perf/mfu", "perf/step_time_s", "perf/prior_s",
    "mem/allocated_gib/max", "mem/peak_gib/min", "mem/peak_gib/mean", "mem/peak_gib/max",
    "mem/peak_gib/max_rank", "mem/host_rss_gib/max",
    "train/tokens_seen", "train/epoch", "train/skipped_samples", "train/nonfinite_skipped_steps",
    "loss/val", "val/ppl",
    "val/attn/layer_0/sink_mass", "val/attn/layer_1/sink_mass",
    "val/attn/layer_0/entropy", "val/attn/layer_1/entropy",
    "val/attn/layer_0/local_mass", "val/attn/layer_1/local_mass",
]  # fmt: skip


def events(run_dir) -> EventAccumulator:
    acc = EventAccumulator(
        str(run_dir / "tensorboard"), size_guidance={"images": 0, "tensors": 0, "scalars": 0}
    )
    acc.Reload()
    return acc


def series(acc: EventAccumulator, tag: str) -> dict[int, float]:
    return {e.step: e.value for e in acc.Scalars(tag)}


@pytest.fixture(scope="module")
def tb_run(tmp_path_factory, builtin_cache):
    run_dir = tmp_path_factory.mktemp("tb") / "run"
    run(goat_train_command(1, [*TB_RUN, f"data.cache_dir={builtin_cache}", f"run.dir={run_dir}"]))
    return run_dir


def test_every_tag_prior_pictures_and_run_text(tb_run):
    acc = events(tb_run)
    tags = acc.Tags()
    assert sorted(set(SCALARS) - set(tags["scalars"])) == []
    assert sorted(tags["scalars"])[:2] == ["loss/train", "loss/val"]  # TensorBoard opens on the losses
    assert {f"prior/layer_{i}/{k}" for i in (0, 1) for k in ("curves", "log_prior")} <= set(tags["images"])
    image = acc.Images("prior/layer_1/curves")
    # every log.prior_interval steps, and at the last step
    assert [e.step for e in image] == [12, 24, 30] and image[0].width > 400 and image[0].height > 200
    config = acc.Tensors("run/config/text_summary")[0].tensor_proto.string_val[0].decode()
    version = acc.Tensors("run/code_version/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "prior_interval: 12" in config and "eval_interval: 15" in config
    assert version.startswith("goat-dist ")
    assert len(list((tb_run / "tensorboard").glob("events.out.tfevents.*"))) == 1


def test_tensorboard_and_metrics_jsonl_agree(tb_run):
    acc, recs = events(tb_run), records(tb_run)
    logged = [r for r in recs if "loss" in r]
    assert [r["step"] for r in logged] == [1, 5, 10, 15, 20, 25, 30]
    pairs = {
        "loss/train": "loss",
        "train/params_norm": "params_norm",
        "perf/mfu": "mfu",
        "train/epoch": "epoch",
        "perf/step_time_s": "step_time_s",
        "train/tokens_seen": "consumed_tokens",
    }
    for tag, key in pairs.items():
        tb = series(acc, tag)
        assert sorted(tb) == [r["step"] for r in logged], tag
        for r in logged:
            assert tb[r["step"]] == pytest.approx(r[key], rel=1e-6), (tag, r["step"])
    assert series(acc, "mem/peak_gib/max")[30] == pytest.approx(logged[-1]["mem_peak_gib_max"], rel=1e-6)
    assert "mem_peak_gib" not in logged[-1]  # per-rank lists only with log.memory_per_rank
    assert not any(tag.startswith("mem/rank_") for tag in acc.Tags()["scalars"])
    evals = [r for r in recs if "val_loss" in r]
    assert [r["step"] for r in evals] == [15, 30]
    assert series(acc, "val/ppl")[30] == pytest.approx(evals[-1]["val_ppl"], rel=1e-6)
    assert series(acc, "val/attn/layer_1/entropy")[15] == pytest.approx(evals[0]["attn_entropy"][1], rel=1e-5)
    priors = [r for r in recs if r.get("event") == "prior"]
    assert [r["step"] for r in priors] == [12, 24, 30] and all(r["seconds"] > 0 for r in priors)


def test_values_make_sense(tb_run):
    acc, logged = events(tb_run), [r for r in records(tb_run) if "loss" in r]
    assert series(acc, "train/tokens_seen")[30] == 30 * 8 * 64  # TINY: 8 sequences of 64 per step
    assert series(acc, "train/skipped_samples")[30] == 0 and series(acc, "train/epoch")[30] > 0
    assert all(r["params_norm"] > 1 and 0 < r["mfu"] and r["tflops_per_device"] > 0 for r in logged)
    assert logged[-1]["params_norm"] != logged[0]["params_norm"]
    assert series(acc, "val/ppl")[30] == pytest.approx(2.718281828 ** series(acc, "loss/val")[30], rel=1e-4)
    for layer in (0, 1):
        sink, local = (
            series(acc, f"val/attn/layer_{layer}/sink_mass")[30],
            series(acc, f"val/attn/layer_{layer}/local_mass")[30],
        )
        assert 0 < sink < 1 and 0 < local <= 1
        assert 0 < series(acc, f"val/attn/layer_{layer}/entropy")[30] < 4.2  # below log(64 keys), above 0


def test_tensor_parallel_run_logs_the_same_norm_from_rank_0_only(tb_run, tmp_path, builtin_cache):
    """TP=2 under torchrun: the parameter norm is reduced correctly (TP1 and TP2 weights are identical),
    every rank's memory is logged on request (log.memory_per_rank), the prior pictures gather both ranks'
    heads, one event file. The profiler traces steps 2-3 on rank 1 only (log.profile_ranks)."""
    run_dir = tmp_path / "tp2"
    overrides = [
        "parallel.tp=2",
        "train.max_steps=3",
        "log.interval=1",
        "log.tensorboard=true",
        "log.prior_interval=3",
        "train.eval_interval=3",
        "train.eval_batches=2",
        "log.prior_heads=[0,3]",
        "log.memory_per_rank=true",
        "log.profile_steps=[2,3]",
        "log.profile_ranks=[1]",
        f"data.cache_dir={builtin_cache}",
        f"run.dir={run_dir}",
    ]
    run(goat_train_command(2, overrides))
    profiled = run_dir / "profile" / "steps2-3"
    assert sorted(p.name for p in profiled.iterdir()) == ["rank1.top_ops.txt", "rank1.trace.json.gz"]
    events_ = json.loads(gzip.decompress((profiled / "rank1.trace.json.gz").read_bytes()))["traceEvents"]
    spans = {e["name"]: e for e in events_ if e.get("name", "").startswith("goat-dist step")}
    assert sorted(spans) == ["goat-dist step 2", "goat-dist step 3"]  # the window, step by step
    step2 = spans["goat-dist step 2"]
    inside = [e for e in events_ if step2["ts"] <= e.get("ts", -1) <= step2["ts"] + step2["dur"]]
    assert any(e.get("name") == "gloo:all_reduce" for e in inside)  # TP's reductions are in the step
    assert "aten::mm" in (profiled / "rank1.top_ops.txt").read_text()
    single = {r["step"]: r for r in records(tb_run) if "loss" in r}
    for r in (r for r in records(run_dir) if "loss" in r):
        if r["step"] in single:
            assert r["lr"] == pytest.approx(single[r["step"]]["lr"])
            assert r["params_norm"] == pytest.approx(single[r["step"]]["params_norm"], rel=1e-5)
        assert len(r["mem_peak_gib"]) == 2
        assert r["mem_peak_gib_max"] == max(r["mem_peak_gib"])
    acc = events(run_dir)
    assert {"mem/rank_1/host_rss_gib", "val/attn/layer_1/sink_mass", "prior/layer_1/log_prior"} <= set(
        acc.Tags()["scalars"] + acc.Tags()["images"]
    )
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1
