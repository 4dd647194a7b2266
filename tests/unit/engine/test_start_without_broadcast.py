"""No start-up broadcast of the weights (``patches.checked_not_broadcast``): DeepSpeed's engine at every
ZeRO stage, and ``zero.Init`` as ZeRO-3 partitions, broadcast nothing; instead one all-reduce of per-tensor
fingerprints (``patches.check_replicas``) finds replicas whose weights differ, by name. One process, gloo;
the check of a desync plays the other replica with a stand-in all-reduce. The 2-rank check (identical
weights, no broadcast) is in ``tests/integration/engine/test_zero3_construction.py``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness.multiproc import one_layer_config
from torch import nn

from goat_dist import distributed
from goat_dist.engine import patches
from goat_dist.engine.build import build_engine


class Broadcasts:
    """Counts torch.distributed.broadcast calls (DeepSpeed's comm layer calls it) and their bytes."""

    def __init__(self, monkeypatch):
        self.calls, self.bytes = 0, 0
        real = dist.broadcast

        def broadcast(tensor, *args, **kwargs):
            self.calls += 1
            self.bytes += tensor.numel() * tensor.element_size()
            return real(tensor, *args, **kwargs)

        monkeypatch.setattr(dist, "broadcast", broadcast)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_engine_broadcasts_no_parameter_at_any_stage(world1, monkeypatch, stage):
    """DeepSpeed broadcast every parameter in ``_broadcast_model`` (ZeRO 0-2; ZeRO-3 given a whole model
    too) and in ``Init._zero_init_param`` (ZeRO-3): each is where the patch takes over."""
    seen = Broadcasts(monkeypatch)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = one_layer_config(f"parallel.zero_stage={stage}", "train.precision=fp32")
    build_engine(model, distributed.current_layout(), cfg, 1, optimizer=opt, scheduler=None)
    assert seen.calls == 0, f"{seen.calls} broadcasts ({seen.bytes} bytes) at ZeRO-{stage}"


def test_the_patched_methods_are_deepspeeds_own():
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.partition_parameters import Init

    before = DeepSpeedEngine._broadcast_model, Init._zero_init_param
    with patches.checked_not_broadcast():
        assert (DeepSpeedEngine._broadcast_model, Init._zero_init_param) != before
    assert (DeepSpeedEngine._broadcast_model, Init._zero_init_param) == before


def test_fingerprints_see_any_bit_and_any_move(monkeypatch):
    monkeypatch.setattr(patches, "FINGERPRINT_CHUNK_HOST", 100)  # several pieces per tensor
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        t = torch.randn(37, 11, generator=g).to(dtype)
        f = patches.fingerprint(t)
        assert torch.equal(f, patches.fingerprint(t.clone())) and f.dtype == torch.int64
        assert ((0 <= f) & (f < 2**62)).all()
        flipped = t.clone().reshape(-1)
        flipped.view(torch.uint8)[250] ^= 1  # one bit of one element
        swapped = t.clone().reshape(-1)
        swapped[[3, 300]] = swapped[[300, 3]]  # two elements trade places: the same sum of bits
        assert not torch.equal(patches.fingerprint(flipped), f), dtype
        assert not torch.equal(patches.fingerprint(swapped), f), dtype


def _as_two_replicas(monkeypatch, other: list[tuple[str, torch.Tensor]]):
    """The all-reduce of a group of two whose other rank holds ``other``."""
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)

    def all_reduce(t, op=None, group=None):
        assert op == dist.ReduceOp.MAX
        peer = torch.stack([patches.fingerprint(v) for _, v in other])
        t.copy_(torch.maximum(t, torch.cat([peer, -peer], dim=1)))

    monkeypatch.setattr(dist, "all_reduce", all_reduce)


def test_the_check_names_the_tensors_that_differ_between_replicas(monkeypatch):
    g = torch.Generator().manual_seed(1)
    mine = [(f"blocks.{i}.w", torch.randn(64, 8, generator=g).bfloat16()) for i in range(7)]
    _as_two_replicas(monkeypatch, [(n, t.clone()) for n, t in mine])
    patches.check_replicas(mine, group=None)  # the same weights: nothing raised
    other = [(n, t.clone()) for n, t in mine]
    other[4][1][5, 2] = other[4][1][5, 2] + 0.25  # a replica built from another seed, or another config
    _as_two_replicas(monkeypatch, other)
    with pytest.raises(RuntimeError, match=r"differ between data-parallel replicas .*1 of 7 tensors: "
                       r"blocks\.4\.w\).*train\.seed"):  # fmt: skip
        patches.check_replicas(mine, group=None)
