"""Context parallelism, one process: the split, the gather order and the chunk attention of every CP rank
against attention over the whole row (each rank simulated in turn; the multi-process runs are in
tests/integration/parallel/test_context_parallel_runs.py)."""

from __future__ import annotations

import math

import pytest
import torch
from harness import flash4_standin
from harness.flash_standin import FlashStandin, installed

from goat_dist.distributed import LayoutError, check_layout
from goat_dist.kernels import alibi_bias, document_segments, eager_attention, sdpa_attention
from goat_dist.parallel.context import context_attention, make_shard, reorder_gathered, split_rows

B, L, H, H_KV, D = 2, 24, 4, 2, 8


class _Group:
    """What megatron's get_batch_on_this_cp_rank asks of a group."""

    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@pytest.mark.parametrize("cp", [2, 3])
def test_split_is_megatrons_and_the_gather_restores_the_row(world1, cp, monkeypatch):
    import megatron.core.utils as mcu

    # megatron-core 0.19 moved the plain 2·cp-chunk split into a helper (its public function now defaults
    # to per-document balancing through TransformerEngine) that asks torch.distributed for the group's
    # size and rank: the stand-in group answers through it
    get_batch_on_this_cp_rank = getattr(mcu, "_get_batch_on_this_cp_rank_per_sequence_balancing", None)
    if get_batch_on_this_cp_rank is None:
        get_batch_on_this_cp_rank = mcu.get_batch_on_this_cp_rank
    else:
        size, rank_of = torch.distributed.get_world_size, torch.distributed.get_rank
        monkeypatch.setattr(
            torch.distributed, "get_world_size", lambda g=None: g.size() if isinstance(g, _Group) else size(g)
        )
        monkeypatch.setattr(
            torch.distributed, "get_rank", lambda g=None: g.rank() if isinstance(g, _Group) else rank_of(g)
        )
    x = torch.arange(B * L * 3).view(B, L, 3)
    parts = []
    for rank in range(cp):
        ours = split_rows(x, cp, rank)
        theirs = get_batch_on_this_cp_rank({"x": x.clone()}, cp_group=_Group(cp, rank))["x"]
        assert torch.equal(ours, theirs)
        parts.append(ours)
    assert torch.equal(reorder_gathered(parts, L // (2 * cp)), x)
    shard = make_shard(torch.arange(L).expand(B, L), cp, 1)
    assert shard.local_index().tolist() == split_rows(torch.arange(L)[None], cp, 1)[0].tolist()


def _positions(documents: bool) -> torch.Tensor:
    pos = torch.arange(L).expand(B, L).clone() + torch.tensor([[0], [700]])
    if documents:  # row 0: documents restart at 5 and 17 (17 is inside a later chunk); row 1: one document
        pos[0, 5:] = torch.arange(L - 5)
        pos[0, 17:] = torch.arange(L - 17) + 40  # a document continuing from an earlier window
    return pos


def _reference(q, k, v, positions, scale, backend, slopes):
    segments = document_segments(positions)
    if slopes is not None:
        bias = alibi_bias(slopes, positions)
        return eager_attention(q, k, v, causal=True, scale=scale, bias=bias, segments=segments)
    return sdpa_attention(q, k, v, causal=True, scale=scale, segments=segments)


CASES = [
    ("sdpa", False, False),  # the CPU log-sum-exp path
    ("sdpa", True, False),
    ("sdpa", False, True),
    ("eager", True, True),
    ("flash", False, False),
    ("flash", True, False),
    ("flash", True, True),
    ("flash4", False, False),
    ("flash4", True, False),  # documents through FA4's varlen entry
]


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("backend,documents,alibi", CASES)
def test_chunk_attention_equals_whole_row(cp, backend, documents, alibi):
    """Every rank's output rows and the summed gradients equal attention over the whole row."""
    g = torch.Generator().manual_seed(0)
    # the flash stand-ins take fp32 at most
    dtype = torch.float32 if backend.startswith("flash") else torch.float64
    q = torch.randn(B, L, H, D, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(B, L, H_KV, D, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(B, L, H_KV, D, generator=g, dtype=dtype, requires_grad=True)
    positions = _positions(documents)
    assert (document_segments(positions) is not None) == documents
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625]) if alibi else None
    scale = 1 / math.sqrt(D)
    weights = torch.randn(B, L, H, D, generator=g, dtype=dtype)

    expected = _reference(q, k, v, positions, scale, backend, slopes)
    (expected * weights).sum().backward()
    want = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None

    # sdpa runs in fp64 here; eager and the flash stand-in compute in fp32 whatever the input
    atol = 1e-10 if backend == "sdpa" and not alibi else 2e-5
    standin = FlashStandin(allow_fp32=True)
    context = {
        "flash": lambda: installed(standin),
        "flash4": lambda: flash4_standin.installed(flash4_standin.Flash4Standin(allow_fp32=True)),
    }.get(backend, _nothing)
    total = 0
    with context():
        for rank in range(cp):
            shard = make_shard(positions, cp, rank)
            out = context_attention(
                shard.split(q), k, v, shard, scale=scale, backend=backend, alibi_slopes=slopes
            )
            err = (out - shard.split(expected)).abs().max()
            assert err <= atol, f"rank {rank}: {err:.2e}"
            total = total + (out * shard.split(weights)).sum()
    total.backward()
    for name, t, w in zip("qkv", (q, k, v), want):
        assert torch.allclose(t.grad, w, atol=atol), f"d{name}: {(t.grad - w).abs().max():.2e}"
    if backend == "flash":
        entry = "flash_attn_varlen_func" if documents else "flash_attn_func"
        assert standin.calls and set(standin.calls) == {entry}


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_impossible_context_layouts_are_named():
    with pytest.raises(LayoutError, match=r"model.seq_len=30 is not divisible by 2 x parallel.cp = 4"):
        check_layout(2, 1, 4, 4, 30, False, cp=2)
    with pytest.raises(LayoutError, match=r"2 x parallel.cp x parallel.tp = 8"):
        check_layout(4, 2, 4, 4, 36, True, cp=2)
    with pytest.raises(LayoutError, match=r"world size 6 is not divisible by parallel.tp=2 x parallel.cp=2"):
        check_layout(6, 2, 4, 4, 32, False, cp=2)
    check_layout(8, 2, 4, 4, 32, True, cp=2)
