"""Seed statistics, pure functions (tested on synthetic numbers): mean +- std over seeds, and the paired
per-seed difference of two runs with its t-test, confidence interval and power.

Why a t-test and not "mean > 2 SE": with 3 seeds the standard error has 2 degrees of freedom and
|mean| > 2 SE happens 18 % of the time when there is no difference; the t-test at ``alpha`` rejects a
true null ``alpha`` of the time at any number of seeds, and its power says how many seeds a given effect
needs at the seed scatter seen."""

from __future__ import annotations

import math

from .tdist import nct_cdf, t_critical, t_two_sided

ALPHA = 0.05  # the default test level; a study file sets its own ('alpha')
EFFECT_NATS = 0.065  # the paper's in-distribution GOAT - ALiBi (1.55 ppl at its ~30 ppl), in nats
EFFECT_ACCURACY = 0.10  # passkey: a difference in exact-match accuracy worth detecting
POWER_TARGET = 0.8


def seed_stats(values: list[float]) -> dict:
    """Mean and sample standard deviation (ddof 1; None for one seed) of one number over seeds."""
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else None
    return {"mean": mean, "std": std, "n": n, "values": list(values)}


def t_power(effect: float, sd: float, n: int, alpha: float = ALPHA) -> float | None:
    """Power of the two-sided paired t-test at ``alpha`` with ``n`` seeds when the true mean difference
    is ``effect`` and the per-seed differences have standard deviation ``sd`` (noncentral t, exact)."""
    if n < 2:
        return None
    if sd == 0:
        return 1.0 if effect != 0 else alpha
    df, nc = n - 1, abs(effect) * math.sqrt(n) / sd
    crit = t_critical(alpha, df)
    return 1.0 - nct_cdf(crit, df, nc) + nct_cdf(-crit, df, nc)


def seeds_for_power(
    effect: float, sd: float, alpha: float = ALPHA, target: float = POWER_TARGET, cap: int = 100_000
) -> int | None:
    """The fewest seeds whose paired t-test reaches ``target`` power (None: more than ``cap``)."""
    if sd == 0:
        return 2
    lo, hi = 1, 2  # power(lo) < target <= power(hi) once bracketed
    while t_power(effect, sd, hi, alpha) < target:
        lo, hi = hi, 2 * hi
        if hi > cap:
            return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if t_power(effect, sd, mid, alpha) < target else (lo, mid)
    return hi


def paired_test(diffs: list[float], alpha: float = ALPHA, effect: float | None = None) -> dict:
    """The paired t-test of per-seed differences: mean, sd, se, t, two-sided p, the (1 - alpha) interval
    and, given ``effect``, the power at it for this many seeds and the seeds 80 % power needs (both at
    the observed sd). ``resolved``: p < alpha; one seed resolves nothing."""
    stats = seed_stats(diffs)
    n, mean, sd = stats["n"], stats["mean"], stats["std"]
    row = {"mean": mean, "sd": sd, "se": None, "n": n, "diffs": list(diffs), "alpha": alpha, "t": None,
           "df": n - 1, "p": None, "ci": None, "resolved": False, "effect": effect, "power": None,
           "seeds_for_power": None}  # fmt: skip
    if n < 2:
        return row
    se = sd / math.sqrt(n)
    t = mean / se if se > 0 else (math.copysign(math.inf, mean) if mean else math.nan)
    half = t_critical(alpha, n - 1) * se
    p = t_two_sided(t, n - 1)
    row.update(se=se, t=t, p=p, ci=[mean - half, mean + half], resolved=p < alpha)
    if effect is not None:
        row.update(power=t_power(effect, sd, n, alpha), seeds_for_power=seeds_for_power(effect, sd, alpha))
    return row


def paired_difference(a: dict, b: dict, alpha: float = ALPHA, effect: float | None = None) -> dict:
    """``a - b`` paired by seed (keys of both): ``paired_test`` of the differences, with the seeds.

    Pairing: the same seed gives every run the same data order, so the per-seed difference removes the
    part of the seed noise the runs share."""
    seeds = [s for s in a if s in b]
    if not seeds:
        raise ValueError(f"no common seeds to pair: {sorted(a)} vs {sorted(b)}")
    return {**paired_test([a[s] - b[s] for s in seeds], alpha, effect), "seeds": seeds}


def effect_for(metric: str, study: dict) -> float:
    """The effect size the power of ``metric``'s comparisons is computed at (the study file's)."""
    return study["effect_size_accuracy"] if "accuracy" in metric else study["effect_size_nats"]


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


def compare(
    per_seed: dict,
    metric: str,
    pairs: list[tuple[str, str]],
    alpha: float = ALPHA,
    effect: float | None = None,
) -> list[dict]:
    """The paired difference of each pair at each column: [{a, b, metric, column, **paired_difference}]."""
    values = metric_values(per_seed, metric)
    rows = []
    for a, b in pairs:
        columns = len(next(iter(values[a].values())))
        for c in range(columns):
            da = {s: v[c] for s, v in values[a].items()}
            db = {s: v[c] for s, v in values[b].items()}
            rows.append(
                {"a": a, "b": b, "metric": metric, "column": c, **paired_difference(da, db, alpha, effect)}
            )
    return rows


def best_resolved(per_seed: dict, metric: str, higher_better: bool, alpha: float = ALPHA) -> list[dict]:
    """Per column: the run with the best mean, and whether its paired t-test against every other run
    has p < alpha."""
    agg = aggregate(per_seed, metric)
    values = metric_values(per_seed, metric)
    columns = len(next(iter(agg.values())))
    out = []
    for c in range(columns):
        sign = -1.0 if higher_better else 1.0
        best = min(agg, key=lambda r: sign * agg[r][c]["mean"])
        beats = all(
            paired_difference(
                {s: v[c] for s, v in values[best].items()}, {s: v[c] for s, v in values[other].items()}, alpha
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
