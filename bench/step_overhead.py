"""End-to-end training step time of GOAT against RoPE at the same shape (seq 1024, a small model), on CPU.

Two goat-dist GPTs that differ only in ``model.position`` (goat | rope), same hidden size, layers, heads
(head dim 64: GOAT's 2R+3 prior lanes are part of it), SDPA, fp32, TP=1 in a single-process world, trained
by the same plain ``torch.optim.AdamW`` loop (zero_grad, forward -> loss, backward, step) on the same batch.
Repeats interleave the two (RoPE, GOAT, RoPE, ...), each timing ``--steps`` steps; the ratio is the median
of the per-repeat GOAT / RoPE ratios (medians of the step times are printed too). ``--profile`` adds a
torch.profiler table of each side's top ops by self CPU time. Target: GOAT / RoPE <= 1.03. Last line: that
ratio.

    python bench/step_overhead.py [--hidden 512 --layers 8] [--repeats 9] [--profile] [--clock process]
"""

from __future__ import annotations

import argparse
import os
import statistics
import warnings

os.environ.setdefault("DS_ACCELERATOR", "cpu")
warnings.filterwarnings("ignore", module="megatron")

import torch  # noqa: E402
from timing import CLOCKS, add_clock_args, apply_threads, seconds_per_call  # noqa: E402

from goat_dist import distributed  # noqa: E402
from goat_dist.config import ModelConfig  # noqa: E402
from goat_dist.goat.prior import prior_lane_count  # noqa: E402
from goat_dist.model.gpt import GPT  # noqa: E402


def make_step(args, position: str, tokens: torch.Tensor):
    cfg = ModelConfig(
        vocab_size=args.vocab,
        seq_len=args.seq,
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_heads=args.heads,
        position=position,
        attention_backend="sdpa",
    )
    torch.manual_seed(0)
    model = GPT(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95))
    b, s = tokens.shape
    positions = torch.arange(s).expand(b, s)
    labels = torch.roll(tokens, -1, dims=1)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(tokens, positions, labels).backward()
        opt.step()

    return step, sum(p.numel() for p in model.parameters())


def profile(name: str, step, rows: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    print(f"--- torch.profiler, one {name} step, top {rows} ops by self CPU time")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=40))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2, help="training steps per timed repeat")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler table for each side")
    ap.add_argument("--profile-rows", type=int, default=20)
    add_clock_args(ap)
    args = ap.parse_args()
    apply_threads(args)
    distributed.init(tp=1)
    torch.manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq))
    rope, rope_params = make_step(args, "rope", tokens)
    goat, goat_params = make_step(args, "goat", tokens)
    lanes = prior_lane_count(ModelConfig().goat.pos_rank, True)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, CPU, SDPA, AdamW, "
        f"{args.clock} clock; "
        f"h={args.hidden} layers={args.layers} heads={args.heads} (head dim {args.hidden // args.heads}, "
        f"GOAT {lanes} prior lanes) V={args.vocab} b={args.batch} s={args.seq}; params rope "
        f"{rope_params / 1e6:.3f}M, goat {goat_params / 1e6:.3f}M"
    )
    for _ in range(args.warmup):
        rope(), goat()
    r_times, g_times = [], []
    for _ in range(args.repeats):
        r_times.append(seconds_per_call(rope, args.steps, CLOCKS[args.clock]))
        g_times.append(seconds_per_call(goat, args.steps, CLOCKS[args.clock]))
    ratio = statistics.median(g / r for g, r in zip(g_times, r_times))
    if args.profile:
        profile("RoPE", rope, args.profile_rows)
        profile("GOAT", goat, args.profile_rows)
    print(f"{'':<6} {'step s (median)':>16} {'min':>8} {'max':>8}")
    for name, ts in (("rope", r_times), ("goat", g_times)):
        print(f"{name:<6} {statistics.median(ts):>16.4f} {min(ts):>8.4f} {max(ts):>8.4f}")
    print(f"ratio GOAT / RoPE step time (median of paired repeats): {ratio:.3f} (target <= 1.03)")


if __name__ == "__main__":
    main()
