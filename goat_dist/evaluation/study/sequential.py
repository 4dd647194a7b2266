"""Sequential seeds: a group-sequential paired t-test of the study's primary comparison, with a boundary
fixed from the study file alone (``alpha``, the looks, its shape) before any seed is trained.

Why: a seed costs minutes, and the number of seeds a comparison needs depends on a scatter nobody knows
in advance. Looking after every seed and stopping at the first p < alpha would reject a true null far
more often than alpha (0.17 with looks at 3, 4, ..., 10 seeds); a boundary that is stricter at each look keeps
the probability of ever crossing it, when there is no difference, at alpha.

The boundary: at look k (n_k seeds) the nominal two-sided level is alpha_k = 2 (1 - Phi(c_k)), with
c_k = C sqrt(n_K / n_k) (O'Brien-Fleming: very strict early, close to alpha at the last look) or c_k = C
(Pocock: the same level at every look). Those are the known-variance shapes; with a handful of seeds
the t statistics are not normal, so C is calibrated for the t statistics themselves: the sequence of
paired t statistics under the null does not depend on the scatter (it is scale-free), so C is the value
at which 200,000 simulated null studies cross with probability alpha (a fixed random seed: the same
study file always gets the same boundary). The study stops at the first look whose |t| reaches the
critical value of alpha_k at n_k - 1 degrees of freedom (efficacy), or after the last look."""

from __future__ import annotations

import functools
import math

import numpy as np

from .stats import paired_test
from .tdist import norm_two_sided, t_critical

BOUNDARIES = ("obrien-fleming", "pocock")
CALIBRATION_SIMS = 200_000
CALIBRATION_SEED = 0


def nominal_levels(looks: list[int], constant: float, kind: str) -> list[float]:
    """The two-sided nominal level of each look for the boundary constant C."""
    if kind not in BOUNDARIES:
        raise ValueError(f"boundary must be one of {BOUNDARIES}, got {kind!r}")
    last = looks[-1]
    scale = [math.sqrt(last / n) if kind == "obrien-fleming" else 1.0 for n in looks]
    return [norm_two_sided(constant * s) for s in scale]


def critical_values(looks: list[int], levels: list[float]) -> list[float]:
    """|t| at which each look crosses: two-sided level alpha_k at n_k - 1 degrees of freedom."""
    return [t_critical(a, n - 1) for n, a in zip(looks, levels)]


def simulate_t(looks: list[int], sims: int, shift: float = 0.0, seed: int = 0) -> np.ndarray:
    """(sims, looks) paired t statistics of studies whose per-seed differences are N(shift, 1)."""
    rng = np.random.default_rng(seed)
    out = np.empty((sims, len(looks)))
    cols = np.asarray(looks) - 1
    n = np.asarray(looks, dtype=float)
    for start in range(0, sims, 50_000):
        x = rng.standard_normal((min(50_000, sims - start), looks[-1])) + shift
        total, squares = np.cumsum(x, 1)[:, cols], np.cumsum(x * x, 1)[:, cols]
        mean = total / n
        var = np.maximum(squares - n * mean * mean, 0.0) / (n - 1)
        with np.errstate(divide="ignore", invalid="ignore"):
            out[start : start + len(x)] = mean / np.sqrt(var / n)
    return out


def first_crossing(t: np.ndarray, critical: list[float]) -> np.ndarray:
    """Per simulated study: the index of the first look whose |t| reaches its critical value, -1: none."""
    crossed = np.abs(t) >= np.asarray(critical)[None, :]
    return np.where(crossed.any(1), crossed.argmax(1), -1)


def make_design(looks: list[int], alpha: float, kind: str = "obrien-fleming") -> dict:
    """The boundary of a sequential study: per look the seeds, nominal level and critical |t|; C is
    calibrated so that simulated null studies cross with probability alpha (one look: the t-test)."""
    return dict(_design(tuple(looks), alpha, kind))


