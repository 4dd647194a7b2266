"""`goat-dist study`: config checks, the table, and a two-run micro study end to end."""

from __future__ import annotations

import json
import sys

import pytest
import yaml
from multiproc import ROOT, run

from goat_dist.evaluation.study import StudyError, load_study, table


def test_shipped_study_config_loads():
    study = load_study(ROOT / "configs" / "study" / "extrapolation.yaml")
    assert sorted(study["runs"]) == ["alibi", "goat", "nope", "rope"]
    assert (
        study["train_config"] == ROOT / "configs" / "study" / "base.yaml" and study["train_config"].is_file()
    )
    assert study["eval"]["multiples"] == [1, 2, 4, 8]


@pytest.mark.parametrize(
    "spec,needle",
    [
        ({"runs": {}}, "'runs'"),
        ({"runs": {"a": "model.position=rope"}}, "runs.a"),
        ({"runs": {"a": []}, "evaluation": {}}, "unknown keys"),
        ({"runs": {"a": []}, "eval": {"lengths": [1]}}, "eval keys"),
    ],
)
def test_bad_study_configs_name_the_key(tmp_path, spec, needle):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(StudyError, match=needle):
        load_study(path)


def test_table_shows_every_multiple_and_the_extrapolated_block():
    def report(position, ppls):
        results = [
            {"length": 64 * m, "ppl": p, "loss_by_position": [{"loss": 1.0}] * (m - 1) + [{"loss": 2.0 * m}]}
            for m, p in zip((1, 2), ppls)
        ]
        return {"train_seq_len": 64, "position": position, "head_dim": 64, "non_embedding_params": 1234,
                "results": results}  # fmt: skip

    text = table({"goat": report("goat", [10.0, 11.5]), "rope": report("rope", [10.5, 40.25])}, [1, 2])
    assert "| 1x (64) | 2x (128) |" in text
    assert "| goat | goat | 64 | 1,234 | 10.00 | 11.50 |" in text
    assert "| rope | rope | 64 | 1,234 | 10.50 | 40.25 |" in text
    assert "2x: [64, 128)" in text and f"{2.718281828**4:.2f}" in text  # exp(loss of the last block)


@pytest.mark.slow
def test_micro_study_end_to_end(tmp_path, builtin_cache):
    out = tmp_path / "out"
    spec = {
        "name": "micro",
        "out": str(out),
        "train_config": str(ROOT / "configs" / "study" / "base.yaml"),
        "overrides": [
            "model.num_layers=1", "model.hidden_size=64", "train.max_steps=3", "train.eval_interval=3",
            "train.micro_batch_size=4", "train.global_batch_size=4", "train.warmup_steps=1", "log.interval=1",
            "log.prior_interval=3", f"data.cache_dir={builtin_cache}", "data.builtin_max_bytes=1000000",
        ],
        "runs": {"goat": ["model.position=goat"], "rope": ["model.position=rope"]},
        "eval": {"multiples": [1, 2], "tokens": 256, "split": "val", "batch_tokens": 1024},
    }  # fmt: skip
    config = tmp_path / "micro.yaml"
    config.write_text(yaml.safe_dump(spec))
    proc = run([sys.executable, "-m", "goat_dist", "study", str(config)], timeout=900)
    summary = json.loads((out / "study.json").read_text())
    assert sorted(summary["reports"]) == ["goat", "rope"]
    for name in ("goat", "rope"):
        report = summary["reports"][name]
        assert [r["length"] for r in report["results"]] == [64, 128] and report["position"] == name
        assert (out / name / "eval" / "ppl.json").is_file() and (out / name / "eval" / "ppl.png").is_file()
    md = (out / "study.md").read_text()
    assert "| goat | goat | 32 |" in md and "| rope | rope | 32 |" in md and "Protocol:" in md
    for png in ("study.png", "goat_prior_curves.png", "goat_log_prior.png"):
        assert (out / png).stat().st_size > 5000, png
    assert "1x (64)" in proc.stdout
    again = run([sys.executable, "-m", "goat_dist", "study", str(config)], timeout=900)
    assert again.stdout.count("reusing the finished run") == 2
