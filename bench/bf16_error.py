"""Low-precision output error of GOAT attention vs plain attention of the same shape, against float64.

The GOAT side is the public drop-in ``from_reference(GoatAttention.for_gpt(256, 4, pos_rank=4,
abs_rank=4))`` (seeded init); the plain side is causal softmax attention using the same reference's full
q/k/v and output projections (head dim 64, scale 1/8). Each runs once in float64 and once in the low
dtype, on the same input, causal from position ``offset``; the figures are the max (and mean) |output
difference|. The GOAT run goes through its lanes (the ``sdpa`` backend: torch's kernel takes bf16/fp16
inputs and accumulates in fp32, as flash-attn does; ``--backend flash`` runs the CPU stand-in of
flash-attn from tests/harness/flash_standin.py instead). ``ratio`` is GOAT's max error over plain attention's.

    python bench/bf16_error.py [--lengths 256 1024 4096 16384] [--offsets 0 1000000] [--dtypes bf16 fp16]

Needs the test dependency ``goat-attention``. Memory grows with L only linearly (sdpa); L=32768 takes
several minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from goat_dist.goat import from_reference

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class PlainAttention(nn.Module):
    """Causal multi-head attention with a reference module's fused q/k/v and output projections."""

    def __init__(self, ref):
        super().__init__()
        self.heads = ref.num_heads
        self.in_proj = copy.deepcopy(ref.in_proj)
        self.out_proj = copy.deepcopy(ref.out_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, E = x.shape
        q, k, v = self.in_proj(x).view(B, L, 3, self.heads, E // self.heads).unbind(2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.out_proj(out.transpose(1, 2).reshape(B, L, E))


def errors(module: nn.Module, x: torch.Tensor, dtype: torch.dtype, call) -> tuple[float, float]:
    """(max, mean) |output in ``dtype`` - output in float64|."""
    with torch.no_grad():
        exact = call(copy.deepcopy(module).double(), x.double())
        low = call(copy.deepcopy(module).to(dtype), x.to(dtype))
    err = (low.double() - exact).abs()
    return err.max().item(), err.mean().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096, 8192])
    ap.add_argument("--offsets", type=int, nargs="+", default=[0])
    ap.add_argument("--dtypes", nargs="+", default=["bf16"], choices=sorted(DTYPES))
    ap.add_argument("--backend", default="sdpa", choices=["sdpa", "flash"])
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        run(args, stack)


def run(args, stack: contextlib.ExitStack) -> None:
    import goat.attention

    torch.manual_seed(0)
    ref = goat.attention.GoatAttention.for_gpt(256, 4, pos_rank=4, abs_rank=4)
    goat_mod = from_reference(ref, backend="sdpa")
    plain = PlainAttention(ref)
    if args.backend == "flash":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from harness.flash_standin import FlashStandin, installed

        stack.enter_context(installed(FlashStandin()))  # for the whole run

    def run_goat(m, xx, pos):
        m.backend = "sdpa" if xx.dtype == torch.float64 else args.backend  # flash has no float64
        return m(xx, pos)

    print(
        f"torch {torch.__version__}; GOAT: E=256 H=4 D=64 R=4 M=4, content {goat_mod.content_dim} + "
        f"{goat_mod.prior.num_lanes} lanes; plain: same projections, D=64; backend {args.backend}"
    )
    print(
        f"{'L':>7} {'offset':>8} {'dtype':>5} {'goat max':>9} {'plain max':>9} {'ratio':>6} "
        f"{'goat mean':>9} {'plain mean':>10}"
    )
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for offset in args.offsets:
            for L in args.lengths:
                torch.manual_seed(1)
                x = torch.randn(args.batch, L, 256)
                pos = torch.arange(L) + offset
                g, g_mean = errors(goat_mod, x, dtype, lambda m, xx, pos=pos: run_goat(m, xx, pos))
                p, p_mean = errors(plain, x, dtype, lambda m, xx: m(xx))
                print(
                    f"{L:>7} {offset:>8} {dtype_name:>5} {g:>9.4f} {p:>9.4f} {g / p:>6.2f} "
                    f"{g_mean:>9.2e} {p_mean:>10.2e}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
