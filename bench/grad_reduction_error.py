"""Error of the data-parallel mean gradient reduced in bf16 vs in fp32, against float64, by DP size.

Why: DeepSpeed reduces bf16 gradients in bf16 unless told otherwise, and every hop of a ring adds one
bf16 rounding of a partial sum that grows while the addends stay small; ``parallel.grad_reduce_dtype``
(default fp32) is the fix, and this is the measurement behind it (docs/precision.md).

Each of ``dp`` simulated replicas holds a bf16 gradient of ``--numel`` elements: a shared signal plus the
replica's own noise (``--noise`` times the signal's scale), both Student-t with 4 degrees of freedom
(heavy-ish tails, as per-element gradients have), times 1e-4. They are reduced as DeepSpeed's ZeRO-1/2
``average_tensor`` does: divided by dp in the gradient's dtype (bf16; exact for a power of two), cast to
the communication dtype, then summed along a ring: dp - 1 additions, each rounded to that dtype. (ZeRO-3
casts before dividing, ZeRO-0 divides after the sum: the same figures at powers of two, bar underflow.)
The reference is the float64 mean of the same bf16 gradients, so only the reduction's error is measured.
Columns: relative error ||mean - reference|| / ||reference|| of the bf16 ring, of the fp32 ring, and of
the fp32 ring's result stored back in bf16 (what ZeRO-0/1 keep, and ZeRO-2/3 without accumulation: one
rounding, the same at every dp); last, bf16 / fp32.

Second table, the accumulation over micro-batches (``parallel.grad_accum_dtype``): ``k`` micro-batch
gradients of one replica (the same signal, each its own noise), each computed in bf16 from a loss divided
by ``k`` (as DeepSpeed scales it), summed in a bf16 ``.grad`` (k - 1 additions, each rounded to bf16: what
DeepSpeed does by default) and in an fp32 buffer (``BF16_Optimizer``, ZeRO-2/3 with fp32 accumulation: no
rounding between micro-batches), against the float64 sum of the same bf16 gradients.

    python bench/grad_reduction_error.py [--dp 8 16 32 64 128 256 512] [--accum 1 2 4 8 16 32 64]
                                         [--numel 65536] [--noise 1.0]
"""

from __future__ import annotations

import argparse

import torch

DF = 4  # Student-t degrees of freedom
SCALE = 1e-4  # gradient magnitude: far from bf16's under- and overflow


def student_t(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Student-t samples with ``DF`` = 4 degrees of freedom, unit scale: z / sqrt(chi2_4 / 4), chi2_4 being
    -2 ln(u1 u2) (two uniforms instead of four squared normals: the bench's cost is sampling)."""
    z = torch.randn(shape, generator=gen)
    u = 1 - torch.rand((2, *shape), generator=gen)  # (0, 1]
    return z / (-0.5 * u.prod(0).log()).sqrt()


def replica_gradient(signal: torch.Tensor, noise: float, seed: int) -> torch.Tensor:
    """One replica's local gradient, in bf16 (the working dtype DeepSpeed reduces from)."""
    gen = torch.Generator().manual_seed(seed)
    return (SCALE * (signal + noise * student_t(tuple(signal.shape), gen))).to(torch.bfloat16)


def reduce_errors(dp: int, numel: int, noise: float, seed: int = 0) -> dict[str, float]:
    """Relative errors of the ``dp``-replica mean reduced along a bf16 ring and an fp32 ring."""
    signal = student_t((numel,), torch.Generator().manual_seed(seed))
    exact = torch.zeros(numel, dtype=torch.float64)
    rings = {torch.bfloat16: None, torch.float32: None}
    for r in range(dp):
        local = replica_gradient(signal, noise, seed * 100_003 + r + 1)
        exact += local.double()
        share = local / dp  # pre-divide in the gradient's dtype
        for dtype, acc in rings.items():
            x = share.to(dtype)
            rings[dtype] = x if acc is None else acc + x  # one rounding per hop, in the wire dtype
    exact /= dp
    norm = exact.norm()

    def rel(t: torch.Tensor) -> float:
        return float((t.double() - exact).norm() / norm)

    fp32 = rings[torch.float32]
    return {"bf16": rel(rings[torch.bfloat16]), "fp32": rel(fp32), "fp32_kept_bf16": rel(fp32.bfloat16())}


def accumulate_errors(k: int, numel: int, noise: float, seed: int = 0) -> dict[str, float]:
    """Relative errors of ``k`` micro-batch gradients summed in bf16 and in fp32, against float64."""
    signal = student_t((numel,), torch.Generator().manual_seed(seed))
    exact = torch.zeros(numel, dtype=torch.float64)
    sums: dict[torch.dtype, torch.Tensor | None] = {torch.bfloat16: None, torch.float32: None}
    for micro in range(k):
        local = (replica_gradient(signal, noise, seed * 100_003 + micro + 1).float() / k).bfloat16()
        exact += local.double()
        for dtype, acc in sums.items():
            x = local.to(dtype)
            sums[dtype] = x if acc is None else acc + x  # one rounding per micro-batch, in the sum's dtype
    norm = exact.norm()

    def rel(t: torch.Tensor | None) -> float:
        assert t is not None
        return float((t.double() - exact).norm() / norm)

    return {"bf16": rel(sums[torch.bfloat16]), "fp32": rel(sums[torch.float32])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256, 512])
    ap.add_argument("--accum", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--numel", type=int, default=65_536)
    ap.add_argument("--noise", type=float, default=1.0, help="replica noise scale / signal scale")
    ap.add_argument("--seeds", type=int, default=3, help="repeats per dp; the table shows their mean")
    args = ap.parse_args()
    print(f"mean of dp bf16 gradients ({args.numel:,} elements, noise/signal {args.noise:g}, t({DF}) "
          f"tails), relative error vs float64, mean of {args.seeds} seeds")  # fmt: skip
    print(f"{'dp':>5} {'bf16 ring':>11} {'fp32 ring':>11} {'fp32->bf16':>11} {'bf16/fp32':>10}")
    for dp in args.dp:
        runs = [reduce_errors(dp, args.numel, args.noise, seed) for seed in range(args.seeds)]
        mean = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}
        ratio = mean["bf16"] / mean["fp32"] if mean["fp32"] else float("inf")  # fp32 can be exact
        print(f"{dp:>5} {mean['bf16']:>11.2e} {mean['fp32']:>11.2e} {mean['fp32_kept_bf16']:>11.2e} "
              f"{ratio:>10.1e}")  # fmt: skip

    print()
    print(f"sum of k micro-batch bf16 gradients ({args.numel:,} elements, noise/signal {args.noise:g}), "
          f"relative error vs float64, mean of {args.seeds} seeds")  # fmt: skip
    print(f"{'k':>5} {'bf16 .grad':>11} {'fp32 sum':>11} {'bf16/fp32':>10}")
    for k in args.accum:
        runs = [accumulate_errors(k, args.numel, args.noise, seed) for seed in range(args.seeds)]
        mean = {key: sum(r[key] for r in runs) / len(runs) for key in runs[0]}
        ratio = f"{mean['bf16'] / mean['fp32']:>10.1e}" if mean["fp32"] else f"{'exact':>10}"
        print(f"{k:>5} {mean['bf16']:>11.2e} {mean['fp32']:>11.2e} {ratio}")


if __name__ == "__main__":
    main()
