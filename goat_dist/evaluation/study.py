"""``goat-dist study <config>``: train several position schemes identically, evaluate each at multiples
of the training length, and write one table and one plot.

Why one command: the claim under test (a learned prior extrapolates; RoPE does not) is a comparison, and
a comparison is only fair when every run shares the config, data, seed and evaluation protocol. The
study config names a training config, overrides shared by all runs, one override list per run, and
the evaluation (multiples of the training length, token budget, split):

    out: runs/study-extrapolation       # relative to the working directory
    train_config: base.yaml             # relative to the study config
    overrides: []
    runs: {goat: [model.position=goat], rope: [model.position=rope], ...}
    eval: {multiples: [1, 2, 4, 8], tokens: 16384, split: val, batch_tokens: 8192}

Each run trains in its own ``goat-dist train`` process into ``<out>/<name>`` (a finished run is reused,
an interrupted one resumes; ``--force`` retrains). Evaluation then runs in this process (TP = 1) and
writes ``<out>/<name>/eval/ppl.{json,png}``; the study writes ``<out>/study.{json,md,png}`` and, for a
GOAT run, pictures of its learned prior.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

KEYS = {"name", "out", "train_config", "overrides", "runs", "eval", "description"}
EVAL_DEFAULTS = {"multiples": [1, 2, 4, 8], "tokens": 16384, "split": "val", "batch_tokens": 8192}


class StudyError(ValueError):
    """The study config is malformed; the message names the key."""


def load_study(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise StudyError(f"study config not found: {path}")
    spec = yaml.safe_load(path.read_text()) or {}
    unknown = set(spec) - KEYS
    if unknown:
        raise StudyError(f"{path}: unknown keys {sorted(unknown)} (known: {sorted(KEYS)})")
    if not isinstance(spec.get("runs"), dict) or not spec["runs"]:
        raise StudyError(f"{path}: 'runs' must map run names to lists of overrides")
    for name, overrides in spec["runs"].items():
        if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
            raise StudyError(f"{path}: runs.{name} must be a list of 'section.key=value' strings")
    evaluation = {**EVAL_DEFAULTS, **(spec.get("eval") or {})}
    if set(evaluation) != set(EVAL_DEFAULTS):
        raise StudyError(f"{path}: eval keys are {sorted(EVAL_DEFAULTS)}, got {sorted(evaluation)}")
    train_config = spec.get("train_config")
    return {
        "name": spec.get("name", path.stem),
        "description": spec.get("description", ""),
        "out": Path(spec.get("out", f"runs/study-{path.stem}")),
        "train_config": (path.parent / train_config).resolve() if train_config else None,
        "overrides": list(spec.get("overrides") or []),
        "runs": spec["runs"],
        "eval": evaluation,
    }


def finished(run_dir: Path) -> bool:
    """The run's last process ended normally (``last_exit.json``) and left a checkpoint."""
    try:
        record = json.loads((run_dir / "last_exit.json").read_text())
    except (OSError, ValueError):
        return False
    return record.get("status") == "finished" and (run_dir / "checkpoints" / "latest").is_file()


def train_command(study: dict, name: str) -> list[str]:
    config = ["--config", str(study["train_config"])] if study["train_config"] else []
    run_dir = study["out"] / name
    overrides = [*study["overrides"], *study["runs"][name], f"run.dir={run_dir}", f"run.name={name}"]
    return [sys.executable, "-m", "goat_dist", "train", *config, *overrides]


