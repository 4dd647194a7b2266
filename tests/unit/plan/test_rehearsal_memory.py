"""One rank's training step traced on CPU fake tensors (``goat_dist.rehearsal.memory``): no storage is
allocated, and what the trace holds agrees with the planner's terms within 10 % (or a note says why)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from harness.multiproc import ROOT, clean_env

from goat_dist.config import load_config
from goat_dist.rehearsal.memory import CATEGORIES, TOLERANCE, _cuda_autocast_norms, compare_with_plan

CONFIGS = ROOT / "configs"
TINY = CONFIGS / "tiny.yaml"
GOAT_30B = CONFIGS / "models" / "goat_30b.yaml"
# the 30B config's layout before it took plan --search's (ZeRO-3 at TP 2): what these cases trace
TP8_ZERO1 = ["parallel.tp=8", "parallel.zero_stage=1", "train.micro_batch_size=4",
             "train.activation_checkpointing=none"]  # fmt: skip
COMPARED = ("params", "grads", "optimizer", "state", "activations")
# name: (config, overrides, rank, world); tiny accumulates 2 micro-batches (the peak the plan plans for);
# tiny comes first so that the 30B's resident-memory growth is its trace's alone, not the lazy imports
CASES = {
    "tiny": (TINY, ["train.global_batch_size=16"], 0, 1),
    "tiny, one micro-batch": (TINY, [], 0, 1),
    "tiny, ZeRO-3": (TINY, ["parallel.zero_stage=3", "train.global_batch_size=32"], 1, 2),
    "tiny, ALiBi": (TINY, ["model.position=alibi"], 0, 1),
    "30b": (GOAT_30B, ["model.num_layers=2", *TP8_ZERO1], 511, 512),
}
# each case traced from its frozen config (a run's resolved config, as the rehearsal passes it), with the
# growth of the process's resident memory: VmHWM after (the peak, reset before) minus VmRSS before
PROGRAM = r"""
import json, re, sys
from pathlib import Path
from goat_dist.config import load_config
from goat_dist.rehearsal.memory import trace_memory

def status(key):
    return int(re.search(key + r":\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024

out = {}
for name, (path, overrides, rank, world) in json.loads(sys.argv[1]).items():
    cfg = load_config(path, overrides).frozen()
    before = status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # Linux: reset the peak resident set size
    traced = trace_memory(cfg, rank, world)
    out[name] = {**traced, "rss_growth": status("VmHWM") - before}
print("TRACES " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def traces():
    """Every case traced in one fresh process: the test process may hold a torch.distributed world (the
    session's ``world1``) and the trace builds a fake one; a fresh process also measures memory cleanly."""
    cases = {name: [str(path), *rest] for name, (path, *rest) in CASES.items()}
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAM, json.dumps(cases)],
        env=clean_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("TRACES ")), None)
    assert line, proc.stderr[-3000:]
    return json.loads(line[len("TRACES ") :])


def _rows(traces, name: str) -> dict[str, dict]:
    path, overrides, _, world = CASES[name]
    cfg = load_config(path, overrides).frozen()
    return {row["term"]: row for row in compare_with_plan(cfg, world, traces[name])}


@pytest.mark.parametrize("name", ["tiny", "30b"])
def test_every_category_of_the_peak_is_there_and_they_add_up(traces, name):
    traced = traces[name]
    assert all(traced[key] > 0 for key in CATEGORIES), traced
    assert sum(traced[key] for key in CATEGORIES) == traced["total"] > 0
    assert traced["peak_phase"] in ("forward", "backward")  # the loss's peak, not the step's
    assert traced["seconds"] < 60


@pytest.mark.parametrize("name", ["tiny", "30b", "tiny, ZeRO-3"])
def test_state_and_activations_match_the_plan(traces, name):
    rows = _rows(traces, name)
    for term in COMPARED:
        assert rows[term]["within"], rows[term]
        assert abs(rows[term]["ratio"] - 1) <= TOLERANCE
    # the transient, split by when it peaks: the loss's copies of the logits, the step's gradients
    assert rows["transient:activations"]["within"], rows["transient:activations"]
    assert rows["transient:step"]["ratio"] is None or rows["transient:step"]["within"], rows["transient:step"]


