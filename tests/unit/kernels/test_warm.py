"""``goat-dist kernels warm`` (``goat_dist/kernels/warm.py``): the FA4 calls of a config's training step,
run forward and backward through the project's FA4 entry points (here on the CPU stand-in), and the
reasons it compiles nothing (exit 0, one line saying why) where FA4 would not be called."""

from __future__ import annotations

import argparse
import copy

import pytest
import torch
from harness.flash4_standin import Flash4Standin, installed

from goat_dist.config import load_config
from goat_dist.kernels import flash_imports, warm

CACHE_ON = {warm.CACHE_ENABLED: "1", warm.CACHE_DIR: "/node/fa4"}


def config(*overrides: str):
    return load_config(None, list(overrides))  # the built-in tiny config: GOAT, 8 heads of 32


def test_calls_follow_the_configs_layout():
    (dense,) = warm.warm_calls(config("train.micro_batch_size=2"))
    # GOAT's lanes are folded into q/k: FA4 gets the whole head; the scale is the content dims'
    assert (dense.batch, dense.q_len, dense.k_len, dense.heads, dense.kv_heads, dense.head_dim) == (
        2, 256, 256, 8, 8, 32,
    )  # fmt: skip
    assert dense.scale > 32**-0.5 and not dense.documents
    calls = warm.warm_calls(config("parallel.tp=2", "model.num_kv_heads=4", "data.document_masking=true"))
    assert [(c.what, c.heads, c.kv_heads, c.documents) for c in calls] == [
        ("dense", 4, 2, False),
        ("documents", 4, 2, True),
    ]
    rope = warm.warm_calls(config("model.position=rope"))[0]
    assert rope.scale == 32**-0.5
    cp = warm.warm_calls(config("parallel.cp=2", "data.document_masking=true"))
    assert [(c.q_len, c.k_len, c.documents) for c in cp] == [
        (64, 64, False),
        (64, 256, False),
        (64, 256, True),
    ]


def test_every_call_runs_forward_and_backward_through_fa4():
    """Each kind of call once (dense and packed documents under GQA; a CP chunk against its key prefix,
    dense and varlen), on the stand-in: it holds the calls to the real interface's argument rules."""
    small = ("train.micro_batch_size=2", "model.seq_len=16", "data.document_masking=true")
    calls = (
        warm.warm_calls(config(*small, "model.num_kv_heads=4"))
        + warm.warm_calls(config(*small, "parallel.cp=2"))[1:]
    )
    with installed(Flash4Standin(allow_fp32=True)) as standin:
        for call in calls:
            warm.run_call(call, torch.device("cpu"), torch.float32)
    assert standin.calls.count("flash_attn_func") == 2  # dense, and a CP chunk without documents
    assert standin.calls.count("flash_attn_varlen_func") == 2
    assert standin.varlen[-1] == ([4, 4], [16, 16])  # one chunk of each row against its whole prefix


def test_without_cuda_it_says_so_and_compiles_nothing(capsys):
    assert not torch.cuda.is_available()
    lines: list[str] = []
    assert warm.warm(config(), CACHE_ON, out=lines.append) == 0
    assert lines == [
        f"{warm.PROG}: skipped: CUDA is not available: no FlashAttention-4 kernel to compile on this machine"
    ]
    from goat_dist.cli import main

    assert main(["kernels", "warm", "train.max_steps=3"]) == 0  # the command line, as train.sbatch runs it
    assert "goat-dist kernels warm: skipped: CUDA is not available" in capsys.readouterr().out


@pytest.mark.parametrize(
    "overrides, environ, why",
    [
        ((), {}, f"FA4's disk cache is off ({warm.CACHE_ENABLED}=<unset>)"),
        (("train.precision=fp32",), CACHE_ON, "train.precision=fp32 is fp32 here"),
        (("model.position=alibi",), CACHE_ON, "model.attention_backend=auto resolves to sdpa here"),
        (("model.attention_backend=sdpa",), CACHE_ON, "resolves to sdpa here, not flash4"),
        (
            ("model.position=alibi", "model.attention_backend=flash4"),
            CACHE_ON,
            "flash4 cannot run here: model.position=alibi",
        ),
    ],
)
def test_on_a_gpu_it_skips_where_fa4_is_not_called(monkeypatch, overrides, environ, why):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with installed(Flash4Standin()):
        reason = warm.skip_reason(config(*overrides), environ, capability=(9, 0))
    assert reason is not None and why in reason, reason
    with installed(Flash4Standin()):
        assert warm.skip_reason(config(), CACHE_ON, capability=(9, 0)) is None  # FA4 is called: compile


def test_on_a_gpu_without_fa4_it_skips_naming_why(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(flash_imports, "_flash_attn_cute", lambda: None)
    auto = warm.skip_reason(config(), CACHE_ON, capability=(9, 0))
    assert "resolves to" in auto and "not flash4" in auto
    explicit = warm.skip_reason(config("model.attention_backend=flash4"), CACHE_ON, capability=(9, 0))
    assert explicit.startswith("model.attention_backend=flash4 cannot run here")


def test_the_subcommand_takes_a_config_and_overrides():
    parser = argparse.ArgumentParser()
    warm.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["kernels", "warm", "--config", "c.yaml", "parallel.tp=2"])
    assert (args.func, args.config, args.overrides) == (warm.cmd_warm, "c.yaml", ["parallel.tp=2"])
    assert copy.copy(args.overrides) == ["parallel.tp=2"]
