"""Shared helpers for tests that launch real runs: `goat-dist train` in subprocesses, under torchrun when
more than one process, with a clean launcher environment, and their metrics.jsonl."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from goat_dist.launcher import child_env, launch_command

ROOT = Path(__file__).resolve().parents[2]

# a tiny model on the small builtin corpus: seconds per run on 2 CPU cores
TINY = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_heads=4",
    "model.seq_len=64",
    "model.vocab_size=4096",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.lr=2e-3",
    "train.warmup_steps=3",
    "train.precision=fp32",
    "train.eval_interval=0",
    "log.interval=1",
    "log.tensorboard=false",
    "model.attention_backend=sdpa",
    "data.builtin_max_bytes=1000000",
]


def clean_env(**extra) -> dict:
    """This environment for a child world: no launcher variables, one thread per process, this checkout."""
    return child_env(**{"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **extra})


PRECISIONS = ("fp32", "bf16")


def tiny(precision: str = "fp32") -> list[str]:
    """TINY in ``precision`` (``train.precision``: fp32, or DeepSpeed's bf16 mode with autocast)."""
    assert precision in PRECISIONS, precision
    return [f"train.precision={precision}" if o.startswith("train.precision=") else o for o in TINY]


# a one-layer model for tests that build a Trainer in-process (the world1 fixture's single rank)
IN_PROCESS = [
    "model.num_layers=1",
    "model.hidden_size=64",
    "model.num_heads=4",
    "model.seq_len=32",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "train.precision=fp32",
    "train.eval_interval=0",
    "log.tensorboard=false",
    "data.builtin_max_bytes=1000000",
]


def in_process_config(cache: Path, run_dir: Path, *overrides: str):
    """A validated Config of the IN_PROCESS model on the shared builtin cache; later overrides win."""
    from goat_dist.config import load_config

    return load_config(None, [*IN_PROCESS, f"data.cache_dir={cache}", f"run.dir={run_dir}", *overrides])


# a one-layer model for tests that build an engine in-process (no data, no run dir)
ONE_LAYER = [
    "model.num_layers=1",
    "model.hidden_size=64",
    "model.num_heads=4",
    "model.seq_len=32",
    "model.vocab_size=300",
    "model.attention_backend=sdpa",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
]


def one_layer_config(*overrides: str):
    """A validated Config of the ONE_LAYER model; later overrides win."""
    from goat_dist.config import load_config

    return load_config(None, [*ONE_LAYER, *overrides])


def goat_train_command(nproc: int, overrides: list[str], precision: str = "fp32") -> list[str]:
    return launch_command(nproc, ["-m", "goat_dist", "train", *tiny(precision), *overrides])


__all__ = [
    "PRECISIONS",
    "ROOT",
    "TINY",
    "clean_env",
    "in_process_config",
    "one_layer_config",
    "tiny",
    "goat_train_command",
    "launch_command",
    "per_step",
    "marked_line",
    "records",
    "run",
]


def run(
    cmd: list[str], expect: int | None = 0, timeout: int = 400, cwd: Path = ROOT, **env
) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=clean_env(**env), capture_output=True, text=True, timeout=timeout, cwd=cwd)
    if expect is not None:
        assert proc.returncode == expect, (
            f"{' '.join(cmd)}\nexit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
    return proc


def marked_line(argv: list[str], marker: str, timeout: int = 300) -> str:
    """``python *argv`` in a clean environment (a worker script of ``tests/workers/`` or ``-c`` code): the
    rest of the first stdout line that starts with ``marker``, or a failure showing both streams' tails."""
    import sys

    proc = run([sys.executable, *argv], expect=None, timeout=timeout)
    lines = [x for x in proc.stdout.splitlines() if x.startswith(marker + " ")]
    assert lines, f"no {marker} line (exit {proc.returncode})\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return lines[0][len(marker) + 1 :]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def per_step(run_dir: Path) -> dict[int, tuple[float, int]]:
    """step -> (loss, data fingerprint); a resumed run's later records win."""
    return {r["step"]: (r["loss"], r["data_fingerprint"]) for r in records(run_dir) if "loss" in r}


def assert_config_is_the_runs(run_dir: Path) -> dict:
    """The run dir's config.yaml is the config the run ran with, resolved: the same as the one its last
    checkpoint recorded (written from the run's config at the save), with every derived value concrete
    (the precision, GOAT's L_train and key lanes, the window order). Returns it."""
    import yaml

    written = yaml.safe_load((run_dir / "config.yaml").read_text())
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    saved = yaml.safe_load((run_dir / "checkpoints" / latest / "config.yaml").read_text())
    assert written == saved, f"{run_dir}/config.yaml differs from {latest}/config.yaml"
    assert written["train"]["precision"] in ("fp32", "bf16"), written["train"]["precision"]
    goat = written["model"]["goat"]
    assert isinstance(goat["train_len"], int) and isinstance(goat["key_bias_lanes"], int), goat
    return written
