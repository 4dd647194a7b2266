"""goat-dist training on one CUDA GPU, end to end: an NCCL smoke run with a checkpoint and a resume, and
the MFU of the 125M and 1.3B configs.

Every run is ``python -m goat_dist train`` under torchrun with one process: a one-rank world on CUDA is
NCCL only (distributed.backend_for), so a collective that NCCL refuses fails here. The smoke
run trains the tiny config in bf16 for 20 steps with a checkpoint at 10, then resumes to 30 (the
checkpoint loads on CUDA, the loss continues). The MFU runs take ``configs/models/goat_{125m,1.3b}.yaml``
on the builtin corpus (its tokenizer trained at the config's vocabulary) for a few steps and report the
median over the last steps of what the trainer itself logs (``perf/mfu``, ``perf/tokens_per_s``), i.e.
the project's FLOP count against the device's bf16 peak. Writes ``gpu_train.json`` to ``--out`` (with the
end of the log of any run that failed); run dirs and logs go to ``--work``.

    python bench/gpu_train.py [--out DIR] [--work DIR] [--models 125m 1.3b] [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from goat_dist.launcher import child_env

ROOT = Path(__file__).resolve().parents[1]
MICRO = {"125m": 16, "1.3b": 8}  # sequences of 2048 per micro-batch on one 80+ GB GPU


def torchrun(args: list[str], log: Path, timeout: int) -> int:
    """Exit code of one training run; 124 when it ran past ``timeout`` (the next run still starts)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--master_port=29517"]
    cmd += ["-m", "goat_dist", "train", *args]
    with log.open("w") as f:
        try:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env(), timeout=timeout,
                                  cwd=ROOT)  # fmt: skip
        except subprocess.TimeoutExpired:
            f.write(f"\n[gpu_train: timed out after {timeout} s]\n")
            return 124
    return proc.returncode


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def log_tail(log: Path, rc: int) -> str | None:
    return None if rc == 0 or not log.is_file() else log.read_text()[-3000:]


def smoke(out: Path, cache: str, precision: str) -> dict:
    run_dir = out / "smoke"
    # 2 micro-batches a step (tiny.yaml's global batch of 8): bf16 sums them in fp32 through
    # BF16_Optimizer over a process group of the rank alone (engine/patches.py), NCCL here
    common = [f"data.cache_dir={cache}", f"run.dir={run_dir}", f"train.precision={precision}",
              "log.interval=1", "checkpoint.interval=10", "train.eval_interval=10",
              "train.micro_batch_size=4"]  # fmt: skip
    t0 = time.perf_counter()
    first = torchrun([*common, "train.max_steps=20"], out / "smoke_first.log", 600)
    second = torchrun([*common, "train.max_steps=30"], out / "smoke_resume.log", 600)
    losses = {r["step"]: r["loss"] for r in records(run_dir) if "loss" in r}
    start = next((r for r in records(run_dir) if r.get("event") == "start"), {})
    return {
        "exit_codes": [first, second],
        "seconds": round(time.perf_counter() - t0, 1),
        "steps_logged": sorted(losses),
        "loss_step1": losses.get(1),
        "loss_step30": losses.get(30),
        "resumed": "resumed from" in (out / "smoke_resume.log").read_text(),
        "attention_backend": start.get("attention_backend"),
        "ok": first == 0 and second == 0 and 30 in losses and losses[30] < losses.get(1, 0),
        "failed_log": log_tail(out / "smoke_first.log", first) or log_tail(out / "smoke_resume.log", second),
    }


def mfu(model: str, out: Path, cache: str, steps: int) -> dict:
    run_dir = out / f"mfu_{model}"
    micro = MICRO[model]
    args = [f"--config={ROOT / 'configs' / 'models' / f'goat_{model}.yaml'}", "data.source=builtin",
            f"data.cache_dir={cache}", f"run.dir={run_dir}", f"train.max_steps={steps}",
            f"train.micro_batch_size={micro}", f"train.global_batch_size={micro}", "train.warmup_steps=2",
            "train.eval_interval=0", "log.interval=1", "log.tensorboard=false", "checkpoint.interval=0",
            "checkpoint.save_at_end=false", "data.builtin_max_bytes=4000000"]  # fmt: skip
    t0 = time.perf_counter()
    rc = torchrun(args, out / f"mfu_{model}.log", 900)
    rows = [r for r in records(run_dir) if "mfu" in r]
    tail = rows[len(rows) // 2 :] or rows
    start = next((r for r in records(run_dir) if r.get("event") == "start"), {})
    return {
        "exit_code": rc,
        "seconds": round(time.perf_counter() - t0, 1),
        "micro_batch": micro,
        "steps": len(rows),
        "mfu": statistics.median(r["mfu"] for r in tail) if tail else None,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in tail) if tail else None,
        "tflops_per_device": statistics.median(r["tflops_per_device"] for r in tail) if tail else None,
        "mem_peak_gib": tail[-1].get("mem_peak_gib_max") if tail else None,  # the largest rank's
        "attention_backend": start.get("attention_backend"),
        "failed_log": log_tail(out / f"mfu_{model}.log", rc),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu_suite")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "gpu_train")
    ap.add_argument("--models", nargs="*", default=["125m", "1.3b"], choices=sorted(MICRO))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--cache", default=str(ROOT / "runs" / "gpu_cache"))
    ap.add_argument("--skip-smoke", action="store_true")
    ap.add_argument("--precision", default="bf16", help="of the smoke run (fp32 to try the script on a CPU)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    result = {}
    if not args.skip_smoke:
        result["smoke"] = smoke(args.work, args.cache, args.precision)
        print("smoke:", json.dumps(result["smoke"]), flush=True)
        (args.out / "gpu_train.json").write_text(json.dumps(result, indent=2) + "\n")  # kept if cut short
    for model in args.models:
        result[f"mfu_{model}"] = mfu(model, args.work, args.cache, args.steps)
        print(f"mfu {model}:", json.dumps(result[f"mfu_{model}"]), flush=True)
        (args.out / "gpu_train.json").write_text(json.dumps(result, indent=2) + "\n")
    ok = result.get("smoke", {}).get("ok", True) and all(
        result[f"mfu_{m}"]["exit_code"] == 0 for m in args.models
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
