"""Student t and noncentral t in closed form (``math`` and ``numpy`` only): the study's tests and power
need them, and scipy is not a runtime dependency. Tested against scipy
(tests/unit/evaluation/test_study_stats.py)."""

from __future__ import annotations

import functools
import math

import numpy as np


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        m2 = 2 * m
        for num in (
            m * (b - m) * x / ((qam + m2) * (a + m2)),
            -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2)),
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_fraction(b, a, 1.0 - x) / b


def t_two_sided(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with ``df`` degrees of freedom; 1 for nan (0 / 0)."""
    if math.isnan(t):
        return 1.0
    if math.isinf(t):
        return 0.0
    return betainc(df / 2.0, 0.5, df / (df + t * t))


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t."""
    half = 0.5 * t_two_sided(t, df)
    return 1.0 - half if t > 0 else half


@functools.lru_cache(maxsize=4096)
def t_critical(level: float, df: float) -> float:
    """|t| with P(|T| >= |t|) = ``level`` (two-sided), by bisection on the tail itself so that a level of
    1e-100 is as exact as 0.05; inf where the level underflows."""
    if not 0.0 <= level <= 1.0:
        raise ValueError(f"t_critical: level must lie in [0, 1], got {level}")
    if level < 1e-280:
        return math.inf
    if level == 1.0:
        return 0.0
    lo, hi = 0.0, 1.0
    while t_two_sided(hi, df) > level:
        lo, hi = hi, 2.0 * hi
    for _ in range(400):
        mid = 0.5 * (lo + hi)
        if t_two_sided(mid, df) > level:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * hi:
            break
    return 0.5 * (lo + hi)


def t_ppf(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"t_ppf: p must lie in (0, 1), got {p}")
    return math.copysign(t_critical(2.0 * min(p, 1.0 - p), df), p - 0.5)


def norm_two_sided(z: float) -> float:
    """P(|Z| >= z) for the standard normal, exact far into the tail."""
    return math.erfc(abs(z) / math.sqrt(2.0))


def norm_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


_erfc = np.vectorize(math.erfc, otypes=[float])


def nct_cdf(t: float, df: float, nc: float) -> float:
    """P(T <= t) for the noncentral t, T = (Z + nc) / S with S = sqrt(chi2_df / df): the integral of
    Phi(t s - nc) over the density of S (Simpson's rule; the density is smooth and, on the range used,
    holds all but ~1e-20 of the mass; the step resolves Phi's rise, 1 / |t| wide in s)."""
    width = 10.0 / math.sqrt(df)
    lo, hi = max(0.0, 1.0 - width), 1.0 + width + (8.0 if df < 4 else 0.0)
    points = max(4001, 2 * int(abs(t) * (hi - lo) / 0.05) + 1)
    s = np.linspace(lo, hi, points)
    s[0] = max(s[0], 1e-300)
    log_density = (
        math.log(2.0)
        + (df / 2.0) * math.log(df / 2.0)
        - math.lgamma(df / 2.0)
        + (df - 1.0) * np.log(s)
        - df * s * s / 2.0
    )
    phi = 0.5 * _erfc(-(t * s - nc) / math.sqrt(2.0))
    f = np.exp(log_density) * phi
    weights = np.ones(points)
    weights[1:-1:2], weights[2:-1:2] = 4.0, 2.0
    return float(min(1.0, max(0.0, (s[1] - s[0]) / 3.0 * float(weights @ f))))
