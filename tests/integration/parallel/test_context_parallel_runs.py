"""Context parallelism in real multi-process worlds (gloo, CPU), against one process.

The two launches of tests/workers/layout_runs.py (conftest.py, shared with test_scale_out.py) check:

* 2 ranks: CP=2 (checkpoint at step 5), CP=2 with document masking;
* 4 ranks: TP2 x CP2 (+SP) gradients, plain and with packed documents, through the sdpa and the flash
  (stand-in) CP paths; 10-step runs of CP2 x TP2 with SP and of CP2 x DP2 with ZeRO-2.

The references are single-process runs of the same configs in this process. 10-step losses must agree to
1e-4 relative, gradients to 1e-5, and a CP2 checkpoint must resume on one process (CP1) with the
single-process losses from the next step on.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
from harness.layouts import train_here
from harness.multiproc import ROOT, assert_config_is_the_runs, per_step, records

pytestmark = pytest.mark.slow


def assert_same_losses(name: str, got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected) == list(range(1, 11)), name
    for step in expected:
        (loss, fingerprint), (ref, ref_fingerprint) = got[step], expected[step]
        assert fingerprint == ref_fingerprint, f"{name} step {step}: other data than the single process"
        assert abs(loss - ref) <= 1e-4 * abs(ref), f"{name} step {step}: {loss} vs single-process {ref}"
    assert expected[10][0] < expected[1][0]  # it trains


@pytest.mark.parametrize(
    "launch_name,name,reference",
    [
        ("two_ranks", "cp2", "plain"),
        ("two_ranks", "cp2-docs", "documents"),
        ("four_ranks", "cp2-tp2-sp", "plain"),
        ("four_ranks", "cp2-dp2-zero2", "plain"),
    ],
)
def test_context_parallel_losses_equal_one_process(request, references, launch_name, name, reference):
    out = request.getfixturevalue(launch_name)
    assert_same_losses(name, per_step(out / name), per_step(references[reference]))


def test_tp2_cp2_gradients_equal_single_process(world1, four_ranks):
    """TP2 x CP2 (+SP) gradients, sdpa and flash CP paths, plain rows and packed documents."""
    sys.path.insert(0, str(ROOT / "tests" / "workers"))
    from layout_runs import document_batch
    from tp_grads import tiny_batch, tiny_config

    from goat_dist.model import GPT

    sharded = torch.load(four_ranks / "grads.pt", weights_only=True)
    assert sharded["flash_calls"] == ["flash_attn_func", "flash_attn_varlen_func"]
    cfg = tiny_config("goat")
    for batch_name, batch in (("plain", tiny_batch(cfg)), ("documents", document_batch(cfg))):
        torch.manual_seed(0)
        model = GPT(cfg)
        loss = model(*batch)
        loss.backward()
        for backend in ("sdpa", "flash"):
            got = sharded[f"{backend}/{batch_name}"]
            where = f"{backend} CP path, {batch_name}"
            assert abs(got["loss"] - loss.item()) <= 1e-5 * loss.item(), where
            for name, p in model.named_parameters():
                assert got["grads"][name].shape == p.grad.shape, name
                err = (got["grads"][name] - p.grad).abs().max().item()
                assert err <= 1e-5, f"{where}: {name}: max |TP2xCP2 grad - single grad| = {err:.2e}"


def test_cp2_checkpoint_resumes_on_one_process(world1, builtin_cache, references, two_ranks, tmp_path):
    """CP2 -> CP1 through the universal state: from the next step on, the single-process losses."""
    step5 = two_ranks / "cp2" / "checkpoints" / "step_00000005"
    assert (step5 / "universal" / "index.json").is_file()
    got = train_here(builtin_cache, tmp_path / "resumed", f"train.resume={step5}")
    assert sorted(got) == list(range(6, 11))
    assert assert_config_is_the_runs(tmp_path / "resumed")["parallel"]["cp"] == 1
    for step, (loss, fingerprint) in got.items():
        ref, ref_fingerprint = per_step(references["plain"])[step]
        assert fingerprint == ref_fingerprint, f"step {step}"
        assert abs(loss - ref) <= 1e-4 * ref, f"resumed step {step}: {loss} vs uninterrupted {ref}"


def test_cp_evaluates_without_attention_statistics(two_ranks):
    """``log.attention_stats`` (on by default) is skipped under CP; the validation loss is still logged."""
    from goat_dist.observe.attention_stats import FIELDS

    evals = [r for r in records(two_ranks / "cp2-docs") if "val_loss" in r]
    assert [r["step"] for r in evals] == [10]
    assert math.isfinite(evals[0]["val_loss"])
    assert not set(FIELDS) & set(evals[0])
