"""The study's statistics on synthetic per-seed numbers: the t distributions against scipy, the paired
t-test's p-value, interval and power, and the sequential rule's type-I error and power by simulation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from goat_dist.evaluation.study import sequential, tdist
from goat_dist.evaluation.study.stats import paired_difference, paired_test, seeds_for_power, t_power

scipy_stats = pytest.importorskip("scipy.stats")  # in the test extra
from scipy.special import betainc as scipy_betainc  # noqa: E402


# ---- distributions -------------------------------------------------------------------------------
@pytest.mark.parametrize("df", [1, 2, 3, 7, 30, 250])
def test_t_distribution_matches_scipy(df):
    for t in [-60.0, -4.3, -2.0, -0.4, 0.0, 0.7, 2.0, 3.1, 12.0, 1e4]:
        assert tdist.t_cdf(t, df) == pytest.approx(scipy_stats.t.cdf(t, df), abs=1e-12, rel=1e-10)
        assert tdist.t_two_sided(t, df) == pytest.approx(2 * scipy_stats.t.sf(abs(t), df), rel=1e-9)
    for level in [0.5, 0.05, 0.01, 1e-4, 1e-9, 1e-40]:
        assert tdist.t_critical(level, df) == pytest.approx(scipy_stats.t.isf(level / 2, df), rel=1e-9)
    for p in [0.01, 0.3, 0.975]:
        assert tdist.t_ppf(p, df) == pytest.approx(scipy_stats.t.ppf(p, df), rel=1e-9)
    assert tdist.t_critical(0.0, df) == math.inf and tdist.t_two_sided(math.nan, df) == 1.0


def test_incomplete_beta_matches_scipy():
    for a, b in [(0.5, 0.5), (1.0, 0.5), (3.5, 0.5), (40.0, 2.0), (2.0, 60.0)]:
        for x in [1e-8, 0.01, 0.3, 0.5, 0.77, 0.999]:
            assert tdist.betainc(a, b, x) == pytest.approx(scipy_betainc(a, b, x), rel=1e-10, abs=1e-15)


@pytest.mark.parametrize("df", [1, 2, 4, 9, 40, 300])  # scipy: nan far in the tail at 400
def test_noncentral_t_matches_scipy(df):
    for nc in [0.0, 0.5, 1.32, 2.4, 5.0]:
        for t in [-4.3, -1.0, 0.0, 1.5, 2.26, 4.3, 30.0]:
            assert tdist.nct_cdf(t, df, nc) == pytest.approx(scipy_stats.nct.cdf(t, df, nc), abs=1e-9)


# ---- the paired t-test ---------------------------------------------------------------------------
def test_paired_test_matches_scipy_on_synthetic_seeds():
    rng = np.random.default_rng(3)
    for n in (2, 3, 5, 12):
        a = 4.6 + rng.normal(0, 0.08, n)  # seed scatter shared by both runs, plus each run's own
        b = a + rng.normal(-0.03, 0.04, n)
        seeds = [str(k) for k in range(n)]
        d = paired_difference(dict(zip(seeds, a)), dict(zip(seeds, b)), alpha=0.05)
        ref = scipy_stats.ttest_rel(a, b)
        assert d["t"] == pytest.approx(ref.statistic, rel=1e-9)
        assert d["p"] == pytest.approx(ref.pvalue, rel=1e-8)
        assert d["resolved"] == (ref.pvalue < 0.05)
        low, high = scipy_stats.t.interval(0.95, n - 1, loc=np.mean(a - b), scale=scipy_stats.sem(a - b))
        assert d["ci"] == pytest.approx([low, high], rel=1e-9)
        assert d["diffs"] == pytest.approx(list(a - b)) and d["seeds"] == seeds  # per-seed values kept
    ninety = paired_test([0.1, 0.3, -0.05, 0.2], alpha=0.1)
    low, high = scipy_stats.t.interval(0.9, 3, loc=0.1375, scale=scipy_stats.sem([0.1, 0.3, -0.05, 0.2]))
    assert ninety["ci"] == pytest.approx([low, high])  # the interval is 1 - alpha


def test_degenerate_seed_counts_and_scatter():
    one = paired_test([0.4])
    assert one["p"] is None and one["ci"] is None and not one["resolved"]
    same = paired_test([0.02, 0.02, 0.02], effect=0.065)  # every seed agrees exactly
    assert same["p"] == 0.0 and same["resolved"] and same["power"] == 1.0
    assert paired_test([0.0, 0.0, 0.0])["p"] == 1.0


def test_power_is_the_noncentral_t_and_reproduces_the_issue_figures():
    # the issue: paired SD 0.085 nats over seeds, the paper's effect 0.065 nats
    assert t_power(0.065, 0.085, 3) == pytest.approx(0.128, abs=0.001)  # "13 % power with 3 seeds"
    assert 2 * (1 - tdist.t_cdf(2.0, 2)) == pytest.approx(0.1835, abs=1e-4)  # "mean > 2 SE": 18 % at 2 df
    for n, sd, effect, alpha in [(3, 0.085, 0.065, 0.05), (10, 0.085, 0.065, 0.05), (6, 0.02, 0.01, 0.1)]:
        df, nc = n - 1, effect * math.sqrt(n) / sd
        crit = scipy_stats.t.isf(alpha / 2, df)
        exact = scipy_stats.nct.sf(crit, df, nc) + scipy_stats.nct.cdf(-crit, df, nc)
        assert t_power(effect, sd, n, alpha) == pytest.approx(exact, abs=1e-8)
    need = seeds_for_power(0.065, 0.085)
    assert need == 16 and t_power(0.065, 0.085, 15) < 0.8 <= t_power(0.065, 0.085, 16)
    row = paired_test([0.1, -0.05, 0.12, 0.02], effect=0.065)
    assert row["power"] == pytest.approx(t_power(0.065, row["sd"], 4))
    assert row["seeds_for_power"] == seeds_for_power(0.065, row["sd"])


def test_power_by_simulation_matches_the_closed_form():
    rng = np.random.default_rng(11)
    n, sd, effect, sims = 6, 0.085, 0.065, 2000
    hits = 0
    for _ in range(sims):
        shared = rng.normal(0, 0.1, n)  # the seed effect both runs share: pairing removes it
        a = 4.6 + shared + rng.normal(0, sd / math.sqrt(2), n)
        b = 4.6 - effect + shared + rng.normal(0, sd / math.sqrt(2), n)
        hits += paired_test(list(a - b))["resolved"]
    closed = t_power(effect, sd, n)
    assert abs(hits / sims - closed) < 3.5 * math.sqrt(closed * (1 - closed) / sims)


# ---- the sequential rule -------------------------------------------------------------------------
LOOKS = list(range(3, 11))  # configs/study/goat_vs_alibi.yaml


def simulate_studies(design: dict, shift: float, sims: int, seed: int) -> list[dict]:
    """Whole studies through the rule, seed by seed: a and b share each seed's offset."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(sims):
        n = design["looks"][-1]
        shared = rng.normal(0, 0.3, n)
        a = {str(k): 4.6 + shared[k] + rng.normal(0, 0.06) for k in range(n)}
        b = {str(k): 4.6 - shift + shared[k] + rng.normal(0, 0.06) for k in range(n)}
        out.append(sequential.apply_rule(paired_difference(a, b)["diffs"], design))
    return out


