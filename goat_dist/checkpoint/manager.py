"""Sharded checkpoints with atomic publish.

Layout of ``<run_dir>/checkpoints/``::

    step_00000020/           DeepSpeed's shards (each rank writes its own model/optimizer files),
                             rng_rank<R>.pt (every rank), trainer_state.json, config.yaml,
                             manifest.json (sizes + sha256 of every file; written last)
    latest                   the tag of the newest complete checkpoint (temp + fsync + rename)
    stale/                   checkpoints moved aside at start: newer than the run's starting point and
                             so not in its lineage (lineage.py)

A checkpoint counts only once ``latest`` names it, which happens after every rank finished writing and
the manifest exists: a crash at any point before leaves the previous checkpoint as ``latest``. Which
checkpoint to resume from is decided on rank 0 (resume.py); ``keep_last`` counts only the run's lineage.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..atomic import atomic_write_text, file_problem, sha256_file
from . import lineage, rng, universal
from .errors import CheckpointError, raise_on_every_rank
from .names import LATEST, MANIFEST, STALE, STATE, tag_for
from .resume import agree_on_checkpoint
from .safe_load import load as safe_load
from .safe_load import safe_loading
from .safe_load import scan as scan_pickles

__all__ = ["MANIFEST", "STATE", "CheckpointError", "CheckpointManager", "tag_for", "verify", "write_manifest"]

# what must match for DeepSpeed's own shards to load (bit-exact); otherwise the universal state is used.
# ``precision`` and ``param_groups`` (the optimizer's group names) are absent from older checkpoints,
# which therefore resume through universal/.
LAYOUT_KEYS = ("world", "tp", "dp", "zero_stage", "precision", "param_groups")


def write_manifest(step_dir: Path, extra: dict) -> None:
    files = {}
    for path in sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST):
        files[str(path.relative_to(step_dir))] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    atomic_write_text(step_dir / MANIFEST, json.dumps({"files": files, **extra}, indent=1))


def verify(step_dir: Path, checksums: bool = True) -> dict:
    """The manifest of a complete, intact checkpoint; raises CheckpointError naming what is wrong."""
    step_dir = Path(step_dir)
    manifest_path = step_dir / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {step_dir} is incomplete: no {MANIFEST} (interrupted save?)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"checkpoint {step_dir}: {MANIFEST} is not valid JSON: {e}") from e
    for name, meta in manifest["files"].items():
        problem = file_problem(step_dir / name, meta["bytes"], meta["sha256"], checksums=checksums)
        if problem:
            raise CheckpointError(f"checkpoint {step_dir} (step {manifest.get('step')}): {problem}")
    return manifest


class CheckpointManager:
    def __init__(self, run_dir: Path, keep_last: int = 2, is_main: bool = True, universal: bool = True):
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last
        self.is_main = is_main
        self.universal = universal
        self.parent: str | None = None  # this run's previous checkpoint in root (its lineage), if any

    # ---- reading ----------------------------------------------------------------------------------
    def latest(self) -> Path | None:
        """This process's view of ``latest`` (see ``choose_resume`` for the decision every rank uses)."""
        pointer = self.root / LATEST
        if not pointer.is_file():
            return None
        return self.root / pointer.read_text().strip()

    def choose_resume(self, choice: str) -> Path | None:
        """Collective: the checkpoint to resume from per ``train.resume`` (auto, never or a path), decided on
        rank 0 and seen by every rank (else a CheckpointError on all ranks naming the path and rank)."""
        if choice == "never":
            return None
        return agree_on_checkpoint(choice, self.latest)

    def begin(self, resumed_from: Path | None, start_step: int) -> list[str]:
        """Rank 0, once the run's starting point is known: start this run's lineage there and move
        checkpoints newer than it (not in its lineage) to ``checkpoints/stale/``. Returns the moved tags."""
        start_tag = None
        if resumed_from is not None and Path(resumed_from).parent.resolve() == self.root.resolve():
            start_tag = Path(resumed_from).name
        self.parent = start_tag
        if not self.is_main or not self.root.is_dir():
            return []
        moved = lineage.move_aside_newer(self.root, start_step, start_tag)
        if moved:
            print(
                f"checkpoints newer than this run's start (step {start_step}) are not in its lineage and "
                f"were moved to {self.root / STALE}: {', '.join(moved)} (train.resume=never or a resume "
                "from an older checkpoint); keep_last never counts them. Delete them when no longer needed."
            )
        return moved

    # ---- saving -----------------------------------------------------------------------------------
    def save(self, engine, trainer_state: dict, config_text: str, fault_hook=None) -> Path:
        """Collective: every rank calls it. Returns the published step directory."""
        started = time.perf_counter()
        step = trainer_state["step"]
        tag = tag_for(step)
        step_dir = self.root / tag
        trainer_state[lineage.PARENT] = self.parent if self.parent != tag else None
        if self.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            if step_dir.exists():  # a leftover of an interrupted save of the same step
                shutil.rmtree(step_dir)
        dist.barrier()
        engine.save_checkpoint(str(self.root), tag=tag, client_state={}, save_latest=False)
        if self.universal:
            universal.save(engine, engine.module, step_dir, step)
        torch.save(rng.capture(), step_dir / f"rng_rank{dist.get_rank()}.pt")
        if self.is_main:
            atomic_write_text(step_dir / STATE, json.dumps(trainer_state, indent=1))
            atomic_write_text(step_dir / "config.yaml", config_text)
        dist.barrier()  # every shard is on disk
        if fault_hook is not None:
            fault_hook("before_publish", step_dir)
        if self.is_main:
            write_manifest(step_dir, {"step": step, "saved_at": time.time()})
            atomic_write_text(self.root / LATEST, tag)
            lineage.prune(self.root, tag, self.keep_last)
        dist.barrier()
        self.parent = tag
        trainer_state["last_save_s"] = time.perf_counter() - started
        return step_dir

    # ---- loading ----------------------------------------------------------------------------------
    def load(self, engine, step_dir: Path, layout: dict) -> dict:
        """Collective: restores model, optimizer, LR schedule and this rank's RNG; returns trainer state."""
        step_dir = Path(step_dir)
        error = ""
        try:
            manifest = verify(step_dir, checksums=self.is_main)
            if self.is_main:  # before any rank unpickles anything: a refused file stops every rank
                scan_pickles(step_dir, manifest.get("step"))
        except CheckpointError as e:
            error = str(e)
        raise_on_every_rank(error, f"checkpoint {step_dir} failed verification on another rank")
        state = json.loads((step_dir / STATE).read_text())
        saved = {k: state.get(k) for k in LAYOUT_KEYS}
        same = saved == {k: layout.get(k) for k in LAYOUT_KEYS}
        if same:  # the same layout: DeepSpeed's own shards, bit-exact
            with safe_loading(state["step"]):
                path, _ = engine.load_checkpoint(
                    str(step_dir.parent),
                    tag=step_dir.name,
                    load_optimizer_states=True,
                    load_lr_scheduler_states=True,
                )
            if path is None:
                raise CheckpointError(f"DeepSpeed could not load {step_dir}")
            rng_file = step_dir / f"rng_rank{dist.get_rank()}.pt"
            if rng_file.is_file():
                rng.restore(safe_load(rng_file, state["step"]))
        else:  # another layout: merge and re-split the layout-independent copy
            if not (step_dir / "universal" / "meta.json").is_file():
                raise CheckpointError(
                    f"checkpoint {step_dir} was saved with layout {saved}, this run is {layout}, and it has "
                    "no universal/ state (checkpoint.universal was off): resume it on its own layout"
                )
            if self.is_main:
                changed = {
                    k: f"{saved[k]} -> {layout.get(k)}" for k in LAYOUT_KEYS if saved[k] != layout.get(k)
                }
                print(f"checkpoint {step_dir}: layout differs ({changed}); loading its universal/ state")
            universal.load(engine, engine.module, step_dir, state["step"])
        return state
