"""CPU MFU: this machine's measured matmul peak against the FLOP/s a ~100M-parameter goat-dist step achieves.

Peak: the best FLOP/s of large square fp32 and bf16 matmuls (``n x n``, several sizes, best of timed
batches; ``goat_dist.observe.peak.measure_matmul_flops``) at this process's thread count. Achieved: a
training step of a goat-dist GPT of about 100M parameters (GOAT attention, SDPA, fp32, TP=1 in a
single-process world) with the project's AdamW (``optim.build_optimizer``: torch's fused kernel);
its FLOPs are the project's own count
(``goat_dist.observe.flops.flops_per_token`` x tokens: the model's work, the optimizer excluded), divided by
the median wall time of a whole step (zero_grad, forward, backward, AdamW step) and, as a second figure, of
forward + backward alone. For comparison, the step time a plain (unfused, per-parameter) ``torch.optim.AdamW``
would add is printed too. Target: achieved step FLOP/s / fp32 matmul peak >= 0.5. Last line: that ratio.

    python bench/mfu_cpu.py [--seq 512 --batch 4] [--steps 5] [--sizes 2048 4096]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

os.environ.setdefault("DS_ACCELERATOR", "cpu")
warnings.filterwarnings("ignore", module="megatron")

import torch  # noqa: E402

from goat_dist import distributed  # noqa: E402
from goat_dist.config import ModelConfig, TrainConfig  # noqa: E402
from goat_dist.model.gpt import GPT  # noqa: E402
from goat_dist.observe.flops import flops_per_token, non_embedding_params  # noqa: E402
from goat_dist.observe.peak import measure_matmul_flops  # noqa: E402
from goat_dist.optim import build_optimizer  # noqa: E402


def matmul_peak(dtype: torch.dtype, sizes: list[int], seconds: float) -> tuple[float, int]:
    """(best FLOP/s, the n it came from) over square matmuls of the given sizes."""
    return max((measure_matmul_flops(dtype, n=n, seconds=seconds), n) for n in sizes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--position", default="goat", choices=["goat", "rope"])
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="timed training steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048], help="fp32 peak: matmul sizes")
    # a CPU without AVX512-BF16/AMX runs bf16 matmuls in a slow fallback (~1 GFLOP/s): a 2048^3 one takes
    # tens of seconds, so the bf16 probe is smaller by default
    ap.add_argument("--bf16-sizes", type=int, nargs="+", default=[512, 1024], help="bf16 peak: sizes")
    ap.add_argument("--peak-seconds", type=float, default=3.0, help="probe time per size and dtype")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    peak32, n32 = matmul_peak(torch.float32, args.sizes, args.peak_seconds)
    peak16, n16 = matmul_peak(torch.bfloat16, args.bf16_sizes, args.peak_seconds)

    distributed.init(tp=1)
    cfg = ModelConfig(
        vocab_size=args.vocab,
        seq_len=args.seq,
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_heads=args.heads,
        position=args.position,
        attention_backend="sdpa",
    )
    torch.manual_seed(0)
    model = GPT(cfg).train()
    params = sum(p.numel() for p in model.parameters())
    opt, _ = build_optimizer(model, TrainConfig(lr=1e-4, weight_decay=0.1, warmup_steps=1))
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq))
    positions = torch.arange(args.seq).expand(args.batch, args.seq)
    labels = torch.roll(tokens, -1, dims=1)
    fpt = flops_per_token(cfg)
    step_flops = fpt["total"] * args.batch * args.seq

    step_times, fwd_bwd_times = [], []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(tokens, positions, labels).backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        if i >= args.warmup:
            step_times.append(t2 - t0)
            fwd_bwd_times.append(t1 - t0)
    step_t, fb_t = statistics.median(step_times), statistics.median(fwd_bwd_times)
    plain = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95))
    plain.step()  # creates the state
    t0 = time.perf_counter()
    plain.step()
    plain_opt_t = time.perf_counter() - t0
    plain_step_t = fb_t + plain_opt_t
    achieved, achieved_fb = step_flops / step_t, step_flops / fb_t

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU; model h={args.hidden} "
        f"layers={args.layers} heads={args.heads} V={args.vocab} position={args.position} "
        f"({params / 1e6:.1f}M params, {non_embedding_params(cfg) / 1e6:.1f}M non-embedding), fp32, "
        f"b={args.batch} s={args.seq}, fused AdamW (build_optimizer)"
    )
    print(
        f"FLOPs per step (observe.flops): {step_flops / 1e9:.1f} G (dense {fpt['dense'] / fpt['total']:.0%}, "
        f"lm_head {fpt['lm_head'] / fpt['total']:.0%}, attention {fpt['attention'] / fpt['total']:.0%})"
    )
    print(f"{'':<34} {'GFLOP/s':>9} {'of fp32 peak':>13}")
    print(f"{f'matmul peak fp32 (n={n32})':<34} {peak32 / 1e9:>9.1f} {1:>13.3f}")
    print(f"{f'matmul peak bf16 (n={n16})':<34} {peak16 / 1e9:>9.1f} {peak16 / peak32:>13.3f}")
    print(f"{f'fwd+bwd ({fb_t:.2f} s median)':<34} {achieved_fb / 1e9:>9.1f} {achieved_fb / peak32:>13.3f}")
    print(f"{f'train step ({step_t:.2f} s median)':<34} {achieved / 1e9:>9.1f} {achieved / peak32:>13.3f}")
    print(
        f"{f'with plain AdamW (+{plain_opt_t:.2f} s)':<34} {step_flops / plain_step_t / 1e9:>9.1f} "
        f"{step_flops / plain_step_t / peak32:>13.3f}"
    )
    print(f"ratio achieved step FLOP/s / fp32 matmul peak (MFU): {achieved / peak32:.3f} (target >= 0.5)")


if __name__ == "__main__":
    main()