@pytest.mark.parametrize("kind", sequential.BOUNDARIES)
def test_sequential_rule_keeps_the_type_one_error_at_alpha(kind):
    design = sequential.make_design(LOOKS, 0.05, kind)
    assert design["null_crossing_simulated"] == pytest.approx(0.05, abs=0.001)
    studies = simulate_studies(design, 0.0, 2000, seed=7)  # independent of the calibration's draws
    rate = sum(s["decision"] == "efficacy" for s in studies) / len(studies)
    assert abs(rate - 0.05) < 0.015  # 3 standard errors of 2,000 studies
    assert all(s["decision"] in ("efficacy", "max") for s in studies)
    assert all(s["seeds"] == s["looks"][-1]["n"] for s in studies)  # stops at the crossing look
    levels = design["nominal"]
    if kind == "pocock":
        assert max(levels) == pytest.approx(min(levels)) and 0.01 < levels[0] < 0.02
    else:  # O'Brien-Fleming: strict early, near alpha at the last look
        assert levels == sorted(levels) and levels[0] < 1e-3 and 0.025 < levels[-1] < 0.05


def test_looking_at_every_seed_without_a_boundary_inflates_the_error():
    naive = {**sequential.make_design(LOOKS, 0.05), "nominal": [0.05] * len(LOOKS)}
    naive["critical_t"] = sequential.critical_values(LOOKS, naive["nominal"])
    rate = sequential.operating(naive, 0.0, sims=20_000)["crossing"]
    assert 0.14 < rate < 0.2  # why the boundary exists