@functools.lru_cache(maxsize=16)
def _design(looks: tuple, alpha: float, kind: str) -> dict:
    looks = list(looks)
    if len(looks) < 1 or looks[0] < 2 or any(b <= a for a, b in zip(looks, looks[1:])):
        raise ValueError(f"looks must be increasing seed counts >= 2, got {looks}")
    if len(looks) == 1:
        levels, constant, crossing = [alpha], None, alpha
    else:
        t = simulate_t(looks, CALIBRATION_SIMS, seed=CALIBRATION_SEED)
        lo, hi = 0.5, 12.0  # the null crossing probability falls as C grows
        for _ in range(60):
            constant = 0.5 * (lo + hi)
            rate = float(
                (first_crossing(t, critical_values(looks, nominal_levels(looks, constant, kind))) >= 0).mean()
            )
            lo, hi = (constant, hi) if rate > alpha else (lo, constant)
        constant = hi
        levels = nominal_levels(looks, constant, kind)
        crossing = float((first_crossing(t, critical_values(looks, levels)) >= 0).mean())
    return {
        "looks": looks,
        "alpha": alpha,
        "boundary": kind,
        "constant": constant,
        "nominal": levels,
        "critical_t": critical_values(looks, levels),
        "null_crossing_simulated": crossing,
        "calibration": {"sims": CALIBRATION_SIMS, "seed": CALIBRATION_SEED},
    }


def look(diffs: list[float], design: dict, k: int) -> dict:
    """Look ``k`` at the first ``design['looks'][k]`` per-seed differences: the paired t-test, the
    boundary, whether it is crossed, and the repeated confidence interval (mean +- critical t x se, which
    covers the true difference at every look at once with probability 1 - alpha, whenever one stops)."""
    n = design["looks"][k]
    if len(diffs) < n:
        raise ValueError(f"look {k} needs {n} seeds, got {len(diffs)}")
    test = paired_test(list(diffs[:n]), design["alpha"])
    crit = design["critical_t"][k]
    crossed = test["t"] is not None and not math.isnan(test["t"]) and abs(test["t"]) >= crit
    half = crit * test["se"] if test["se"] else 0.0  # every seed agreeing exactly: a point
    return {
        "look": k,
        "n": n,
        "mean": test["mean"],
        "se": test["se"],
        "t": test["t"],
        "p_nominal": test["p"],
        "bound": design["nominal"][k],
        "critical_t": crit,
        "crossed": crossed,
        "repeated_ci": [test["mean"] - half, test["mean"] + half],
    }


def apply_rule(diffs: list[float], design: dict) -> dict:
    """The rule on a study's per-seed differences (in seed order): every look the seeds allow, up to the
    first crossing. ``decision``: 'efficacy' (crossed), 'max' (the last look passed without crossing) or
    'continue' (more seeds are due)."""
    looks = []
    for k, n in enumerate(design["looks"]):
        if len(diffs) < n:
            return {"looks": looks, "decision": "continue", "seeds": looks[-1]["n"] if looks else 0}
        looks.append(look(diffs, design, k))
        if looks[-1]["crossed"]:
            return {"looks": looks, "decision": "efficacy", "seeds": n}
    return {"looks": looks, "decision": "max", "seeds": design["looks"][-1]}


def operating(design: dict, standardized_effect: float, sims: int = 20_000, seed: int = 1) -> dict:
    """By simulation: the probability the design crosses (its type-I error at effect 0, its power
    otherwise) and the expected number of seeds, for per-seed differences of mean/sd
    ``standardized_effect``."""
    t = simulate_t(design["looks"], sims, shift=standardized_effect, seed=seed)
    first = first_crossing(t, design["critical_t"])
    seeds = np.where(first >= 0, np.asarray(design["looks"])[np.maximum(first, 0)], design["looks"][-1])
    return {"crossing": float((first >= 0).mean()), "expected_seeds": float(seeds.mean()), "sims": sims}
