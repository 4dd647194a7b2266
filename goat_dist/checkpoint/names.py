"""File and directory names inside ``<run_dir>/checkpoints/`` (defined once)."""

from __future__ import annotations

MANIFEST = "manifest.json"
STATE = "trainer_state.json"
LATEST = "latest"
# the last published save's measured seconds and bytes, for the next attempt's deadline (checkpoints/)
SAVE_COST = "save_cost.json"
STALE = "stale"  # where checkpoints outside the current run's lineage are moved (lineage.py)


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def step_of(tag: str) -> int:
    return int(tag.split("_")[1])
