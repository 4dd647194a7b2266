"""The layouts of tests/integration/parallel/ (test_scale_out.py, test_context_parallel_runs.py): what the
fixtures of its conftest.py train once per session.

A 2-rank and a 4-rank world (tests/workers/layout_runs.py) each train every layout of their size one after
the other, 10 steps of multiproc.TINY each, and save the TP-sharded gradient checks: two launches instead
of one per layout (a process start on 2 cores costs more than a tiny model's 10 steps). The single-process
references train in this process's world (``world1``). The tests only read what these fixtures wrote.

Both modules are one xdist work unit (tests/conftest.py's SHARED_GROUPS): one worker runs them and trains
each fixture once.
"""

from __future__ import annotations

from pathlib import Path

from .multiproc import ROOT, TINY, launch_command, per_step, records
from .multiproc import run as run_cmd

WORKER = ROOT / "tests" / "workers" / "layout_runs.py"
DOCS = "data.document_masking=true"
BF16 = "train.precision=bf16"

# one launch per world size; each job one distinct code path (scale-out: plain TP=2 GOAT is inside the
# TP x DP runs, ZeRO-1/2 over DP inside TP x DP, SP inside the selective-checkpointing run, full
# checkpointing inside the DP ZeRO-3 run; model.compile against the eager single-process run inside the
# DP ZeRO-3 run (ZeRO-3's hooks outside the compiled blocks) and the TP=2 + SP run (megatron's
# collectives between graphs))
TWO_RANK_JOBS = {
    # context parallelism: a checkpoint at step 5 for the CP2 -> 1 resume; the last step evaluates too
    # (attention statistics are skipped under CP); compiled blocks with CP's attention eager between them
    "cp2": ["parallel.cp=2", "checkpoint.interval=5"],
    "cp2-docs": [
        "parallel.cp=2", DOCS, "train.eval_interval=10", "train.eval_batches=1", "model.compile=true",
    ],
    "dp2-zero0": ["parallel.zero_stage=0"],
    "dp2-zero3-full-ckpt-compiled": [
        "parallel.zero_stage=3", "train.activation_checkpointing=full", "model.compile=true",
    ],
    "tp2-rope": ["parallel.tp=2", "model.position=rope"],
    "tp2-alibi": ["parallel.tp=2", "model.position=alibi"],
    "tp2-sp-selective-ckpt-compiled": [
        "parallel.tp=2", "parallel.sp=true", "train.activation_checkpointing=selective", "model.compile=true",
    ],
    "bf16-dp2-zero0": [BF16, "parallel.zero_stage=0"],
    "bf16-dp2-zero3": [BF16, "parallel.zero_stage=3"],
    # bf16 + ZeRO-0 + TP: DeepSpeed's unfused optimizer computes the gradient norm (engine/patches.py)
    "bf16-tp2": [BF16, "parallel.tp=2"],
}  # fmt: skip
FOUR_RANK_JOBS = {
    "cp2-tp2-sp": ["parallel.cp=2", "parallel.tp=2", "parallel.sp=true"],
    "cp2-dp2-zero2": ["parallel.cp=2", "parallel.zero_stage=2"],
    "tp4": ["parallel.tp=4"],
    **{f"tp2xdp2-zero{z}": ["parallel.tp=2", f"parallel.zero_stage={z}"] for z in (1, 2, 3)},
    "bf16-tp2xdp2-zero2": [BF16, "parallel.tp=2", "parallel.zero_stage=2"],
}
JOBS = {**TWO_RANK_JOBS, **FOUR_RANK_JOBS}  # name -> overrides
# the single-process run each layout is compared with
REFERENCE = {
    "cp2-docs": "documents",
    "tp2-rope": "rope",
    "tp2-alibi": "alibi",
    **{name: "bf16" for name in JOBS if name.startswith("bf16-")},
}
REFERENCES = {"plain": [], "documents": [DOCS], "rope": ["model.position=rope"],
              "alibi": ["model.position=alibi"], "bf16": [BF16]}  # fmt: skip


def launch(nproc: int, out: Path, cache: Path, jobs: list[str]) -> Path:
    run_cmd(launch_command(nproc, [str(WORKER), str(out), str(cache), *jobs]), timeout=900)
    return out


def train_jobs(jobs: dict[str, list[str]]) -> list[str]:
    return [f"train:{name}:{','.join(overrides)}" for name, overrides in jobs.items()]


def layout_config(cache: Path | str, run_dir: Path, *overrides: str):
    """The config every layout and reference trains: 10 steps of TINY; later overrides win."""
    from goat_dist.config import load_config

    return load_config(
        None, [*TINY, "train.max_steps=10", f"data.cache_dir={cache}", f"run.dir={run_dir}", *overrides]
    )


def train_here(cache: Path, run_dir: Path, *overrides: str) -> dict[int, tuple[float, int]]:
    """One process, in this process's world: a single-process reference."""
    from goat_dist.trainer import Trainer

    Trainer(layout_config(cache, run_dir, *overrides)).fit()
    return per_step(run_dir)


def losses_and_norms(run_dir: Path) -> list[tuple[float, float]]:
    return [(r["loss"], r["grad_norm"]) for r in records(run_dir) if "loss" in r]
