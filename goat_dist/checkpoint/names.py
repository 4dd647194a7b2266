"""File and directory names inside ``<run_dir>/checkpoints/`` (defined once)."""

from __future__ import annotations

MANIFEST = "manifest.json"
STATE = "trainer_state.json"
LATEST = "latest"
STALE = "stale"  # where checkpoints outside the current run's lineage are moved (lineage.py)


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def step_of(tag: str) -> int:
    return int(tag.split("_")[1])
