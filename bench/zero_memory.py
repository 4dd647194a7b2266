"""Per-rank training-state memory under DeepSpeed ZeRO 0/1/2/3 on DP=2, measured, side by side.

Runs ``goat-dist train`` (torchrun, 2 processes, CPU/gloo) for two steps per stage; the trainer measures the
bytes each rank holds for parameters, gradients and optimizer state during the second step (where
gradients and Adam state coexist) and records them in metrics.jsonl. Printed for mixed precision
(``train.precision=bf16``: bf16 parameters and gradients, fp32 master weights and Adam state, the usual
large-model setting) and for pure fp32. The last line is the bf16 ratio ZeRO-3 / ZeRO-0.

    python bench/zero_memory.py [--hidden 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from goat_dist.launcher import child_env, launch_command


def measure(stage: int, precision: str, args, workdir: Path) -> dict:
    run_dir = workdir / f"zero{stage}-{precision}"
    cmd = launch_command(
        2,
        [
            "-m",
            "goat_dist",
            "train",
            f"parallel.zero_stage={stage}",
            f"train.precision={precision}",
            f"model.hidden_size={args.hidden}",
            f"model.num_layers={args.layers}",
            "model.seq_len=128",
            "train.max_steps=2",
            "train.global_batch_size=4",
            "train.micro_batch_size=2",
            "train.eval_interval=0",
            "log.tensorboard=false",
            f"run.dir={run_dir}",
        ],
    )
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"stage {stage} failed:\n{proc.stderr[-3000:]}")
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("event") == "memory":
            return {k: v["max"] for k, v in record["bytes"].items()}  # the larger rank
    sys.exit(f"stage {stage}: no memory record in {run_dir}/metrics.jsonl")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    ratios = {}
    with tempfile.TemporaryDirectory() as tmp:
        for precision in ("fp32", "bf16"):
            print(
                f"precision={precision}, DP=2, per-rank MiB (largest rank): params, grads(.grad), "
                "optimizer (+ZeRO buffers), total"
            )
            totals = {}
            for stage in range(4):
                m = measure(stage, precision, args, Path(tmp))
                totals[stage] = m["total"]
                print(
                    f"  ZeRO-{stage}: {m['params'] / 2**20:7.2f} {m['grads'] / 2**20:7.2f} "
                    f"{m['optimizer'] / 2**20:7.2f} = {m['total'] / 2**20:7.2f}   "
                    f"({m['total'] / totals[0]:.3f} of ZeRO-0)",
                    flush=True,
                )
            ratios[precision] = totals[3] / totals[0]
    print(f"fp32 ratio ZeRO-3 / ZeRO-0: {ratios['fp32']:.3f} (DeepSpeed keeps an extra fp32 partition copy)")
    print(f"ratio ZeRO-3 / ZeRO-0 (bf16 mixed precision): {ratios['bf16']:.3f}")


if __name__ == "__main__":
    main()
