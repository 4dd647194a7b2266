"""The study config: every key checked, defaults applied, the ``quick`` section merged (``load_study``)."""

from __future__ import annotations

import itertools
import os
import re
from pathlib import Path

import yaml

KEYS = {
    "name",
    "description",
    "out",
    "train_config",
    "overrides",
    "seeds",
    "runs",
    "compare",
    "plots",
    "eval",
    "quick",
    "jobs",
    "threads",
}
QUICK_KEYS = {"seeds", "overrides", "eval", "out", "jobs", "threads"}
EVAL_DEFAULTS = {
    "ppl": {"task": "ppl", "multiples": [1, 2, 4, 8], "tokens": 16384, "split": "val", "batch_tokens": 8192},
    "passkey": {
        "task": "passkey",
        "multiples": [1, 2, 4, 8],
        "depths": [0.1, 0.3, 0.5, 0.7, 0.9],
        "samples": 20,
        "seed": 0,
        "batch_tokens": 8192,
    },
}
# metric -> (label, True when higher is better)
METRICS = {
    "loss": ("validation loss (nats) over whole windows of m x L", False),
    "last_block": ("validation loss (nats) on positions [(m-1)L, mL) only: the extrapolated part", False),
    "accuracy": ("passkey exact-match accuracy, mean over depths", True),
    "digit_accuracy": ("passkey single-digit accuracy, mean over depths (chance 0.1)", True),
}
RECORD = "study_run.json"


class StudyError(ValueError):
    """The study config is malformed, or a reused run does not match it; the message names the key."""


def _seeds(value, where: str) -> list:
    """``[None]`` (the training config's own seed) or a list of distinct integers."""
    if value is None:
        return [None]
    ok = isinstance(value, list) and value and all(type(s) is int for s in value)
    if not ok or len(set(value)) != len(value):
        raise StudyError(f"{where}: 'seeds' must be a non-empty list of distinct integers, got {value!r}")
    return list(value)


def _overrides(value, where: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(o, str) and "=" in o for o in value):
        raise StudyError(f"{where} must be a list of 'section.key=value' strings, got {value!r}")
    return list(value)


def _positive(value, key: str, path: Path) -> int:
    if type(value) is not int or value < 1:
        raise StudyError(f"{path}: '{key}' must be a positive integer, got {value!r}")
    return value


def _eval(spec: dict | None, where: str) -> dict:
    """The evaluation section with its task's defaults; every key checked."""
    spec = dict(spec or {})
    task = spec.get("task", "ppl")
    if task not in EVAL_DEFAULTS:
        raise StudyError(f"{where}: eval.task must be one of {sorted(EVAL_DEFAULTS)}, got {task!r}")
    defaults = EVAL_DEFAULTS[task]
    unknown = set(spec) - set(defaults)
    if unknown:
        raise StudyError(f"{where}: eval keys for task {task} are {sorted(defaults)}, got {sorted(unknown)}")
    evaluation = {**defaults, **spec}
    multiples = evaluation["multiples"]
    positive = isinstance(multiples, list) and all(type(m) is int and m >= 1 for m in multiples)
    if not positive or not multiples:
        raise StudyError(f"{where}: eval.multiples must be a list of positive integers, got {multiples!r}")
    if task == "passkey" and not all(
        isinstance(d, (int, float)) and 0 <= d <= 1 for d in evaluation["depths"]
    ):
        raise StudyError(f"{where}: eval.depths must lie in [0, 1], got {evaluation['depths']!r}")
    return evaluation


def _compare(value, runs: dict, where: str) -> list[tuple[str, str]]:
    if value is None:
        return list(itertools.combinations(runs, 2))
    pairs = []
    for pair in value if isinstance(value, list) else [value]:
        if not (isinstance(pair, list) and len(pair) == 2 and all(p in runs for p in pair)):
            raise StudyError(
                f"{where}: compare entries must be [run, run] pairs of {sorted(runs)}, got {pair!r}"
            )
        pairs.append((pair[0], pair[1]))
    return pairs


