"""Two GPUs, two ranks, NCCL: tensor parallelism through an evaluation and a checkpoint-and-stop.

What a one-GPU run cannot show: megatron's TP group is NCCL only on CUDA (distributed.backend_for), so a
host tensor reduced over it fails there and nowhere else. This trains the tiny config at
``parallel.tp=2`` in bf16 with an evaluation at step 5 (the attention statistics all-reduce over TP,
``eval ppl``'s reductions take the same path), sends the launcher SIGTERM once step 7 is logged (as Slurm
does at a time limit) and checks the stop: exit 75 reported, ``last_exit.json`` says ``checkpointed``, the
step's checkpoint is published; then resumes to step 12 from it, and runs ``eval ppl`` on the result at
DP=2 (its totals reduce over the data-parallel group, NCCL only). Writes ``gpu_tp2.json`` to ``--out``.
On fewer than two GPUs it writes a skip record and exits 0.

    python bench/gpu_tp2.py [--out DIR] [--work DIR]
    python bench/gpu_tp2.py --cpu --precision fp32   # the same checks on 2 CPU processes
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from goat_dist.launcher import child_env

ROOT = Path(__file__).resolve().parents[1]


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def command(args: list[str], task: tuple[str, ...] = ("train",)) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29519"]
    return [*cmd, "-m", "goat_dist", *task, *args]


def stop_after(args: list[str], run_dir: Path, step: int, log: Path, timeout: float) -> int:
    """Run until ``step`` is logged, then SIGTERM the launcher; its exit code (124: never got there)."""
    with log.open("w") as f:
        proc = subprocess.Popen(command(args), stdout=f, stderr=subprocess.STDOUT, env=child_env(), cwd=ROOT)
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            if any(r.get("step", 0) >= step and "loss" in r for r in records(run_dir)):
                proc.send_signal(signal.SIGTERM)
                break
            time.sleep(0.5)
        try:
            return proc.wait(timeout=max(60.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            return 124


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu_suite")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "gpu_tp2")
    ap.add_argument("--cache", default=str(ROOT / "runs" / "gpu_cache"))
    ap.add_argument("--precision", default="bf16", help="fp32 to try the script on a CPU (with --cpu)")
    ap.add_argument("--cpu", action="store_true", help="run on 2 CPU processes (gloo): checks the script")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    import torch

    gpus = torch.cuda.device_count()
    if gpus < 2 and not args.cpu:
        result = {"skipped": f"needs 2 GPUs, found {gpus}"}
        print("gpu_tp2: skipped:", result["skipped"])
        (args.out / "gpu_tp2.json").write_text(json.dumps(result, indent=2) + "\n")
        return 0
    run_dir = args.work / "tp2"
    common = [f"data.cache_dir={args.cache}", f"run.dir={run_dir}", f"train.precision={args.precision}",
              "parallel.tp=2", "parallel.sp=true", "log.interval=1", "train.eval_interval=5",
              "train.eval_batches=2", "log.attention_stats=true", "checkpoint.interval=0"]  # fmt: skip
    t0 = time.perf_counter()
    stopped = stop_after([*common, "train.max_steps=1000"], run_dir, 7, args.work / "tp2_stop.log", 400)
    last_exit = (
        json.loads((run_dir / "last_exit.json").read_text()) if (run_dir / "last_exit.json").is_file() else {}
    )
    evals = [r for r in records(run_dir) if "val_loss" in r]
    resumed = subprocess.run(command([*common, "train.max_steps=12"]), capture_output=True, text=True,
                             env=child_env(), cwd=ROOT, timeout=400)  # fmt: skip
    (args.work / "tp2_resume.log").write_text(resumed.stdout + resumed.stderr)
    losses = {r["step"]: r["loss"] for r in records(run_dir) if "loss" in r}
    # eval ppl at DP=2: its totals reduce over the data-parallel group (NCCL only)
    ppl = subprocess.run(command(["--checkpoint", str(run_dir), "--lengths", "256,512", "--tokens", "8192",
                                  "--tp", "1"], ("eval", "ppl")),
                         capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=300)  # fmt: skip
    (args.work / "tp2_eval_ppl.log").write_text(ppl.stdout + ppl.stderr)
    result = {
        "seconds": round(time.perf_counter() - t0, 1),
        "stop_exit_code": stopped,
        "last_exit": last_exit,
        "eval_steps": [r["step"] for r in evals],
        "attention_stats_logged": any("attn" in k or "sink" in k for r in evals for k in r),
        "resume_exit_code": resumed.returncode,
        "resumed_to": max(losses, default=None),
        "eval_ppl_exit_code": ppl.returncode,
        "ok": last_exit.get("status") == "checkpointed"
        and bool(evals)
        and resumed.returncode == 0
        and max(losses, default=0) >= 12
        and ppl.returncode == 0,
    }
    if not result["ok"]:
        result["log_tail"] = (
            (args.work / "tp2_stop.log").read_text()[-3000:] + resumed.stderr[-2000:] + ppl.stderr[-2000:]
        )
    print("gpu_tp2:", json.dumps({k: v for k, v in result.items() if k != "log_tail"}), flush=True)
    (args.out / "gpu_tp2.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
