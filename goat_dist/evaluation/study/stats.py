"""Seed statistics, pure functions (tested on synthetic numbers): mean +- std over seeds, and the paired
per-seed difference that decides whether a difference between two runs is resolved."""

from __future__ import annotations

import math

RESOLVE_SE = 2.0  # a difference is resolved when |mean| > RESOLVE_SE standard errors


def seed_stats(values: list[float]) -> dict:
    """Mean and sample standard deviation (ddof 1; None for one seed) of one number over seeds."""
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else None
    return {"mean": mean, "std": std, "n": n, "values": list(values)}


def paired_difference(a: dict, b: dict) -> dict:
    """``a - b`` paired by seed (keys of both): mean, standard error, and whether it is resolved.

    Resolved: at least two common seeds and ``|mean| > RESOLVE_SE * se``; with se = 0 any nonzero mean
    is resolved (every seed agrees exactly)."""
    seeds = [s for s in a if s in b]
    if not seeds:
        raise ValueError(f"no common seeds to pair: {sorted(a)} vs {sorted(b)}")
    diffs = [a[s] - b[s] for s in seeds]
    stats = seed_stats(diffs)
    se = None if stats["std"] is None else stats["std"] / math.sqrt(len(diffs))
    resolved = se is not None and abs(stats["mean"]) > RESOLVE_SE * se
    return {
        "mean": stats["mean"],
        "se": se,
        "n": len(diffs),
        "seeds": seeds,
        "diffs": diffs,
        "resolved": resolved,
    }


def metric_values(per_seed: dict, metric: str) -> dict:
    """{run: {seed: [value per column]}} of one metric, from {run: {seed: {metric: [...]}}}."""
    return {run: {s: m[metric] for s, m in seeds.items()} for run, seeds in per_seed.items()}


def metric_names(per_seed: dict) -> list[str]:
    first_run = next(iter(per_seed.values()))
    return list(next(iter(first_run.values())))


def aggregate(per_seed: dict, metric: str) -> dict:
    """{run: [seed_stats per column]} of one metric."""
    out = {}
    for run, seeds in metric_values(per_seed, metric).items():
        columns = len(next(iter(seeds.values())))
        out[run] = [seed_stats([v[c] for v in seeds.values()]) for c in range(columns)]
    return out


def compare(per_seed: dict, metric: str, pairs: list[tuple[str, str]]) -> list[dict]:
    """The paired difference of each pair at each column: [{a, b, column, mean, se, n, resolved}]."""
    values = metric_values(per_seed, metric)
    rows = []
    for a, b in pairs:
        columns = len(next(iter(values[a].values())))
        for c in range(columns):
            da = {s: v[c] for s, v in values[a].items()}
            db = {s: v[c] for s, v in values[b].items()}
            rows.append({"a": a, "b": b, "metric": metric, "column": c, **paired_difference(da, db)})
    return rows


def best_resolved(per_seed: dict, metric: str, higher_better: bool) -> list[dict]:
    """Per column: the run with the best mean, and whether it beats every other run resolvedly."""
    agg = aggregate(per_seed, metric)
    values = metric_values(per_seed, metric)
    columns = len(next(iter(agg.values())))
    out = []
    for c in range(columns):
        sign = -1.0 if higher_better else 1.0
        best = min(agg, key=lambda r: sign * agg[r][c]["mean"])
        beats = all(
            paired_difference(
                {s: v[c] for s, v in values[best].items()}, {s: v[c] for s, v in values[other].items()}
            )["resolved"]
            for other in agg
            if other != best
        )
        out.append({"run": best, "resolved": beats and len(agg) > 1})
    return out


# ---- per-report numbers --------------------------------------------------------------------------
def ppl_metrics(report: dict) -> dict:
    """Whole-window loss and last-block loss per length; the position-block losses of the longest."""
    results = report["results"]
    return {
        "loss": [r["loss"] for r in results],
        "last_block": [r["loss_by_position"][-1]["loss"] for r in results],
        "blocks": [b["loss"] for b in results[-1]["loss_by_position"]],
    }


def passkey_metrics(report: dict) -> dict:
    """Exact-match and digit accuracy per length (mean over depths), and the full exact-match grid."""
    mean = lambda rows: [sum(r) / len(r) for r in rows]  # noqa: E731
    return {
        "accuracy": mean(report["accuracy"]),
        "digit_accuracy": mean(report["digit_accuracy"]),
        "grid": [v for row in report["accuracy"] for v in row],  # lengths x depths, row-major
    }
