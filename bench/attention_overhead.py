"""GOAT attention vs plain SDPA attention, forward + backward, side by side in one run.

Both sides take the same head dim D and run the same SDPA kernel; GOAT additionally builds its prior
lanes (O(L) feature work: Fourier features, the sink MLP, the exact 3-part split of u(j)) and
concatenates them into q and k. Timings interleave the two sides; each GOAT run is divided by the SDPA
run just before it and the median of those paired ratios is reported (robust to a machine whose load
changes during the run; the medians of the times are printed too). The last line is the ratio GOAT / SDPA.

    python bench/attention_overhead.py [--lengths 1024 4096] [--repeats 5] [--clock process --threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from timing import CLOCKS, add_clock_args, apply_threads

from goat_dist.goat import GoatPrior, goat_attention


def plain_sdpa(q, k, v):
    return F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
    ).transpose(1, 2)


def time_fwd_bwd(fn, inputs, clock=time.perf_counter) -> float:
    for t in inputs:
        t.grad = None
    start = clock()
    out = fn()
    out.backward(torch.ones_like(out))
    return clock() - start


def bench(B: int, H: int, D: int, L: int, R: int, repeats: int, clock) -> tuple[float, float, float]:
    torch.manual_seed(0)
    prior = GoatPrior(H, pos_rank=R, abs_rank=4, training_seq_len=L)
    dc = D - prior.num_lanes
    q = torch.randn(B, L, H, D, requires_grad=True)
    k = torch.randn(B, L, H, D, requires_grad=True)
    v = torch.randn(B, L, H, D, requires_grad=True)
    qc = torch.randn(B, L, H, dc, requires_grad=True)
    kc = torch.randn(B, L, H, dc, requires_grad=True)
    pos = torch.arange(L).expand(B, L)
    goat = lambda: goat_attention(qc, kc, v, prior, pos, causal=True, backend="sdpa")
    sdpa = lambda: plain_sdpa(q, k, v)
    goat_inputs, sdpa_inputs = [qc, kc, v, *prior.parameters()], [q, k, v]
    time_fwd_bwd(goat, goat_inputs), time_fwd_bwd(sdpa, sdpa_inputs)  # warm up
    g_times, s_times = [], []
    for _ in range(repeats):
        s_times.append(time_fwd_bwd(sdpa, sdpa_inputs, clock))
        g_times.append(time_fwd_bwd(goat, goat_inputs, clock))
    paired = statistics.median(g / s for g, s in zip(g_times, s_times))
    return statistics.median(g_times), statistics.median(s_times), paired


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--pos-rank", type=int, default=4)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--repeats", type=int, default=9)
    add_clock_args(ap)
    args = ap.parse_args()
    apply_threads(args)
    lanes = GoatPrior(1, pos_rank=args.pos_rank).num_lanes
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, B={args.batch} H={args.heads} "
        f"D={args.head_dim} R={args.pos_rank} (GOAT: {lanes} prior lanes), causal, fp32, CPU, "
        f"{args.clock} clock"
    )
    print(f"{'L':>6} {'goat fwd+bwd s':>15} {'sdpa fwd+bwd s':>15} {'ratio':>7}")
    ratios = []
    for L in args.lengths:
        g, s, ratio = bench(
            args.batch, args.heads, args.head_dim, L, args.pos_rank, args.repeats, CLOCKS[args.clock]
        )
        ratios.append(ratio)
        print(f"{L:>6} {g:>15.4f} {s:>15.4f} {ratio:>7.3f}")
    print(f"ratio goat/sdpa (geometric mean over L={args.lengths}): {statistics.geometric_mean(ratios):.3f}")


if __name__ == "__main__":
    main()