def test_the_30b_rank_holds_what_zero1_and_sequence_parallelism_say(traces):
    traced = traces["30b"]
    assert (traced["tp"], traced["dp"], traced["tp_rank"], traced["dp_rank"]) == (8, 64, 7, 63)
    state = traced["state"]
    # bf16 weights, their whole bf16 gradients (mid-accumulation) and BF16_Optimizer's whole fp32 sums
    # (2 + 4 bytes per element: fp32 accumulation); 12 B per element over 64 for Adam
    assert state["grads"] == pytest.approx(3 * state["params"], rel=1e-3)
    assert state["optimizer"] == pytest.approx(12 * state["params"] / 2 / 64, rel=0.01)
    rows = _rows(traces, "30b")
    assert "SP all-gather buffer" in rows["activations"]["note"]  # megatron's fp32 gather buffer, counted
    # BF16_Optimizer keeps no reduce bucket in its state (its all-reduce's flat copy is a transient)
    assert "DeepSpeed's buffers" not in rows["state"]["note"]
    # the plan sums transients that never coincide; the row says so instead of passing silently
    assert not rows["transient"]["within"] and "do not coincide" in rows["transient"]["note"]


def test_the_trace_allocates_nothing(traces):
    planned = _rows(traces, "30b")["total"]["planned"]  # ~2.7 GB on a GPU
    assert 0 < traces["30b"]["total"] and traces["30b"]["rss_growth"] < planned / 20, traces["30b"][
        "rss_growth"
    ]


def test_without_accumulation_the_loss_peaks_before_any_gradient_exists(traces):
    """One micro-batch a step: the gradients are made while the activations are freed, so the peak holds
    none, and the plan's state + activations + transient is an upper bound the transient row explains."""
    traced = traces["tiny, one micro-batch"]
    assert traced["grad_accum"] == 1 and traced["grads"] == 0 < traced["state"]["grads"]
    rows = _rows(traces, "tiny, one micro-batch")
    assert rows["transient"]["ratio"] < 1 and "one micro-batch a step" in rows["transient"]["note"]


def test_a_term_off_the_plan_without_a_known_reason_is_flagged(traces):
    _, overrides, _, world = CASES["30b"]
    off = {**traces["30b"], "saved_activations": int(traces["30b"]["saved_activations"] * 1.3)}
    row = next(
        r
        for r in compare_with_plan(load_config(GOAT_30B, overrides), world, off)
        if r["term"] == "activations"
    )
    assert row["within"] is False and "not explained" in row["note"]


def test_zero3_partitions_are_counted_as_zero_divides_them(traces):
    traced = traces["tiny, ZeRO-3"]
    assert traced["zero_counted"] == ["grads", "params"] and traced["grad_accum"] == 2
    assert traced["state"]["params"] < 0.6 * traces["tiny"]["state"]["params"]  # about half, over 2 ranks


def test_sdpa_math_path_l_by_l_tensors_are_left_out_where_the_plan_has_flash(traces):
    """ALiBi through SDPA takes a mask: SDPA's CPU math path keeps L x L probabilities, which the plan's
    flash kernel (``attention_backend=auto`` on a GPU) never makes."""
    traced = traces["tiny, ALiBi"]
    assert traced["quadratic_bytes"] > 0.1 * traced["saved_activations"]
    rows = _rows(traces, "tiny, ALiBi")
    assert rows["activations"]["within"] and "L x L" in rows["activations"]["note"], rows["activations"]


def test_norms_run_in_fp32_under_autocast_as_on_cuda_and_only_while_tracing():
    x, w = torch.randn(2, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.rms_norm(x, (8,), w).dtype == torch.bfloat16  # CPU autocast leaves it alone
        with _cuda_autocast_norms():
            assert F.rms_norm(x, (8,), w).dtype == torch.float32
            assert F.layer_norm(x, (8,), w).dtype == torch.float32
        assert F.rms_norm(x, (8,), w).dtype == torch.bfloat16
    with _cuda_autocast_norms():
        assert F.rms_norm(x, (8,), w).dtype == torch.bfloat16  # no autocast: no cast
