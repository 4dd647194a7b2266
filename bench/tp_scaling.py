"""Tokens/s of TP=1 vs TP=2 for a CPU-sized GOAT model, and the communication share of a TP=2 step.

Each layout runs under torchrun on this machine's cores (TP=1: one process with all threads; TP=2: two
processes with half the threads each), trains through the same DeepSpeed engine as ``goat-dist train`` on
random tokens; the communication share is the wall time rank 0 spends inside torch.distributed
collectives (all-reduce, all-gather, reduce-scatter; waiting for the peer included) over the step time.
On CPU the goal is a correct, measured report, not speed-up: the ranks share the cores and memory
bandwidth.

    python bench/tp_scaling.py [--hidden 512] [--layers 4] [--seq 256] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "_all_gather_base",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "broadcast",
)


def time_collectives() -> dict:
    """Wrap torch.distributed's collectives to accumulate the wall time spent inside them (waiting for
    the peer included). Installed before megatron-core is imported, which binds some of them early."""
    import torch.distributed as dist

    spent = {"s": 0.0}
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None:
            continue

        def timed(*a, _fn=fn, **k):
            t0 = time.perf_counter()
            out = _fn(*a, **k)
            spent["s"] += time.perf_counter() - t0
            return out

        setattr(dist, name, timed)
    return spent


def worker(args) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    spent = time_collectives()
    import torch

    from goat_dist import distributed
    from goat_dist.config import load_config
    from goat_dist.model import GPT
    from goat_dist.parallel.parallelize import parallelize

    cfg = load_config(
        None,
        [
            f"parallel.tp={args.tp}",
            f"parallel.sp={'true' if args.sp else 'false'}",
            f"model.hidden_size={args.hidden}",
            f"model.num_layers={args.layers}",
            f"model.seq_len={args.seq}",
            "model.num_heads=8",
            "model.attention_backend=sdpa",
            f"train.micro_batch_size={args.batch}",
            f"train.global_batch_size={args.batch}",
            "train.precision=fp32",
        ],
    )
    layout = distributed.init(tp=args.tp)
    torch.manual_seed(0)
    engine = parallelize(GPT(cfg.model, layout, sequence_parallel=args.sp), cfg, grad_accum=1)
    tokens = torch.randint(0, cfg.model.vocab_size, (args.batch, args.seq + 1))
    positions = torch.arange(args.seq).expand(args.batch, -1)

    def step():
        loss = engine(tokens[:, :-1], positions, tokens[:, 1:])
        engine.backward(loss)
        engine.step()

    for _ in range(2):
        step()
    torch.distributed.barrier()
    spent["s"] = 0.0
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    elapsed = time.perf_counter() - start
    comm = spent["s"]
    torch.distributed.barrier()
    if layout.rank == 0:
        result = {
            "tokens_per_s": args.batch * args.seq * args.steps / elapsed,
            "step_s": elapsed / args.steps,
            "comm_share": comm / elapsed,
        }
        Path(args.out).write_text(json.dumps(result))
    distributed.exit_process(0)


def launch(tp: int, sp: bool, args, out: Path) -> dict:
    from goat_dist.launcher import child_env, launch_command

    threads = max(os.cpu_count() // tp, 1)
    env = child_env(OMP_NUM_THREADS=str(threads))
    cmd = launch_command(
        tp,
        [
            __file__,
            "--worker",
            f"--tp={tp}",
            f"--out={out}",
            f"--hidden={args.hidden}",
            f"--layers={args.layers}",
            f"--seq={args.seq}",
            f"--batch={args.batch}",
            f"--steps={args.steps}",
        ],
    )
    if sp:
        cmd.append("--sp")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"TP={tp} failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--sp", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    print(
        f"GOAT GPT hidden={args.hidden} layers={args.layers} seq={args.seq} batch={args.batch}, "
        f"{os.cpu_count()} cores, fp32, gloo"
    )
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, tp, sp in (("TP=1", 1, False), ("TP=2", 2, False), ("TP=2+SP", 2, True)):
            r = results[name] = launch(tp, sp, args, Path(tmp) / f"{name}.json")
            print(
                f"  {name:8s} {r['tokens_per_s']:9.0f} tok/s  step {r['step_s'] * 1e3:7.1f} ms  "
                f"communication {100 * r['comm_share']:5.1f}% of the step",
                flush=True,
            )
    print(
        f"tokens/s ratio TP=2 / TP=1: {results['TP=2']['tokens_per_s'] / results['TP=1']['tokens_per_s']:.3f}"
    )


if __name__ == "__main__":
    main()
