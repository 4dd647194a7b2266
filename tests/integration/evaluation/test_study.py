"""`goat-dist study`: config checks, seed statistics and the paired t-test on synthetic numbers, the
sequential seeds' run loop (in process, on synthetic reports), tables, pictures, the GOAT ablation
priors, and micro studies end to end (slow). The statistics themselves:
tests/unit/evaluation/test_study_stats.py."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
import yaml
from harness.multiproc import ROOT, run

from goat_dist.evaluation.study import StudyError, load_study
from goat_dist.evaluation.study import runs as study_runs
from goat_dist.evaluation.study import spec as study_spec
from goat_dist.evaluation.study import stats as study_stats
from goat_dist.evaluation.study import tables as study_tables

STUDY = ROOT / "configs" / "study"


# ---- the shipped study files ---------------------------------------------------------------------
def test_extrapolation_study_is_the_issue_design():
    study = load_study(STUDY / "extrapolation.yaml")
    assert list(study["runs"])[:4] == ["goat", "alibi", "rope", "nope"]
    assert {"goat-no-sink", "goat-no-spectral", "goat-slope-only"} <= set(study["runs"])
    assert len(study["seeds"]) >= 3 and study["eval"]["task"] == "ppl"
    assert study["eval"]["multiples"] == [1, 2, 4, 8, 16]
    base = yaml.safe_load(study["train_config"].read_text())
    model = base["model"]
    assert model["seq_len"] >= 256 and model["hidden_size"] // model["num_heads"] == 64
    assert study["runs"]["goat-no-sink"] == ["model.position=goat", "model.goat.abs_rank=0"]
    assert study["runs"]["goat-no-spectral"] == ["model.position=goat", "model.goat.pos_rank=0"]
    quick = load_study(STUDY / "extrapolation.yaml", quick=True)
    assert len(quick["seeds"]) == 1 and quick["out"] != study["out"]
    assert study["jobs"] * study["threads"] == 2  # the 2-core machine: two one-thread trainings
    assert quick["overrides"][: len(study["overrides"])] == study["overrides"]


def test_passkey_study_covers_every_scheme_over_three_seeds():
    study = load_study(STUDY / "passkey.yaml")
    assert sorted(study["runs"]) == ["alibi", "goat", "nope", "rope"]
    assert study["eval"]["task"] == "passkey" and study["eval"]["multiples"] == [1, 2, 4, 8]
    assert "data.synthetic=passkey" in study["overrides"]
    assert len(study["seeds"]) >= 3 and len(study["compare"]) == 6  # every pair at every length
    assert len(load_study(STUDY / "passkey.yaml", quick=True)["seeds"]) == 1


def test_goat_vs_alibi_study_decides_by_sequential_seeds():
    study = load_study(STUDY / "goat_vs_alibi.yaml")
    extrapolation = load_study(STUDY / "extrapolation.yaml")
    assert study["runs"] == {n: extrapolation["runs"][n] for n in ("goat", "alibi")}
    assert study["train_config"] == extrapolation["train_config"] and study["eval"] == extrapolation["eval"]
    # the extrapolation study's runs with the prior decayed as the authors' C4 script decays it
    assert study["overrides"] == [*extrapolation["overrides"], "train.prior_weight_decay=c4"]
    rule = study["sequential"]
    assert rule["min"] == 3 and rule["max"] >= 10 and rule["looks"] == list(range(3, rule["max"] + 1))
    assert study["seeds"] == list(range(1, rule["max"] + 1)) and rule["stop_when"] == "resolved"
    assert study["primary"] == {"a": "goat", "b": "alibi", "length": 1, "column": 0, "metric": "loss"}
    assert study["alpha"] == 0.05 and study["effect_size_nats"] == 0.065
    assert study["jobs"] * study["threads"] == 2 and study["jobs"] == len(study["runs"])  # a seed per round
    quick = load_study(STUDY / "goat_vs_alibi.yaml", quick=True)
    assert quick["sequential"]["max"] <= 3 and quick["out"] != study["out"]


def test_sequential_seeds_and_primary_parse(tmp_path):
    path = tmp_path / "s.yaml"
    spec = {"runs": {"a": [], "b": [], "c": []}, "compare": [["b", "c"]], "eval": {"multiples": [1, 4]},
            "seeds": {"min": 2, "max": 6, "first": 11, "looks": [2, 4, 6], "boundary": "pocock"},
            "primary": {"a": "a", "b": "c", "length": 4, "metric": "last_block"}, "alpha": 0.1}  # fmt: skip
    path.write_text(yaml.safe_dump(spec))
    study = load_study(path)
    assert study["seeds"] == [11, 12, 13, 14, 15, 16] and study["sequential"]["looks"] == [2, 4, 6]
    assert study["primary"]["column"] == 1 and study["primary"]["metric"] == "last_block"
    assert study["compare"] == [("a", "c"), ("b", "c")]  # the primary pair is always compared
    assert study["alpha"] == 0.1 and study["effect_size_nats"] == 0.065
    path.write_text(yaml.safe_dump({**spec, "seeds": {"max": 5}, "compare": [["c", "a"]]}))
    study = load_study(path)
    assert study["sequential"]["looks"] == [3, 4, 5] and study["sequential"]["boundary"] == "obrien-fleming"
    assert study["compare"] == [("c", "a")]
    unlisted = {k: v for k, v in spec.items() if k != "compare"}
    path.write_text(yaml.safe_dump({**unlisted, "primary": {"a": "c", "b": "a"}}))
    assert load_study(path)["compare"] == [("c", "a"), ("a", "b"), ("b", "c")]  # every pair, primary's first
    path.write_text(yaml.safe_dump({**spec, "seeds": [1, 2, 3]}))
    assert load_study(path)["sequential"] is None  # a list: the fixed design, as before


@pytest.mark.parametrize("name", ["extrapolation.yaml", "passkey.yaml", "goat_vs_alibi.yaml"])
def test_every_study_run_is_a_valid_training_config(name):
    from goat_dist.config import load_config

    study = load_study(STUDY / name)
    for run_name in study["runs"]:
        for seed in study["seeds"][:1]:
            cfg = load_config(str(study["train_config"]), study_runs.run_overrides(study, run_name, seed))
            assert cfg.train.seed == seed, run_name


@pytest.mark.parametrize(
    "spec,needle",
    [
        ({"runs": {}}, "'runs'"),
        ({"runs": {"a": "model.position=rope"}}, "runs.a"),
        ({"runs": {"a": ["model.position"]}}, "runs.a"),
        ({"runs": {"a b": []}}, "run name"),
        ({"runs": {"a": []}, "evaluation": {}}, "unknown keys"),
        ({"runs": {"a": []}, "eval": {"lengths": [1]}}, "eval keys"),
        ({"runs": {"a": []}, "eval": {"task": "nll"}}, "eval.task"),
        ({"runs": {"a": []}, "eval": {"multiples": [1, 0]}}, "eval.multiples"),
        ({"runs": {"a": []}, "eval": {"task": "passkey", "depths": [1.5]}}, "eval.depths"),
        ({"runs": {"a": []}, "seeds": []}, "'seeds'"),
        ({"runs": {"a": []}, "seeds": [1, 1]}, "'seeds'"),
        ({"runs": {"a": []}, "seeds": [1.5]}, "'seeds'"),
        ({"runs": {"a": [], "b": []}, "compare": [["a", "c"]]}, "compare"),
        ({"runs": {"a": []}, "plots": {"x": ["b"]}}, "plots.x"),
        ({"runs": {"a": []}, "plots": {"x/y": ["a"]}}, "plots.x/y"),
        ({"runs": {"a": []}, "jobs": 0}, "'jobs'"),
        ({"runs": {"a": []}, "threads": "2"}, "'threads'"),
        ({"runs": {"a": []}, "alpha": 0.7}, "'alpha'"),
        ({"runs": {"a": []}, "effect_size_nats": 0}, "'effect_size_nats'"),
        ({"runs": {"a": [], "b": []}, "primary": {"a": "a", "b": "a"}}, "primary.a"),
        ({"runs": {"a": [], "b": []}, "primary": {"a": "a", "b": "b", "length": 3}}, "primary.length"),
        (
            {"runs": {"a": [], "b": []}, "primary": {"a": "a", "b": "b", "metric": "accuracy"}},
            "primary.metric",
        ),
        ({"runs": {"a": [], "b": []}, "primary": ["a", "b"]}, "'primary'"),
        ({"runs": {"a": []}, "seeds": {"max": 5}}, "name it"),
        ({"runs": {"a": []}, "seeds": {"min": 3}}, "seeds.max"),
        ({"runs": {"a": []}, "seeds": {"min": 1, "max": 4}}, "2 <= min <= max"),
        ({"runs": {"a": []}, "seeds": {"max": 5, "stop_when": "never"}}, "stop_when"),
        ({"runs": {"a": []}, "seeds": {"max": 5, "boundary": "haybittle"}}, "seeds.boundary"),
        ({"runs": {"a": []}, "seeds": {"max": 5, "looks": [3, 4]}}, "seeds.looks"),
        ({"runs": {"a": []}, "seeds": {"max": 5, "looks": [4, 3, 5]}}, "seeds.looks"),
        ({"runs": {"a": []}, "seeds": {"max": 5, "every": 2}}, "unknown keys in 'seeds'"),
    ],
)
def test_bad_study_configs_name_the_key(tmp_path, spec, needle):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(StudyError, match=needle):
        load_study(path)


def test_quick_needs_its_section_and_checks_its_keys(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"runs": {"a": []}}))
    assert load_study(path)["seeds"] == [None]  # no seeds: the training config's own, one run each
    with pytest.raises(StudyError, match="'quick' section"):
        load_study(path, quick=True)
    path.write_text(yaml.safe_dump({"runs": {"a": []}, "quick": {"steps": 3}}))
    with pytest.raises(StudyError, match="unknown keys in 'quick'"):
        load_study(path, quick=True)
    quick_section = {"seeds": [7], "overrides": ["x.z=2"], "eval": {"tokens": 5}}
    spec = {"runs": {"a": []}, "seeds": [1, 2, 3], "overrides": ["x.y=1"], "out": "o",
            "eval": {"tokens": 999}, "quick": quick_section}  # fmt: skip
    path.write_text(yaml.safe_dump(spec))
    quick = load_study(path, quick=True)
    assert quick["seeds"] == [7] and quick["overrides"] == ["x.y=1", "x.z=2"]
    assert quick["eval"]["tokens"] == 5 and str(quick["out"]) == "o-quick"


def test_runs_per_seed_get_their_own_dirs_and_seed(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"runs": {"a": ["m.k=1"]}, "seeds": [4, 5], "out": str(tmp_path / "o")}))
    study = load_study(path)
    cmd = study_runs.train_command(study, "a", 5)
    assert "train.seed=5" in cmd and f"run.dir={tmp_path / 'o' / 'a' / 'seed5'}" in cmd
    assert cmd.index("m.k=1") < cmd.index("train.seed=5")
    assert study_runs.run_dir({**study, "seeds": [None]}, "a", None) == tmp_path / "o" / "a"


def test_reused_run_must_match_the_study(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"runs": {"a": ["m.k=1"]}, "seeds": [4], "out": str(tmp_path / "o")}))
    study = load_study(path)
    where = study_runs.run_dir(study, "a", 4)
    where.mkdir(parents=True)
    record = {"train_config": "None", "overrides": study_runs.run_overrides(study, "a", 4)}
    (where / study_spec.RECORD).write_text(json.dumps(record))
    study_runs.check_reusable(study, "a", 4)  # the same settings: fine
    changed = {**study, "runs": {"a": ["m.k=2"]}}
    with pytest.raises(StudyError, match="--force"):
        study_runs.check_reusable(changed, "a", 4)


# ---- statistics on synthetic numbers -------------------------------------------------------------
def test_seed_stats_mean_and_sample_std():
    s = study_stats.seed_stats([1.0, 2.0, 3.0, 6.0])
    assert s["mean"] == 3.0 and s["n"] == 4
    assert s["std"] == pytest.approx(math.sqrt((4 + 1 + 0 + 9) / 3))  # ddof 1
    assert study_stats.seed_stats([5.0])["std"] is None


def test_pairing_resolves_a_consistent_difference_hidden_in_seed_noise():
    # seeds move both runs a lot (spread 0.3), but b is 0.02 better on every seed, +-0.002
    a = {"1": 5.00, "2": 5.30, "3": 4.90, "4": 5.15}
    b = {"1": 4.98, "2": 5.282, "3": 4.878, "4": 5.131}
    d = study_stats.paired_difference(a, b)
    assert d["n"] == 4 and d["mean"] == pytest.approx(0.02, abs=1e-3)
    assert d["se"] < 0.002 and d["resolved"]
    # the unpaired spread alone would swallow it: the std of each run is 10x the difference
    assert study_stats.seed_stats(list(a.values()))["std"] > 0.15


def test_a_difference_within_two_standard_errors_is_not_resolved():
    a = {"1": 5.00, "2": 5.00, "3": 5.00}
    b = {"1": 4.99, "2": 5.02, "3": 4.98}  # diffs +0.01, -0.02, +0.02: mean 0.0033, se 0.0126
    d = study_stats.paired_difference(a, b)
    assert d["se"] == pytest.approx(math.sqrt(((0.01 - 1 / 300) ** 2 + (-0.02 - 1 / 300) ** 2
                                               + (0.02 - 1 / 300) ** 2) / 2 / 3))  # fmt: skip
    assert not d["resolved"]


def test_resolved_is_the_paired_t_test_at_alpha_not_two_standard_errors():
    # diffs 1, 2, 3: mean 2, se 1/sqrt(3): t = 3.46 > 2 (the old "2 SE" rule resolved it), but with 2 df
    # its two-sided p is 0.074: not resolved at alpha 0.05, resolved at 0.1
    a, zero = {"1": 1.0, "2": 2.0, "3": 3.0}, {"1": 0.0, "2": 0.0, "3": 0.0}
    d = study_stats.paired_difference(a, zero)
    assert d["t"] == pytest.approx(2 * math.sqrt(3)) and d["p"] == pytest.approx(0.0742, abs=1e-4)
    assert not d["resolved"] and study_stats.paired_difference(a, zero, alpha=0.1)["resolved"]


def test_one_seed_resolves_nothing_and_pairs_follow_seed_names():
    assert not study_stats.paired_difference({"1": 9.0}, {"1": 1.0})["resolved"]
    d = study_stats.paired_difference({"1": 1.0, "2": 2.0, "9": 7.0}, {"2": 1.0, "1": 0.0})
    assert d["seeds"] == ["1", "2"] and d["diffs"] == [1.0, 1.0] and d["resolved"]  # se 0, mean 1
    with pytest.raises(ValueError, match="no common seeds"):
        study_stats.paired_difference({"1": 1.0}, {"2": 1.0})


def synthetic_per_seed():
    """Three runs x 3 seeds, two columns: 'good' is 0.1 below 'mid' on every seed in column 0 only."""
    noise = {"1": 0.0, "2": 0.3, "3": -0.2}
    return {
        "good": {s: {"loss": [5.0 + n, 5.5 + n + j]} for (s, n), j in zip(noise.items(), (0.0, 0.2, -0.2))},
        "mid": {s: {"loss": [5.1 + n, 5.5 + n]} for s, n in noise.items()},
        "bad": {s: {"loss": [6.0 + n, 6.0 + n]} for s, n in noise.items()},
    }


def test_aggregate_and_compare_over_runs_and_columns():
    per_seed = synthetic_per_seed()
    agg = study_stats.aggregate(per_seed, "loss")
    assert agg["mid"][0]["mean"] == pytest.approx(5.1 + 0.1 / 3) and agg["mid"][0]["n"] == 3
    rows = study_stats.compare(per_seed, "loss", [("good", "mid"), ("mid", "bad")])
    assert [(r["a"], r["b"], r["column"]) for r in rows] == [
        ("good", "mid", 0), ("good", "mid", 1), ("mid", "bad", 0), ("mid", "bad", 1)]  # fmt: skip
    assert [r["resolved"] for r in rows] == [True, False, True, True]
    best = study_stats.best_resolved(per_seed, "loss", higher_better=False)
    assert best[0] == {"run": "good", "resolved": True}
    assert best[1]["resolved"] is False  # good and mid tie within noise in column 1


def test_tables_mark_the_best_and_the_resolved_differences():
    per_seed = synthetic_per_seed()
    info = {r: {"position": r, "head_dim": 64, "non_embedding_params": 1234} for r in per_seed}
    text = study_tables.summary_table(per_seed, "loss", ["1x (256)", "2x (512)"], info)
    assert "| run | position | head_dim | non-emb. params | 1x (256) | 2x (512) |" in text
    good = next(line for line in text.splitlines() if line.startswith("| good"))
    assert "**5.033 ± 0.252** †" in good and "| 1,234 |" in good
    assert text.count("†") == 1  # column 1: the best is not resolved against 'mid'
    tied = {"a": {"1": {"loss": [1.0]}}, "b": {"1": {"loss": [1.0001]}}, "c": {"1": {"loss": [2.0]}}}
    tied_text = study_tables.summary_table(tied, "loss", ["1x"], {r: info["good"] for r in tied}, digits=2)
    assert tied_text.count("**") == 4 and "**2.00**" not in tied_text  # a tie at the shown precision
    rows = study_stats.compare(per_seed, "loss", [("good", "mid"), ("mid", "bad")], 0.05, 0.065)
    pairs = study_tables.pairs_table(rows, ["1x", "2x"])
    assert study_tables.pairs_table([], ["1x"]) == "(no pairs to compare)"  # a study of one run
    assert "| a − b | length | mean | 95 % CI | p | SD | seeds | power at 0.065 | seeds for 80 % |" in pairs
    assert "| good − mid | 1x | −0.100 ✓ | [−0.100, −0.100] | < 0.0001 | 0.000 | 3 | 100 % | 2 |" in pairs
    good_2x = rows[1]  # diffs 0, +0.2, -0.2: mean 0, sd 0.2
    assert good_2x["p"] == pytest.approx(1.0) and good_2x["power"] == pytest.approx(
        study_stats.t_power(0.065, 0.2, 3)
    )
    line = (
        f"| good − mid | 2x | +0.000 | [−0.497, +0.497] | 1 | 0.200 | 3 | {100 * good_2x['power']:.0f} % | "
    )
    assert line + f"{study_stats.seeds_for_power(0.065, 0.2)} |" in pairs
    mid_bad = [line for line in pairs.splitlines() if line.startswith("| mid − bad")]
    assert len(mid_bad) == 2 and all("✓" in line for line in mid_bad)
    seeds = study_tables.seeds_table(per_seed, "loss", ["1x", "2x"])
    assert "| bad | 2 | 6.300 | 6.300 |" in seeds and seeds.count("\n") == 2 + 9 - 1


def test_ppl_and_passkey_metrics_from_reports():
    def result(m, losses):
        blocks = [{"start": 256 * k, "end": 256 * (k + 1), "loss": x} for k, x in enumerate(losses)]
        return {"length": 256 * m, "loss": sum(losses) / m, "loss_by_position": blocks}

    report = {"results": [result(1, [5.0]), result(2, [5.0, 5.2]), result(4, [5.0, 5.1, 5.2, 5.9])]}
    m = study_stats.ppl_metrics(report)
    assert m["loss"] == [5.0, 5.1, pytest.approx(5.3)] and m["last_block"] == [5.0, 5.2, 5.9]
    assert m["blocks"] == [5.0, 5.1, 5.2, 5.9]
    passkey = {"accuracy": [[1.0, 0.5], [0.0, 0.25]], "digit_accuracy": [[1.0, 1.0], [0.5, 0.3]]}
    p = study_stats.passkey_metrics(passkey)
    assert p["accuracy"] == [0.75, 0.125] and p["digit_accuracy"] == [1.0, 0.4]
    assert p["grid"] == [1.0, 0.5, 0.0, 0.25]


# ---- sequential seeds, in process on synthetic reports --------------------------------------------
def fake_ppl_report(loss: float, multiples=(1, 2)) -> dict:
    results = [{"length": 32 * m, "loss": loss, "loss_by_position": [{"loss": loss}] * m} for m in multiples]
    return {"results": results, "eval_s": 0.0}


def sequential_study(tmp_path, effect: float, noise: float, seed: int = 0):
    """A sequential study whose training and evaluation are replaced by synthetic losses: goat is
    ``effect`` lower than alibi on every seed, plus per-seed noise of SD ``noise``."""
    import numpy as np

    path = tmp_path / "s.yaml"
    spec = {"runs": {"goat": [], "alibi": []}, "seeds": {"min": 3, "max": 8}, "out": str(tmp_path / "o"),
            "primary": {"a": "goat", "b": "alibi", "length": 1}, "eval": {"multiples": [1, 2]}}  # fmt: skip
    path.write_text(yaml.safe_dump(spec))
    study = load_study(path)
    rng = np.random.default_rng(seed)
    shared = {s: 4.6 + rng.normal(0, 0.1) for s in study["seeds"]}
    own = {(r, s): rng.normal(0, noise) for r in study["runs"] for s in study["seeds"]}
    loss = {(r, s): shared[s] + own[(r, s)] - (effect if r == "goat" else 0.0) for (r, s) in own}
    batches = []

    def train_all(sub, force):
        batches.append(list(sub["seeds"]))
        zero = {r: {str(s): 1.0 for s in sub["seeds"]} for r in sub["runs"]}
        return {"seconds": zero, "cpu_s": zero, "loads": [0.5]}

    def evaluate_all(st, seeds=None):
        return {r: {str(s): fake_ppl_report(loss[(r, s)]) for s in seeds} for r in st["runs"]}

    return study, batches, train_all, evaluate_all


def test_sequential_study_stops_at_the_first_crossing(tmp_path, monkeypatch):
    from goat_dist.evaluation.study import main as study_main

    study, batches, train_all, evaluate_all = sequential_study(tmp_path, effect=0.1, noise=0.002)
    monkeypatch.setattr(study_main, "train_all", train_all)
    monkeypatch.setattr(study_main, "evaluate_all", evaluate_all)
    trained, reports, record = study_main.train_sequential(study, force=False)
    assert batches == [[1, 2, 3]] and record["decision"] == "efficacy" and record["seeds"] == 3
    assert sorted(reports["goat"]) == sorted(trained["seconds"]["alibi"]) == ["1", "2", "3"]
    assert record["looks"][0]["mean"] == pytest.approx(-0.1, abs=0.01) and record["looks"][0]["crossed"]
    used = {**study, "seeds": study["seeds"][:3]}
    per_seed = {r: {s: study_stats.ppl_metrics(x) for s, x in v.items()} for r, v in reports.items()}
    diffs = study_main.primary_diffs(used, reports)
    record["operating"] = study_main.operating_at_effect(used, record, diffs)
    assert record["operating"]["power"] > 0.99  # SD 0.003 against an effect of 0.065
    text = "\n".join(study_main.primary_section(used, per_seed, 32, record))
    assert "### Primary comparison: goat − alibi" in text and "1x (32)" in text
    assert "obrien-fleming boundary over looks at 3, 4, 5, 6, 7, 8 seeds" in text
    assert "Decision: crossed at 3 seeds: resolved, goat lower" in text and "| 1 | 3 | −0.099 |" in text


def test_sequential_study_without_a_difference_runs_every_look(tmp_path, monkeypatch):
    from goat_dist.evaluation.study import main as study_main

    study, batches, train_all, evaluate_all = sequential_study(tmp_path, effect=0.0, noise=0.05, seed=4)
    monkeypatch.setattr(study_main, "train_all", train_all)
    monkeypatch.setattr(study_main, "evaluate_all", evaluate_all)
    trained, reports, record = study_main.train_sequential(study, force=False)
    assert batches == [[1, 2, 3], [4], [5], [6], [7], [8]]  # seed by seed after the first look
    assert record["decision"] == "max" and [k["n"] for k in record["looks"]] == [3, 4, 5, 6, 7, 8]
    assert not any(k["crossed"] for k in record["looks"]) and len(reports["alibi"]) == 8
    text = "\n".join(study_tables.primary_markdown(study, {}, ["1x", "2x"], record))
    assert "Decision: not resolved after the last look (8 seeds)" in text


def test_fixed_design_primary_is_the_paired_test(tmp_path):
    per_seed = synthetic_per_seed()
    study = {"primary": {"a": "good", "b": "mid", "length": 1, "column": 0, "metric": "loss"},
             "compare": [], "alpha": 0.05, "effect_size_nats": 0.065, "effect_size_accuracy": 0.1,
             "seeds": [1, 2, 3], "eval": {"multiples": [1, 2]}}  # fmt: skip
    from goat_dist.evaluation.study import main as study_main

    text = "\n".join(study_main.primary_section(study, per_seed, 256, None))
    assert "Fixed design, 3 seeds: mean −0.100, 95 % CI [−0.100, −0.100], p = < 0.0001" in text
    assert "resolved; power at 0.065: 100 %" in text
    assert study_main.primary_section({**study, "seeds": [1]}, per_seed, 256, None) == []


# ---- pictures ------------------------------------------------------------------------------------
def test_study_figure_draws_error_bars_of_the_seed_spread(tmp_path):
    from matplotlib.container import ErrorbarContainer

    from goat_dist.evaluation.plots import study_figure, write_png

    per_seed = {
        run: {s: {"loss": [5.0 + d, 5.1 + d], "last_block": [5.0 + d, 5.3 + d], "blocks": [5.0 + d, 5.3]}
              for s, d in (("1", 0.0), ("2", 0.2), ("3", 0.4))}
        for run in ("goat", "alibi")
    }  # fmt: skip
    fig = study_figure(per_seed, [256, 512], 256, "t")
    for ax in fig.axes:
        bars = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
        assert len(bars) == 2
        segments = bars[0].lines[2][0].get_segments()
        heights = [seg[1][1] - seg[0][1] for seg in segments]
        assert heights[0] == pytest.approx(2 * 0.2)  # +- the std of (0, 0.2, 0.4)
    assert write_png(fig, tmp_path / "s.png").stat().st_size > 5000


def test_passkey_grid_figure_has_one_heatmap_per_run(tmp_path):
    from goat_dist.evaluation.plots import passkey_grid_figure, write_png

    grids = {r: [[1.0, 0.5], [0.25, 0.0], [0.0, 0.0]] for r in ("goat", "alibi", "rope", "nope")}
    fig = passkey_grid_figure(grids, [64, 128, 256], [0.1, 0.9], 64, "t")
    heatmaps = [ax for ax in fig.axes if ax.images]
    assert [ax.get_title() for ax in heatmaps] == ["goat", "alibi", "rope", "nope"]
    assert heatmaps[0].images[0].get_array().shape == (2, 3)  # depths x lengths
    assert write_png(fig, tmp_path / "p.png").stat().st_size > 5000


def test_passkey_heatmaps_show_the_mean_and_the_seed_spread(tmp_path):
    from goat_dist.evaluation.plots import write_png
    from goat_dist.evaluation.study.figures import passkey_spread_figure

    grids = {"1": [1.0, 0.5, 0.2, 0.0], "2": [1.0, 0.7, 0.4, 0.0], "3": [1.0, 0.9, 0.0, 0.2]}  # 2 x 2 cells
    per_seed = {r: {s: {"grid": g} for s, g in grids.items()} for r in ("goat", "alibi")}
    fig = passkey_spread_figure(per_seed, [64, 128], [0.1, 0.9], 64, "t")
    heatmaps = [ax for ax in fig.axes if ax.images]
    assert [ax.get_title() for ax in heatmaps] == ["goat", "alibi"]
    image = heatmaps[0].images[0].get_array()
    assert image.shape == (2, 2) and image[1, 0] == pytest.approx(0.7)  # depth 0.9 at 64: mean of .5 .7 .9
    texts = {t.get_text() for t in heatmaps[0].texts}
    assert "0.70±0.20\n0.50-0.90" in texts and "1.00±0.00\n1.00-1.00" in texts
    assert "mean ± std, min-max" in fig._suptitle.get_text()
    one = passkey_spread_figure({"goat": {"1": {"grid": grids["1"]}}}, [64, 128], [0.1, 0.9], 64, "t")
    assert "0.50" in {t.get_text() for t in one.axes[0].texts}  # one seed: no spread to show
    assert write_png(fig, tmp_path / "p.png").stat().st_size > 5000


# ---- the ablation's priors -----------------------------------------------------------------------
@pytest.mark.parametrize("pos_rank,abs_rank", [(4, 0), (0, 4), (0, 0)])
def test_ablated_priors_have_only_their_parts_and_lanes_match_the_matrix(pos_rank, abs_rank):
    from goat_dist.goat.prior import GoatPrior

    torch.manual_seed(0)
    prior = GoatPrior(2, pos_rank=pos_rank, abs_rank=abs_rank, training_seq_len=64)
    names = {n for n, _ in prior.named_parameters()}
    assert any(n.startswith("sink_mlp.") for n in names) == (abs_rank > 0)
    assert ("sink_gain" in names) == (abs_rank > 0)
    assert ("lambda_sym" in names) == ("lambda_asym" in names) == (pos_rank > 0)  # no empty parameters
    assert {"sink_bump", "recency_slope_raw"} <= names and prior.num_lanes == 2 * pos_rank + 3
    with torch.no_grad():
        prior.sink_bump.fill_(0.7)
        if pos_rank:
            prior.lambda_sym.normal_()
    pos = torch.arange(40)[None]
    u = prior.sink(pos, causal=True)[0]  # (L, H)
    if abs_rank == 0:  # bump at token 0 plus the recency slope: nothing else
        slope = torch.nn.functional.softplus(prior.recency_slope_raw)
        expected = 0.7 * (pos[0] == 0)[:, None] + slope * pos[0][:, None]
        offset = u - expected  # the recency is measured from the sequence's origin: a per-head constant
        assert torch.allclose(offset, offset[:1].expand_as(offset), atol=1e-5)
    scale = 1 / math.sqrt(64 - prior.num_lanes)
    q, k = prior.lanes(pos, True, scale=scale)
    folded = scale * torch.einsum("blhd,bmhd->bhlm", q.double(), k.double())
    K = prior.log_prior(pos, True).double()
    diff = folded - K  # equal up to a per-row constant
    assert torch.allclose(diff, diff[..., :1].expand_as(diff), atol=1e-4)


def test_ablated_goat_models_build_train_and_every_prior_parameter_learns(world1):
    """The study's ablation overrides build models whose every prior parameter gets a gradient (a dead
    parameter would be a silent no-op in the ablation)."""
    from goat_dist.config import load_config
    from goat_dist.model import GPT

    study = load_study(STUDY / "extrapolation.yaml")
    lanes = {}
    for name in ("goat", "goat-no-sink", "goat-no-spectral", "goat-slope-only"):
        small = ["model.num_layers=1", "model.vocab_size=128", "model.seq_len=32"]
        cfg = load_config(str(study["train_config"]), [*study_runs.run_overrides(study, name, 1), *small])
        torch.manual_seed(0)
        model = GPT(cfg.model)
        tokens = torch.randint(0, 128, (2, 33))
        logits = model(tokens[:, :-1], torch.arange(32).expand(2, -1))
        logits[..., :128].logsumexp(-1).mean().backward()
        prior = {n: p for n, p in model.named_parameters() if ".prior." in n}
        assert prior and all(p.grad is not None and p.numel() for p in prior.values()), name
        has_mlp = any(".sink_mlp." in n for n in prior)
        assert has_mlp == (name in ("goat", "goat-no-spectral")), name
        lanes[name] = model.blocks[0].attn.prior.num_lanes
    assert lanes == {"goat": 11, "goat-no-sink": 11, "goat-no-spectral": 3, "goat-slope-only": 3}


# ---- end to end (trains) -------------------------------------------------------------------------
MICRO = [
    "model.num_layers=1", "model.hidden_size=64", "model.num_heads=1", "model.seq_len=32",
    "train.max_steps=2", "train.eval_interval=0", "train.micro_batch_size=2", "train.global_batch_size=2",
    "train.warmup_steps=1",
    "log.interval=1", "log.prior_interval=0", "log.tensorboard=false",
]  # fmt: skip


@pytest.mark.slow
def test_micro_study_with_sequential_seeds_end_to_end(tmp_path, builtin_cache):
    out = tmp_path / "out"
    spec = {
        "name": "micro",
        "out": str(out),
        "train_config": str(STUDY / "base.yaml"),
        "overrides": [*MICRO, f"data.cache_dir={builtin_cache}", "data.builtin_max_bytes=1000000",
                      "model.vocab_size=4096"],
        "seeds": {"min": 2, "max": 3},  # looks at 2 and 3 seeds: stops at 2 only if the boundary is crossed
        "primary": {"a": "goat", "b": "rope", "length": 1},
        "jobs": 2,  # two trainings at once, one thread each, logs in <run_dir>/train.log
        "threads": 1,
        "runs": {"goat": ["model.position=goat"], "rope": ["model.position=rope"]},
        "eval": {"multiples": [1, 2], "tokens": 128, "split": "val", "batch_tokens": 256},
    }  # fmt: skip
    config = tmp_path / "micro.yaml"
    config.write_text(yaml.safe_dump(spec))
    proc = run([sys.executable, "-m", "goat_dist", "study", str(config)], timeout=900)
    summary = json.loads((out / "study.json").read_text())
    record, seeds = summary["sequential"], summary["seeds"]
    assert summary["planned_seeds"] == ["1", "2", "3"] and seeds == summary["planned_seeds"][: len(seeds)]
    assert record["seeds"] == len(seeds) and [k["n"] for k in record["looks"]] == [2, 3][: len(seeds) - 1]
    assert record["decision"] == ("efficacy" if record["looks"][-1]["crossed"] else "max")
    assert record["design"]["looks"] == [2, 3] and "look 1/2 at 2 seeds" in proc.stdout
    assert sorted(summary["reports"]) == ["goat", "rope"]
    assert (
        sorted(summary["reports"]["goat"]) == seeds and not (out / "goat" / f"seed{len(seeds) + 1}").exists()
    )
    for name in ("goat", "rope"):
        for seed in seeds:
            report = summary["reports"][name][seed]
            assert [r["length"] for r in report["results"]] == [32, 64] and report["position"] == name
            assert len(list((out / name / f"seed{seed}" / "eval").glob("ppl_builtin-stdlib-*_val.json"))) == 1
            assert "done: 2 steps" in (out / name / f"seed{seed}" / "train.log").read_text()
            assert summary["train_cpu_s"][name][seed] > 0
        stats = summary["aggregate"]["loss"][name]
        assert len(stats) == 2 and stats[0]["n"] == len(seeds) and stats[0]["std"] > 0  # seeds differ
    assert {(c["a"], c["b"], c["metric"]) for c in summary["comparisons"]} == {
        ("goat", "rope", "loss"), ("goat", "rope", "last_block")}  # fmt: skip
    md = (out / "study.md").read_text()
    assert (
        "| goat | goat | 64 |" in md
        and " ± " in md
        and "| goat − rope | 1x (32) |" in md
        and "Protocol:" in md
    )
    assert "### Primary comparison: goat − rope" in md and "Decision: " in md
    assert "| rope | 2 |" in md and "load average" in md
    assert (out / "study.png").stat().st_size > 5000 and "1x (32)" in proc.stdout
    again = run([sys.executable, "-m", "goat_dist", "study", str(config)], timeout=900)
    assert again.stdout.count("reusing the finished run") == 2 * len(seeds)
    assert json.loads((out / "study.json").read_text())["seeds"] == seeds  # the same data, the same stop


@pytest.mark.slow
def test_quick_passkey_study_end_to_end(tmp_path):
    out = tmp_path / "out"
    spec = {
        "name": "micro-passkey",
        "out": str(out),
        "train_config": str(STUDY / "base.yaml"),
        "overrides": [*MICRO, "data.synthetic=passkey", "model.vocab_size=64", f"data.cache_dir={tmp_path}"],
        "seeds": [1, 2, 3],
        "runs": {"goat": ["model.position=goat"], "nope": ["model.position=none"]},
        "eval": {"task": "passkey", "multiples": [1, 2], "depths": [0.2, 0.8], "samples": 2},
        "quick": {"seeds": [5]},
    }
    config = tmp_path / "pk.yaml"
    config.write_text(yaml.safe_dump(spec))
    run([sys.executable, "-m", "goat_dist", "study", str(config), "--quick"], timeout=900)
    quick = tmp_path / "out-quick"
    summary = json.loads((quick / "study.json").read_text())
    assert summary["quick"] and summary["seeds"] == ["5"] and not out.exists()
    report = summary["reports"]["goat"]["5"]
    assert report["lengths"] == [32, 64] and report["depths"] == [0.2, 0.8] and report["trained_on_passkey"]
    assert (quick / "goat" / "seed5" / "eval" / "passkey.json").is_file()
    assert (quick / "passkey_grid.png").stat().st_size > 5000
    md = (quick / "study.md").read_text()
    assert "(--quick)" in md and "exact-match" in md and "| nope | none | 64 |" in md