def train_all(study: dict, force: bool) -> dict[str, float]:
    """Train every run that has not finished; seconds per run (0 for reused runs)."""
    from ..launcher import child_env

    seconds = {}
    for name in study["runs"]:
        run_dir = study["out"] / name
        if force and run_dir.exists():
            shutil.rmtree(run_dir)
        if finished(run_dir):
            print(f"[study] {name}: reusing the finished run in {run_dir}", flush=True)
            seconds[name] = 0.0
            continue
        print(f"[study] {name}: training -> {run_dir}", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(train_command(study, name), env=child_env())
        if proc.returncode != 0:
            raise RuntimeError(f"study run {name} failed (exit {proc.returncode}); see its output above")
        seconds[name] = time.perf_counter() - t0
    return seconds


def table(reports: dict[str, dict], multiples: list[int]) -> str:
    """Markdown: perplexity at each multiple of the training length, then at the extrapolated positions."""
    any_report = next(iter(reports.values()))
    L = any_report["train_seq_len"]
    head = " | ".join(f"{m}x ({m * L})" for m in multiples)
    lines = [
        f"| run | position | head_dim | non-emb. params | {head} |",
        "|---|---|---|---|" + "---|" * len(multiples),
    ]
    for name, r in reports.items():
        cells = " | ".join(f"{x['ppl']:.2f}" for x in r["results"])
        lines.append(
            f"| {name} | {r['position']} | {r['head_dim']} | {r['non_embedding_params']:,} | {cells} |"
        )
    lines += [
        "",
        f"Perplexity on positions [(m-1)L, mL) only, inside windows of m x L (L = {L}): "
        "the extrapolated part.",
        "",
        "| run | " + " | ".join(f"{m}x: [{(m - 1) * L}, {m * L})" for m in multiples) + " |",
        "|---|" + "---|" * len(multiples),
    ]
    for name, r in reports.items():
        cells = " | ".join(
            f"{math.exp(min(x['loss_by_position'][-1]['loss'], 700)):.2f}" for x in r["results"]
        )
        lines.append(f"| {name} | {cells} |")
    return "\n".join(lines)


def evaluate_all(study: dict) -> dict[str, dict]:
    from .reports import ppl_report, write_ppl
    from .session import Session

    reports = {}
    ev = study["eval"]
    for name in study["runs"]:
        run_dir = study["out"] / name
        t0 = time.perf_counter()
        session = Session(str(run_dir), tp=None, backend=None, precision="auto")
        lengths = [m * session.loaded.cfg.seq_len for m in ev["multiples"]]
        report = ppl_report(session, "builtin", ev["split"], lengths, ev["tokens"], ev["batch_tokens"])
        report["eval_s"] = time.perf_counter() - t0
        write_ppl(report, run_dir / "eval", label=name)
        reports[name] = report
        print(
            f"[study] {name}: " + ", ".join(f"{r['length']}: {r['ppl']:.2f}" for r in report["results"]),
            flush=True,
        )
        if report["position"] == "goat":
            write_prior_pictures(session.model, study["out"], name)
    return reports


def write_prior_pictures(model, out: Path, name: str) -> None:
    """The learned prior of the GOAT run's middle layer, as the TensorBoard pictures show it."""
    from ..observe.figures import log_prior_figure, prior_curves_figure, save_png
    from ..observe.prior_snapshot import prior_snapshot

    middle = len(model.blocks) // 2
    snap = prior_snapshot(model, [middle], None, step=0)
    curves, heads, L = snap["layers"][middle], snap["heads"], snap["train_len"]
    title = f"{name}, layer {middle}"
    save_png(prior_curves_figure(curves, heads, L, title), out / f"{name}_prior_curves.png")
    save_png(log_prior_figure(curves, heads, L, title), out / f"{name}_log_prior.png")


def run_study(config: str | Path, force: bool = False) -> int:
    from ..distributed import exit_process
    from .plots import ppl_figure, write_png

    t_start = time.perf_counter()
    study = load_study(config)
    train_s = train_all(study, force)
    reports = evaluate_all(study)
    out = study["out"]
    L = next(iter(reports.values()))["train_seq_len"]
    write_png(
        ppl_figure(
            {n: r["results"] for n, r in reports.items()}, L, f"{study['name']}: trained at {L} tokens"
        ),
        out / "study.png",
    )
    text = table(reports, study["eval"]["multiples"])
    total = time.perf_counter() - t_start
    timing = ", ".join(f"{n} {s / 60:.1f} min" for n, s in train_s.items())
    md = [
        f"# Study: {study['name']}",
        "",
        study["description"].strip(),
        "",
        text,
        "",
        f"Protocol: {next(iter(reports.values()))['protocol']}; {study['eval']['tokens']} tokens of the "
        f"'{study['eval']['split']}' split at every length.",
        f"Training time: {timing}; whole study {total / 60:.1f} min.",
    ]
    (out / "study.md").write_text("\n".join(md) + "\n")
    summary = {"study": study["name"], "train_s": train_s, "total_s": total, "reports": reports}
    (out / "study.json").write_text(json.dumps(summary, indent=1, default=str))
    print(text)
    print(
        f"[study] wrote {out / 'study.md'}, {out / 'study.json'}, {out / 'study.png'} ({total / 60:.1f} min)"
    )
    exit_process(0)
    return 0
