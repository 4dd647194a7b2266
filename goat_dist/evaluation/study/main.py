"""``run_study``: train, evaluate, and write the study's tables, JSON and pictures; with sequential seeds,
train seed by seed and stop when the primary comparison crosses its boundary."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ...atomic import atomic_write_text
from .runs import load_now, run_dir, seed_label, train_all
from .spec import load_study
from .stats import aggregate, effect_for, metric_names, passkey_metrics, ppl_metrics, seed_stats
from .tables import passkey_markdown, ppl_markdown, primary_markdown, study_compare


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


def evaluate_all(study: dict, seeds: list | None = None) -> dict:
    """{run: {seed label: report}} of ``seeds`` (default: all the study's); pictures of each GOAT run's
    learned prior (the study's first seed)."""
    reports: dict[str, dict] = {}
    for name in study["runs"]:
        reports[name] = {}
        for seed in study["seeds"] if seeds is None else seeds:
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
def primary_diffs(study: dict, reports: dict) -> list[float]:
    """The primary comparison's per-seed differences a - b, in seed order, over the seeds evaluated."""
    pr = study["primary"]
    metrics = ppl_metrics if study["eval"]["task"] == "ppl" else passkey_metrics
    diffs = []
    for seed in study["seeds"]:
        label = seed_label(seed)
        if label not in reports[pr["a"]] or label not in reports[pr["b"]]:
            break
        a, b = (metrics(reports[r][label])[pr["metric"]][pr["column"]] for r in (pr["a"], pr["b"]))
        diffs.append(a - b)
    return diffs


def train_sequential(study: dict, force: bool) -> tuple[dict, dict, dict]:
    """Train and evaluate seed by seed up to each look; after each look apply the stopping rule to the
    primary comparison and stop at the first crossing (or after the last look). The boundary depends on
    the study file only; the seeds after a stop are never trained."""
    from .sequential import apply_rule, make_design

    rule = study["sequential"]
    design = make_design(rule["looks"], study["alpha"], rule["boundary"])
    trained: dict = {"seconds": {n: {} for n in study["runs"]}, "cpu_s": {n: {} for n in study["runs"]}}
    trained["loads"] = []
    reports: dict = {name: {} for name in study["runs"]}
    done, result = 0, None
    for k, n in enumerate(design["looks"]):
        batch = study["seeds"][done:n]
        part = train_all({**study, "seeds": batch}, force)
        for key in ("seconds", "cpu_s"):
            for name, values in part[key].items():
                trained[key][name].update(values)
        trained["loads"] += part["loads"]
        for name, seeds in evaluate_all(study, batch).items():
            reports[name].update(seeds)
        done = n
        result = apply_rule(primary_diffs(study, reports), design)
        last = result["looks"][-1]
        print(
            f"[study] look {k + 1}/{len(design['looks'])} at {n} seeds: {study['primary']['a']} - "
            f"{study['primary']['b']} = {last['mean']:+.4f}, |t| {abs(last['t'] or 0):.2f} against "
            f"{last['critical_t']:.2f}: {'crossed, stopping' if last['crossed'] else 'not crossed'}",
            flush=True,
        )
        if last["crossed"]:
            break
    return trained, reports, {"design": design, **result}


def operating_at_effect(study: dict, record: dict, diffs: list[float]) -> dict | None:
    """The design's power at the study's effect size, given the SD of the primary differences seen."""
    from .sequential import operating

    sd = seed_stats(diffs)["std"]
    if not sd:
        return None
    effect = effect_for(study["primary"]["metric"], study)
    sim = operating(record["design"], effect / sd)
    return {"effect": effect, "sd": sd, "power": sim["crossing"], "expected_seeds": sim["expected_seeds"]}


def write_pictures(study: dict, reports: dict, per_seed: dict, train_len: int) -> list[Path]:
    from ..plots import study_figure, write_png
    from .figures import passkey_spread_figure

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
    title = f"{study['name']}: exact match, {ev['samples']} samples per cell, {seeds} seed(s)"
    fig = passkey_spread_figure(per_seed, lengths, ev["depths"], train_len, title)
    return [write_png(fig, out / "passkey_grid.png")]


def primary_section(study: dict, per_seed: dict, train_len: int, record: dict | None) -> list[str]:
    """The markdown of the primary comparison (none without one, or with one seed)."""
    pr = study["primary"]
    if pr is None or len(study["seeds"]) < 2:
        return []
    multiples = study["eval"]["multiples"]
    if pr["metric"] == "last_block":
        columns = [f"{m}x: [{(m - 1) * train_len}, {m * train_len})" for m in multiples]
    else:
        columns = [f"{m}x ({m * train_len})" for m in multiples]
    row = study_compare({**study, "compare": [(pr["a"], pr["b"])]}, per_seed, pr["metric"])[pr["column"]]
    return primary_markdown(study, row, columns, record)


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
    planned, record = study["seeds"], None
    if study["sequential"]:
        trained, reports, record = train_sequential(study, force)
        study = {**study, "seeds": planned[: record["seeds"]]}
        record["operating"] = operating_at_effect(study, record, primary_diffs(study, reports))
    else:
        trained = train_all(study, force)
        reports = evaluate_all(study)
    out, ev = study["out"], study["eval"]
    info = run_info(reports)
    train_len = next(iter(info.values()))["train_seq_len"]
    metrics = ppl_metrics if ev["task"] == "ppl" else passkey_metrics
    per_seed = {n: {s: metrics(r) for s, r in seeds.items()} for n, seeds in reports.items()}
    pictures = write_pictures(study, reports, per_seed, train_len)
    seeds = ", ".join(seed_label(s) for s in study["seeds"])
    if record:
        seeds += f" (sequential: planned up to {len(planned)}, {record['decision']} after {record['seeds']})"
    comparisons = [
        row
        for m in (("loss", "last_block") if ev["task"] == "ppl" else ("accuracy",))
        for row in study_compare(study, per_seed, m)
    ]
    primary = primary_section(study, per_seed, train_len, record)
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
        f"Bold: the best mean; †: better than every other run, paired t-test p < {study['alpha']:g} against "
        f"each. ✓ in the paired tables: p < {study['alpha']:g} (two-sided paired t-test over seeds; the "
        f"secondary comparisons are not corrected for their number).",
        "",
        *primary,
        *body,
        f"Protocol: {protocol}.",
        *timing_lines(trained, reports, total, load_start, load_now()),
    ]
    atomic_write_text(out / "study.md", "\n".join(md) + "\n")
    summary = {
        "study": study["name"],
        "quick": quick,
        "seeds": [seed_label(s) for s in study["seeds"]],
        "planned_seeds": [seed_label(s) for s in planned],
        "runs": study["runs"],
        "eval": ev,
        "alpha": study["alpha"],
        "effect_size_nats": study["effect_size_nats"],
        "effect_size_accuracy": study["effect_size_accuracy"],
        "resolve_rule": f"two-sided paired t-test over seeds, p < {study['alpha']:g}, >= 2 seeds",
        "primary": study["primary"],
        "sequential": record,
        "per_seed": per_seed,
        "aggregate": {m: aggregate(per_seed, m) for m in metric_names(per_seed)},
        "comparisons": comparisons,
        "train_s": trained["seconds"],
        "train_cpu_s": trained["cpu_s"],
        "loads": {"start": load_start, "run_starts": trained["loads"], "end": load_now()},
        "total_s": total,
        "reports": reports,
    }
    atomic_write_text(out / "study.json", json.dumps(summary, indent=1, default=str))
    print("\n".join(body))
    print(f"[study] wrote {out / 'study.md'}, {out / 'study.json'}, " + ", ".join(map(str, pictures)))
    print(f"[study] {total / 60:.1f} min")
    exit_process(0)
    return 0