def test_sequential_power_by_simulation_and_against_the_fixed_test():
    design = sequential.make_design(LOOKS, 0.05, "obrien-fleming")
    standardized = 0.065 / 0.085
    studies = simulate_studies(design, 0.065, 2000, seed=5)
    shared_sd = math.sqrt(2) * 0.06  # the per-seed differences' SD in simulate_studies
    studies_power = sum(s["decision"] == "efficacy" for s in studies) / len(studies)
    vectorised = sequential.operating(design, 0.065 / shared_sd, sims=20_000)
    assert abs(studies_power - vectorised["crossing"]) < 0.035  # two implementations of the rule agree
    op = sequential.operating(design, standardized, sims=20_000)
    fixed = t_power(0.065, 0.085, LOOKS[-1])  # the closed form at the most seeds the design uses
    assert fixed - 0.08 < op["crossing"] < fixed + 0.01  # O'Brien-Fleming keeps most of the fixed power
    assert op["expected_seeds"] < LOOKS[-1]
    assert sequential.operating(design, 0.0, sims=20_000)["crossing"] == pytest.approx(0.05, abs=0.006)


def test_calibrated_constants_approach_the_known_variance_tables():
    # Jennison & Turnbull, two-sided alpha 0.05, K = 2: Pocock C = 2.178, O'Brien-Fleming C = 1.977;
    # at 50 and 100 seeds the t statistics are nearly normal
    assert sequential.make_design([50, 100], 0.05, "pocock")["constant"] == pytest.approx(2.178, abs=0.02)
    assert sequential.make_design([50, 100], 0.05, "obrien-fleming")["constant"] == pytest.approx(
        1.977, abs=0.02
    )


def test_one_look_is_the_fixed_t_test_and_looks_are_checked():
    design = sequential.make_design([6], 0.05)
    assert design["critical_t"] == [pytest.approx(scipy_stats.t.isf(0.025, 5))]
    for bad in ([], [1, 3], [4, 4], [5, 3]):
        with pytest.raises(ValueError, match="looks"):
            sequential.make_design(bad, 0.05)
    with pytest.raises(ValueError, match="boundary"):
        sequential.make_design([3, 4], 0.05, "haybittle")


def test_a_look_reports_the_repeated_interval_and_needs_its_seeds():
    design = sequential.make_design(LOOKS, 0.05)
    diffs = [0.05, 0.07, 0.06, 0.055]
    first = sequential.look(diffs, design, 0)
    test = paired_test(diffs[:3])
    half = design["critical_t"][0] * test["se"]
    assert first["repeated_ci"] == pytest.approx([test["mean"] - half, test["mean"] + half])
    assert first["p_nominal"] == pytest.approx(test["p"]) and not first["crossed"]
    with pytest.raises(ValueError, match="needs 5 seeds"):
        sequential.look(diffs, design, 2)
    partial = sequential.apply_rule(diffs, design)
    assert partial["decision"] == "continue" and [k["n"] for k in partial["looks"]] == [3, 4]
    clear = sequential.apply_rule([0.06 + 1e-4 * k for k in range(10)], design)
    assert clear["decision"] == "efficacy" and clear["seeds"] == 3  # every seed agrees: the first look
    exact = sequential.apply_rule([0.06] * 10, design)  # no scatter at all: t is infinite
    assert exact["seeds"] == 3 and exact["looks"][0]["repeated_ci"] == pytest.approx([0.06, 0.06])


def test_the_figures_docs_study_md_prints():
    row = [round(100 * t_power(0.065, 0.085, n)) for n in (3, 4, 5, 6, 8, 10, 12, 16, 20)]
    assert row == [13, 19, 26, 33, 46, 58, 67, 82, 90]
    assert [seeds_for_power(0.065, sd) for sd in (0.05, 0.085, 0.12)] == [7, 16, 29]
    obf, pocock = (sequential.make_design(LOOKS, 0.05, kind) for kind in sequential.BOUNDARIES)
    assert obf["constant"] == pytest.approx(2.135, abs=0.002) and obf["critical_t"][-1] == pytest.approx(
        2.52, abs=0.01
    )
    assert pocock["constant"] == pytest.approx(2.519, abs=0.002) and pocock["nominal"][0] == pytest.approx(
        0.0118, abs=2e-4
    )
    op = sequential.operating(obf, 0.065 / 0.085, sims=100_000, seed=3)
    assert op["crossing"] == pytest.approx(0.527, abs=0.005) and op["expected_seeds"] == pytest.approx(
        9.04, abs=0.02
    )
