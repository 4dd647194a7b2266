"""MFU's ingredients: FLOPs per token by hand for one config, the peak table, the cached CPU probe."""

from __future__ import annotations

import json

import pytest
import torch

from goat_dist.config import GoatConfig, ModelConfig
from goat_dist.observe import flops, peak


def hand_config() -> ModelConfig:
    # GOAT, swiglu, rmsnorm, no bias, tied: h=64, 4 heads of 16, 2 KV heads (GQA), R=2, M=2, L=32
    return ModelConfig(
        vocab_size=300, seq_len=32, num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2,
        ffn_hidden_size=96, activation="swiglu", norm="rmsnorm", bias=False, position="goat",
        vocab_pad_multiple=128, goat=GoatConfig(pos_rank=2, abs_rank=2),
    )  # fmt: skip


def test_flops_per_token_matches_a_hand_count():
    cfg = hand_config()
    # per block, counted by hand:
    #   head_dim 16, prior lanes 2R + 3 = 7, content dims 9
    #   qkv: per KV group 2 query + 1 key head of 9 dims, 1 value head of 16: 2 * (3*9 + 16) = 86 columns
    qkv = 64 * 86
    proj = 64 * 64
    prior = (
        2 * 2 * 2 + (6 * 4 + 4 + 4 + 1) + 3 * 2
    )  # lambdas (2 KV heads x R=2, sym + asym), sink MLP 6->4->1
    mlp = 64 * 2 * 96 + 96 * 64  # swiglu: fused gate+up, down
    norms = 2 * 64
    block = qkv + proj + prior + mlp + norms
    assert block == 5504 + 4096 + 47 + 18432 + 128
    n = 3 * block + 64  # + final norm
    dense = 6 * n
    lm_head = 6 * 64 * 384  # vocab 300 padded to 384
    attention = 6 * 3 * 4 * (16 + 16) * (32 + 1) / 2  # causal: (L + 1) / 2 keys per query on average
    got = flops.flops_per_token(cfg)
    assert flops.non_embedding_params(cfg) == n
    assert got == {
        "dense": dense,
        "lm_head": lm_head,
        "attention": attention,
        "total": dense + lm_head + attention,
    }
    assert got["total"] == 6 * 84685 + 147456 + 38016


@pytest.mark.parametrize("position", ["goat", "rope", "learned"])
def test_non_embedding_params_equal_the_models_own_count(world1, position):
    from goat_dist.model import GPT

    cfg = hand_config()
    cfg.position = position
    model = GPT(cfg)
    embedding = {"embedding.weight", "pos_embedding.weight", "output.weight"}
    counted = sum(p.numel() for name, p in model.named_parameters() if name not in embedding)
    assert flops.non_embedding_params(cfg) == counted


def test_attention_term_grows_with_context_and_counts_the_causal_half():
    cfg = hand_config()
    short, long = flops.flops_per_token(cfg, 32), flops.flops_per_token(cfg, 64)
    assert long["attention"] / short["attention"] == pytest.approx(65 / 33)
    assert long["dense"] == short["dense"]


@pytest.mark.parametrize(
    "name,dtype,expected",
    [
        ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4e12),
        ("NVIDIA H100 PCIe", "bf16", 756e12),
        ("NVIDIA H200", "fp32", 66.9e12),
        ("NVIDIA B200", "bf16", 2250e12),
        ("Tesla T4", "bf16", None),
    ],
)
def test_peak_table_by_device_name(name, dtype, expected):
    assert peak.table_peak(name, dtype) == expected


def test_override_wins_and_cpu_probe_runs_once(tmp_path, monkeypatch):
    """One core's figure is measured once and cached; the peak is that times the thread count."""
    calls = []
    monkeypatch.setattr(peak, "core_flops", lambda dtype: calls.append(dtype) or 5e10)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    cpu = torch.device("cpu")
    assert peak.peak_flops(cpu, "fp32", 12.5, tmp_path) == (12.5e12, "log.peak_tflops")
    first = peak.peak_flops(cpu, "fp32", 0.0, tmp_path)
    second = peak.peak_flops(cpu, "fp32", 0.0, tmp_path)
    assert first[0] == second[0] == 3 * 5e10 and "measured" in first[1] and "3 threads" in first[1]
    assert calls == [torch.float32]  # measured once, then read from the cache file
    cached = json.loads((tmp_path / "peak_flops.json").read_text())
    assert list(cached.values()) == [5e10]


def test_matmul_probe_measures_something_plausible():
    measured = peak.measure_matmul_flops(n=256, seconds=0.05)
    assert 1e8 < measured < 1e14


def test_core_probe_runs_on_one_thread_and_leaves_the_runs_rng_alone():
    """The probe's samples are single products on one thread (a busy machine cannot make it wait for a
    descheduled sibling thread); it restores the thread count and draws nothing from torch's RNG."""
    seen = []
    real_mm = torch.mm

    def mm(a, b):
        seen.append((torch.get_num_threads(), a.shape[0]))
        return real_mm(a, b)

    before_threads, before_rng = torch.get_num_threads(), torch.get_rng_state()
    try:
        torch.mm = mm
        measured = peak.measure_matmul_flops(n=64, seconds=0.01, threads=1)
    finally:
        torch.mm = real_mm
    assert measured > 0 and set(seen) == {(1, 64)}
    assert torch.get_num_threads() == before_threads and torch.equal(torch.get_rng_state(), before_rng)


def test_mfu_over_100_percent_is_capped_and_marked_unreliable():
    from goat_dist.observe.step_metrics import mfu_metrics, mfu_text

    assert mfu_metrics(5e10, 1e11) == {"mfu": 0.5}
    over = mfu_metrics(1.229e11, 1e11)  # the probe ran on a busy machine
    assert over["mfu"] == 1.0 and over["mfu_raw"] == pytest.approx(1.229) and over["mfu_unreliable"]
    assert mfu_text(over) == " (MFU >100%: peak estimate unreliable)"
    assert mfu_text({"mfu": 0.5}) == " (MFU 50.0%)" and mfu_text({}) == ""


def test_measured_peak_below_the_achieved_rate_is_probed_once_more(tmp_path, monkeypatch):
    """A stand-in probe: 1e11 FLOP/s cached under load, 2e11 on the second probe, then never again."""
    from types import SimpleNamespace

    from goat_dist.observe.step_metrics import StepMetrics

    probes = iter([1e11, 2e11])
    calls = []
    monkeypatch.setattr(peak, "core_flops", lambda dtype: calls.append(dtype) or next(probes))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    metrics = StepMetrics.__new__(StepMetrics)
    metrics.cfg = SimpleNamespace(
        train=SimpleNamespace(precision="fp32"), data=SimpleNamespace(cache_dir=tmp_path)
    )
    metrics.layout = SimpleNamespace(device=torch.device("cpu"))
    metrics.peak, metrics.peak_source = peak.peak_flops(torch.device("cpu"), "fp32", 0.0, tmp_path)
    metrics.reprobed = False
    assert metrics.mfu(1.5e11) == {"mfu": pytest.approx(0.75)}  # re-probed: 2e11
    assert metrics.mfu(3e11)["mfu_unreliable"] and len(calls) == 2  # still over: capped, no third probe
    assert list(json.loads((tmp_path / "peak_flops.json").read_text()).values()) == [2e11]
