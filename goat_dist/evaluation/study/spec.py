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
    "alpha",
    "effect_size_nats",
    "effect_size_accuracy",
    "primary",
}
SEQUENTIAL_KEYS = {"min", "max", "first", "looks", "boundary", "stop_when"}
BOUNDARIES = ("obrien-fleming", "pocock")  # sequential.BOUNDARIES (not imported: it brings numpy)
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


def _sequential(value: dict, where: str) -> tuple[list, dict]:
    """``seeds: {min, max, first, looks, boundary, stop_when}``: the planned seeds first..first+max-1 and
    the stopping rule (docs/study.md, "Sequential seeds"). Every key is fixed before a seed is trained."""
    unknown = set(value) - SEQUENTIAL_KEYS
    if unknown:
        raise StudyError(
            f"{where}: unknown keys in 'seeds': {sorted(unknown)} (known: {sorted(SEQUENTIAL_KEYS)})"
        )
    looks = value.get("looks")
    if looks is not None and not (
        isinstance(looks, list) and looks and all(type(n) is int for n in looks)
        and all(b > a for a, b in zip(looks, looks[1:]))
    ):  # fmt: skip
        raise StudyError(f"{where}: seeds.looks must be an increasing list of seed counts, got {looks!r}")
    low = value.get("min", looks[0] if looks else 3)
    high = value.get("max", looks[-1] if looks else None)
    first = value.get("first", 1)
    for key, v in (("min", low), ("max", high), ("first", first)):
        if type(v) is not int:
            raise StudyError(f"{where}: seeds.{key} must be an integer, got {v!r}")
    if not 2 <= low <= high:
        raise StudyError(f"{where}: seeds needs 2 <= min <= max, got min {low}, max {high}")
    looks = looks or list(range(low, high + 1))
    if looks[0] != low or looks[-1] != high:
        raise StudyError(
            f"{where}: seeds.looks must start at min ({low}) and end at max ({high}), got {looks}"
        )
    boundary = value.get("boundary", "obrien-fleming")
    if boundary not in BOUNDARIES:
        raise StudyError(f"{where}: seeds.boundary must be one of {list(BOUNDARIES)}, got {boundary!r}")
    if value.get("stop_when", "resolved") != "resolved":
        raise StudyError(f"{where}: seeds.stop_when: the one rule is 'resolved', got {value['stop_when']!r}")
    rule = {
        "min": low,
        "max": high,
        "first": first,
        "looks": looks,
        "boundary": boundary,
        "stop_when": "resolved",
    }
    return list(range(first, first + high)), rule


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


def _level(value, key: str, where: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value < high:
        raise StudyError(f"{where}: '{key}' must be a number in ({low:g}, {high:g}), got {value!r}")
    return float(value)


def _primary(value, runs: dict, evaluation: dict, where: str) -> dict | None:
    """``primary: {a, b, length, metric}``: the one comparison the study is designed to decide (and, with
    sequential seeds, the one its stopping rule watches); ``length`` is a multiple of the training length."""
    if value is None:
        return None
    task_metrics = ["loss", "last_block"] if evaluation["task"] == "ppl" else ["accuracy", "digit_accuracy"]
    if not isinstance(value, dict) or set(value) - {"a", "b", "length", "metric"}:
        raise StudyError(
            f"{where}: 'primary' must be {{a: run, b: run, length: multiple, metric}}, got {value!r}"
        )
    a, b = value.get("a"), value.get("b")
    if a not in runs or b not in runs or a == b:
        raise StudyError(
            f"{where}: primary.a and primary.b must be two runs of {sorted(runs)}, got {a!r}, {b!r}"
        )
    length = value.get("length", 1)
    if length not in evaluation["multiples"]:
        raise StudyError(
            f"{where}: primary.length must be one of eval.multiples {evaluation['multiples']}, got {length!r}"
        )
    metric = value.get("metric", task_metrics[0])
    if metric not in task_metrics:
        raise StudyError(
            f"{where}: primary.metric for task {evaluation['task']} is one of {task_metrics}, got {metric!r}"
        )
    return {
        "a": a,
        "b": b,
        "length": length,
        "column": evaluation["multiples"].index(length),
        "metric": metric,
    }


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
    evaluation = _eval(spec.get("eval"), str(path))
    primary = _primary(spec.get("primary"), runs, evaluation, str(path))
    sequential = None
    if isinstance(spec.get("seeds"), dict):
        seeds, sequential = _sequential(spec["seeds"], str(path))
        if primary is None:
            raise StudyError(f"{path}: sequential 'seeds' stop on the 'primary' comparison: name it")
    else:
        seeds = _seeds(spec.get("seeds"), str(path))
    compare = _compare(spec.get("compare"), runs, str(path))
    if primary:  # compared first, as a - b; a pair the file lists itself keeps its order
        pair = (primary["a"], primary["b"])
        if spec.get("compare") is None or pair[::-1] not in compare:
            compare = [pair, *(p for p in compare if set(p) != set(pair))]
    return {
        "name": spec.get("name", path.stem),
        "description": spec.get("description", ""),
        "out": Path(spec.get("out", f"runs/study-{path.stem}")),
        "train_config": (path.parent / train_config).resolve() if train_config else None,
        "overrides": _overrides(spec.get("overrides"), f"{path}: overrides"),
        "seeds": seeds,
        "sequential": sequential,
        "runs": {str(k): list(v) for k, v in runs.items()},
        "compare": compare,
        "primary": primary,
        "alpha": _level(spec.get("alpha", 0.05), "alpha", str(path), 0.0, 0.5),
        "effect_size_nats": _level(
            spec.get("effect_size_nats", 0.065), "effect_size_nats", str(path), 0.0, 100.0
        ),
        "effect_size_accuracy": _level(
            spec.get("effect_size_accuracy", 0.1), "effect_size_accuracy", str(path), 0.0, 1.0
        ),
        "plots": _plots(spec.get("plots"), runs, str(path)),
        "eval": evaluation,
        "quick": quick,
        "jobs": jobs,
        "threads": threads,
    }
