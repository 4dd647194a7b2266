"""Long-context training step, CP=1 vs CP=2 side by side (CPU, gloo), plus GOAT vs RoPE at the longest L.

For every length L (default 2k, 8k, 16k) and CP size, a fresh world (torchrun: CP processes, the machine's
threads split evenly between them) trains a tiny GOAT model on one sequence of L tokens: forward,
backward, the DP x CP gradient average the trainer does, an AdamW step. Per rank it reports

* ``act MiB``: activation memory, the bytes autograd keeps for backward during the step (every saved
  tensor's storage counted once, parameters excluded; the K/V gathered over the CP group included),
  measured with ``torch.autograd.graph.saved_tensors_hooks``: exact and independent of the allocator;
* ``peak MiB``: the process's peak RSS growth over the step (allocator and kernels' workspace included);
* ``tok/s``: tokens of the sequence per second of step time (the CP ranks share one sequence).

Then GOAT and RoPE at the longest length, CP=1, same head dim, interleaved repeats; the last line is the
median of the paired step-time ratios GOAT / RoPE.

    python bench/long_context.py [--lengths 2048 8192 16384] [--cp 1 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

MIB = 2**20


def _model_config(L: int, position: str, args):
    from goat_dist.config import ModelConfig

    return ModelConfig(
        vocab_size=4096,
        seq_len=L,
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_heads=args.heads,
        position=position,
        attention_backend="sdpa",
    )


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from goat_dist import distributed
    from goat_dist.model import GPT

    L, cp = args.length, args.cp_size
    layout = distributed.init(tp=1, cp=cp)
    replicas = parallel_state.get_data_parallel_group(with_context_parallel=True)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 4096, (1, L + 1), generator=g)
    positions = torch.arange(L)[None]
    runs = {}
    for position in args.positions:  # built first, then timed interleaved (paired ratios)
        torch.manual_seed(0)
        model = GPT(_model_config(L, position, args))
        runs[position] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))

    def step(position, saved=None):
        model, opt = runs[position]
        with torch.autograd.graph.saved_tensors_hooks(saved, lambda t: t) if saved else _nothing():
            loss = model(tokens[:, :-1], positions, tokens[:, 1:])
        loss.backward()
        for p in model.parameters():  # the trainer's DP x CP gradient average
            dist.all_reduce(p.grad, group=replicas)
            p.grad /= cp
        opt.step()
        opt.zero_grad(set_to_none=True)

    results = {}
    for position, (model, _) in runs.items():
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        storages: dict[int, int] = {}

        def record(t, params=params, storages=storages):
            s = t.untyped_storage()
            if s.data_ptr() not in params:
                storages[s.data_ptr()] = max(storages.get(s.data_ptr(), 0), s.nbytes())
            return t

        base = _rss()
        step(position, record)  # warm-up, and the activation bytes
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
        results[position] = {"act": sum(storages.values()), "peak": max(peak, 0), "times": []}
    for _ in range(args.repeats):
        for position in runs:
            dist.barrier()
            start = time.perf_counter()
            step(position)
            results[position]["times"].append(time.perf_counter() - start)
    gathered = [None] * layout.world
    dist.all_gather_object(gathered, results)
    if layout.rank == 0:
        print("RESULT " + json.dumps(gathered))
    distributed.exit_process(0)


def run_world(L: int, cp: int, positions: list[str], args) -> list[dict]:
    from goat_dist.launcher import child_env, launch_command

    threads = max(1, args.threads // cp)
    cmd = launch_command(
        cp,
        [
            str(Path(__file__).resolve()),
            "--worker",
            f"--length={L}",
            f"--cp-size={cp}",
            f"--repeats={args.repeats}",
            f"--hidden={args.hidden}",
            f"--layers={args.layers}",
            f"--heads={args.heads}",
            "--positions",
            *positions,
        ],
    )
    root = str(Path(__file__).resolve().parents[1])
    env = child_env(OMP_NUM_THREADS=str(threads), DS_ACCELERATOR="cpu", PYTHONPATH=root)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=root)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        sys.exit(f"L={L} cp={cp} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT ") :])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 16384])
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--skip-position-compare", action="store_true")
    # worker mode (internal)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, help=argparse.SUPPRESS)
    p.add_argument("--cp-size", type=int, help=argparse.SUPPRESS)
    p.add_argument("--positions", nargs="+", default=["goat"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return

    print(
        f"tiny GOAT model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab 4096, "
        f"batch 1, sdpa, fp32, {args.threads} CPU threads per world"
    )
    header = f"{'L':>6} | " + " | ".join(f"CP={cp}: act MiB/rank  peak MiB/rank  tok/s" for cp in args.cp)
    print(header)
    ratios = {}
    for L in args.lengths:
        cells, acts = [], {}
        for cp in args.cp:
            ranks = run_world(L, cp, ["goat"], args)
            act = max(r["goat"]["act"] for r in ranks) / MIB
            peak = max(r["goat"]["peak"] for r in ranks) / MIB
            step_s = statistics.median(max(ts) for ts in zip(*(r["goat"]["times"] for r in ranks)))
            acts[cp] = act
            cells.append(f"{act:19.1f}  {peak:14.1f}  {L / step_s:5.0f}")
        print(f"{L:>6} | " + " | ".join(cells), flush=True)
        if 1 in acts and len(acts) > 1:
            ratios[L] = {cp: acts[cp] / acts[1] for cp in acts if cp != 1}
    for L, r in ratios.items():
        print(
            f"activation memory per rank vs CP=1 at L={L}: "
            + ", ".join(f"CP={c}: {x:.2f}x" for c, x in r.items())
        )
    if args.skip_position_compare:
        return
    L = max(args.lengths)
    ranks = run_world(L, 1, ["rope", "goat"], args)
    goat, rope = ranks[0]["goat"]["times"], ranks[0]["rope"]["times"]
    print(
        f"GOAT vs RoPE at L={L}, CP=1: step {statistics.median(goat):.3f} s vs "
        f"{statistics.median(rope):.3f} s (medians of {args.repeats})"
    )
    print(f"GOAT / RoPE step time at L={L}: {statistics.median(g / r for g, r in zip(goat, rope)):.3f}")


if __name__ == "__main__":
    main()