def _plots(value, runs: dict, where: str) -> dict[str, list[str]]:
    if value is None:
        return {"study": list(runs)}
    if not isinstance(value, dict) or not value:
        raise StudyError(f"{where}: 'plots' must map picture names to lists of runs, got {value!r}")
    for stem, names in value.items():
        if not re.fullmatch(r"[A-Za-z0-9_-]+", str(stem)):
            raise StudyError(f"{where}: plots.{stem}: a picture name is letters, digits, '_' and '-'")
        if not isinstance(names, list) or not names or not all(n in runs for n in names):
            raise StudyError(f"{where}: plots.{stem} must list runs of {sorted(runs)}, got {names!r}")
    return {str(k): list(v) for k, v in value.items()}


def _apply_quick(spec: dict, path: Path) -> dict:
    """The ``quick`` section on top of the full study: its seeds, extra overrides, eval, out."""
    quick = spec.get("quick")
    if not isinstance(quick, dict):
        raise StudyError(f"{path}: --quick needs a 'quick' section (keys {sorted(QUICK_KEYS)})")
    unknown = set(quick) - QUICK_KEYS
    if unknown:
        raise StudyError(f"{path}: unknown keys in 'quick': {sorted(unknown)} (known: {sorted(QUICK_KEYS)})")
    merged = dict(spec)
    merged["seeds"] = quick.get("seeds", spec.get("seeds"))
    merged["overrides"] = [
        *_overrides(spec.get("overrides"), f"{path}: overrides"),
        *_overrides(quick.get("overrides"), f"{path}: quick.overrides"),
    ]
    merged["eval"] = {**(spec.get("eval") or {}), **(quick.get("eval") or {})}
    merged["out"] = quick.get("out", f"{spec.get('out', f'runs/study-{path.stem}')}-quick")
    for key in ("jobs", "threads"):
        if key in quick:
            merged[key] = quick[key]
    return merged


def load_study(path: str | Path, quick: bool = False) -> dict:
    """The study config, checked and with its defaults; ``quick`` applies its ``quick`` section."""
    path = Path(path)
    if not path.is_file():
        raise StudyError(f"study config not found: {path}")
    spec = yaml.safe_load(path.read_text()) or {}
    unknown = set(spec) - KEYS
    if unknown:
        raise StudyError(f"{path}: unknown keys {sorted(unknown)} (known: {sorted(KEYS)})")
    if quick:
        spec = _apply_quick(spec, path)
    runs = spec.get("runs")
    if not isinstance(runs, dict) or not runs:
        raise StudyError(f"{path}: 'runs' must map run names to lists of overrides")
    for name, overrides in runs.items():
        if not re.fullmatch(r"[A-Za-z0-9_-]+", str(name)):
            raise StudyError(f"{path}: run name {name!r}: use letters, digits, '_' and '-'")
        _overrides(overrides, f"{path}: runs.{name}")
    train_config = spec.get("train_config")
    jobs = _positive(spec.get("jobs", 1), "jobs", path)
    threads = _positive(spec.get("threads", max(1, (os.cpu_count() or 1) // jobs)), "threads", path)
    return {
        "name": spec.get("name", path.stem),
        "description": spec.get("description", ""),
        "out": Path(spec.get("out", f"runs/study-{path.stem}")),
        "train_config": (path.parent / train_config).resolve() if train_config else None,
        "overrides": _overrides(spec.get("overrides"), f"{path}: overrides"),
        "seeds": _seeds(spec.get("seeds"), str(path)),
        "runs": {str(k): list(v) for k, v in runs.items()},
        "compare": _compare(spec.get("compare"), runs, str(path)),
        "plots": _plots(spec.get("plots"), runs, str(path)),
        "eval": _eval(spec.get("eval"), str(path)),
        "quick": quick,
        "jobs": jobs,
        "threads": threads,
    }
