"""``run_study``: train, evaluate, and write the study's tables, JSON and pictures."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from .runs import load_now, run_dir, seed_label, train_all
from .spec import load_study
from .stats import RESOLVE_SE, aggregate, compare, metric_names, passkey_metrics, ppl_metrics
from .tables import passkey_markdown, ppl_markdown


def evaluate_one(study: dict, name: str, seed) -> tuple[dict, object]:
    """One (run, seed)'s report, written to its ``eval/``; also returns the model (prior pictures)."""
    import torch

    from ..reports import passkey_report, ppl_report, write_passkey, write_ppl
    from ..session import Session

    torch.set_num_threads(study["threads"])
    ev, where = study["eval"], run_dir(study, name, seed)
    t0, cpu0 = time.perf_counter(), time.process_time()
    session = Session(str(where), tp=None, backend=None, precision="auto")
    lengths = [m * session.loaded.cfg.seq_len for m in ev["multiples"]]
    if ev["task"] == "ppl":
        report = ppl_report(session, "builtin", ev["split"], lengths, ev["tokens"], ev["batch_tokens"])
        write_ppl(report, where / "eval", label=f"{name} seed {seed_label(seed)}")
    else:
        report = passkey_report(session, lengths, ev["depths"], ev["samples"], ev["seed"], ev["batch_tokens"])
        write_passkey(report, where / "eval")
    report["eval_s"] = time.perf_counter() - t0
    report["eval_cpu_s"] = time.process_time() - cpu0
    return report, session.model


def evaluate_all(study: dict) -> dict:
    """{run: {seed label: report}}; pictures of each GOAT run's learned prior (its first seed)."""
    reports: dict[str, dict] = {}
    for name in study["runs"]:
        reports[name] = {}
        for seed in study["seeds"]:
            report, model = evaluate_one(study, name, seed)
            reports[name][seed_label(seed)] = report
            if study["eval"]["task"] == "ppl":
                summary = ", ".join(f"{r['length']}: {r['loss']:.4f}" for r in report["results"])
            else:
                summary = ", ".join(
                    f"{n}: {sum(row) / len(row):.2f}" for n, row in zip(report["lengths"], report["accuracy"])
                )
            print(f"[study] {name} seed {seed_label(seed)}: {summary} ({report['eval_s']:.0f} s)", flush=True)
            if report["position"] == "goat" and seed == study["seeds"][0]:
                write_prior_pictures(model, study["out"], name)
    return reports


def write_prior_pictures(model, out: Path, name: str) -> None:
    """The learned prior of the GOAT run's middle layer, as the TensorBoard pictures show it."""
    from ...observe.figures import log_prior_figure, prior_curves_figure
    from ...observe.prior_snapshot import prior_snapshot
    from ..plots import write_png

    middle = len(model.blocks) // 2
    snap = prior_snapshot(model, [middle], None, step=0)
    curves, heads, L = snap["layers"][middle], snap["heads"], snap["train_len"]
    title = f"{name}, layer {middle}"
    write_png(prior_curves_figure(curves, heads, L, title), out / f"{name}_prior_curves.png")
    write_png(log_prior_figure(curves, heads, L, title), out / f"{name}_log_prior.png")


# ---- the whole study -----------------------------------------------------------------------------
def write_pictures(study: dict, reports: dict, per_seed: dict, train_len: int) -> list[Path]:
    from ..plots import passkey_grid_figure, study_figure, write_png

    out, ev = study["out"], study["eval"]
    lengths = [m * train_len for m in ev["multiples"]]
    seeds = len(study["seeds"])
    written = []
    if ev["task"] == "ppl":
        for stem, names in study["plots"].items():
            fig = study_figure(
                {n: per_seed[n] for n in names},
                lengths,
                train_len,
                f"{study['name']}: trained at {train_len} tokens, {seeds} seed(s), mean ± std",
            )
            written.append(write_png(fig, out / f"{stem}.png"))
        return written
    grids = {}
    for name in study["runs"]:
        stats = aggregate({name: per_seed[name]}, "grid")[name]
        depths = len(ev["depths"])
        grids[name] = [[s["mean"] for s in stats[i * depths : (i + 1) * depths]] for i in range(len(lengths))]
    title = f"{study['name']}: exact match, {ev['samples']} samples per cell, {seeds} seed(s)"
    fig = passkey_grid_figure(grids, lengths, ev["depths"], train_len, title)
    return [write_png(fig, out / "passkey_grid.png")]


def run_info(reports: dict) -> dict:
    """Per run: the description of its first seed's model (identical across seeds)."""
    return {name: next(iter(seeds.values())) for name, seeds in reports.items()}


def timing_lines(trained: dict, reports: dict, total: float, load_start: float, load_end: float) -> list[str]:
    """Wall and CPU minutes per run, and the load they were measured under."""
    per_run = []
    for name, seeds in trained["seconds"].items():
        trained_labels = [s for s, t in seeds.items() if t > 0]
        evals = [r["eval_s"] for r in reports[name].values()]
        eval_cpu = [r.get("eval_cpu_s", 0.0) for r in reports[name].values()]
        if trained_labels:
            wall = sum(seeds[s] for s in trained_labels) / len(trained_labels) / 60
            cpu = sum(trained["cpu_s"][name][s] for s in trained_labels) / len(trained_labels) / 60
            text = f"{name} train {wall:.1f} min wall / {cpu:.1f} min CPU per seed, "
        else:
            text = f"{name} reused, "
        per_run.append(
            text + f"eval {sum(evals) / len(evals):.0f} s wall / {sum(eval_cpu) / len(evals):.0f} s CPU"
        )
    loads = trained["loads"] or [load_start]
    cpu_total = sum(v for seeds in trained["cpu_s"].values() for v in seeds.values()) + sum(
        r.get("eval_cpu_s", 0.0) for seeds in reports.values() for r in seeds.values()
    )
    return [
        "Timing (per seed): " + "; ".join(per_run) + ".",
        f"Whole study {total / 60:.1f} min wall, {cpu_total / 60:.1f} min CPU (training processes and "
        f"evaluation); 1-minute load average {load_start:.1f} at the start, "
        f"{min(loads):.1f}-{max(loads):.1f} at the runs' starts, {load_end:.1f} at the end "
        f"({os.cpu_count()} CPUs).",
    ]


def run_study(config: str | Path, force: bool = False, quick: bool = False) -> int:
    from ...distributed import exit_process

    t_start, load_start = time.perf_counter(), load_now()
    study = load_study(config, quick=quick)
    trained = train_all(study, force)
    reports = evaluate_all(study)
    out, ev = study["out"], study["eval"]
    info = run_info(reports)
    train_len = next(iter(info.values()))["train_seq_len"]
    metrics = ppl_metrics if ev["task"] == "ppl" else passkey_metrics
    per_seed = {n: {s: metrics(r) for s, r in seeds.items()} for n, seeds in reports.items()}
    pictures = write_pictures(study, reports, per_seed, train_len)
    seeds = ", ".join(seed_label(s) for s in study["seeds"])
    if ev["task"] == "ppl":
        length_max = max(ev["multiples"]) * train_len
        body = ppl_markdown(study, per_seed, info, train_len, length_max)
        first = next(iter(info.values()))["protocol"]
        protocol = f"{first}; {ev['tokens']} tokens of '{ev['split']}' per length"
    else:
        body = passkey_markdown(study, per_seed, info, train_len)
        protocol = (
            f"{ev['samples']} samples per (length, depth) cell, depths {ev['depths']}, "
            f"sample seed {ev['seed']}"
        )
    total = time.perf_counter() - t_start
    md = [
        f"# Study: {study['name']}" + (" (--quick)" if quick else ""),
        "",
        study["description"].strip(),
        "",
        f"Training length L = {train_len}; seeds {seeds}. Cells: mean ± standard deviation over seeds. "
        f"Bold: the best mean; †: better than every other run by more than {RESOLVE_SE:g} standard errors of "
        f"the paired per-seed difference. ✓ in the paired tables: that difference is resolved.",
        "",
        *body,
        f"Protocol: {protocol}.",
        *timing_lines(trained, reports, total, load_start, load_now()),
    ]
    (out / "study.md").write_text("\n".join(md) + "\n")
    summary = {
        "study": study["name"],
        "quick": quick,
        "seeds": [seed_label(s) for s in study["seeds"]],
        "runs": study["runs"],
        "eval": ev,
        "resolve_rule": f"|mean paired difference| > {RESOLVE_SE:g} x its standard error, >= 2 seeds",
        "per_seed": per_seed,
        "aggregate": {m: aggregate(per_seed, m) for m in metric_names(per_seed)},
        "comparisons": [
            row
            for m in (("loss", "last_block") if ev["task"] == "ppl" else ("accuracy",))
            for row in compare(per_seed, m, study["compare"])
        ],
        "train_s": trained["seconds"],
        "train_cpu_s": trained["cpu_s"],
        "loads": {"start": load_start, "run_starts": trained["loads"], "end": load_now()},
        "total_s": total,
        "reports": reports,
    }
    (out / "study.json").write_text(json.dumps(summary, indent=1, default=str))
    print("\n".join(body))
    print(f"[study] wrote {out / 'study.md'}, {out / 'study.json'}, " + ", ".join(map(str, pictures)))
    print(f"[study] {total / 60:.1f} min")
    exit_process(0)
    return 0
