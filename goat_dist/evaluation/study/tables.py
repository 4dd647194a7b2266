"""The study's markdown tables: mean +- std per run, paired t-tests with intervals and power, the primary
comparison's sequential looks, position blocks, every seed."""

from __future__ import annotations

from .spec import METRICS
from .stats import aggregate, best_resolved, compare, effect_for, metric_values


def _cell(stats: dict, digits: int) -> str:
    if stats["std"] is None:
        return f"{stats['mean']:.{digits}f}"
    return f"{stats['mean']:.{digits}f} ± {stats['std']:.{digits}f}"


def summary_table(
    per_seed: dict, metric: str, columns: list[str], info: dict, digits: int = 3, alpha: float = 0.05
) -> str:
    """Mean +- std per run and column; bold: the best mean (every run that ties it at the shown precision);
    a dagger: better than every other run, paired t-test p < alpha against each."""
    higher = METRICS[metric][1]
    agg = aggregate(per_seed, metric)
    best = best_resolved(per_seed, metric, higher, alpha)
    lines = [
        "| run | position | head_dim | non-emb. params | " + " | ".join(columns) + " |",
        "|---|---|---|---|" + "---|" * len(columns),
    ]
    for run, stats in agg.items():
        cells = []
        for c, s in enumerate(stats):
            text = _cell(s, digits)
            top = agg[best[c]["run"]][c]["mean"]
            if round(s["mean"], digits) == round(top, digits):  # ties at the shown precision: all bold
                text = f"**{text}**" + (" †" if best[c]["resolved"] and best[c]["run"] == run else "")
            cells.append(text)
        i = info[run]
        lines.append(
            f"| {run} | {i['position']} | {i['head_dim']} | {i['non_embedding_params']:,} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def p_text(p: float | None) -> str:
    if p is None:
        return "—"
    return "< 0.0001" if p < 1e-4 else f"{p:.2g}"


def _signed(x: float, digits: int) -> str:
    return f"{x:+.{digits}f}".replace("-", "−")


def pairs_table(rows: list[dict], columns: list[str], digits: int = 3) -> str:
    """One row per pair and column: the mean paired difference a - b (✓: p < alpha), its (1 - alpha)
    interval, the two-sided p of the paired t-test, the SD of the per-seed differences, the power at the
    study's effect size for this many seeds at that SD, and the seeds 80 % power would need."""
    if not rows:
        return "(no pairs to compare)"
    first = rows[0]
    level = f"{100 * (1 - first['alpha']):g} % CI"
    effect = "effect" if first["effect"] is None else f"{first['effect']:g}"
    lines = [
        f"| a − b | length | mean | {level} | p | SD | seeds | power at {effect} | seeds for 80 % |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mean = _signed(r["mean"], digits) + (" ✓" if r["resolved"] else "")
        ci = "—" if r["ci"] is None else f"[{_signed(r['ci'][0], digits)}, {_signed(r['ci'][1], digits)}]"
        sd = "—" if r["sd"] is None else f"{r['sd']:.{digits}f}"
        power = "—" if r["power"] is None else f"{100 * r['power']:.0f} %"
        need = r["seeds_for_power"] if r["seeds_for_power"] is not None else "—"
        lines.append(
            f"| {r['a']} − {r['b']} | {columns[r['column']]} | {mean} | {ci} | {p_text(r['p'])} | {sd} | "
            f"{r['n']} | {power} | {need} |"
        )
    return "\n".join(lines)


def primary_markdown(study: dict, primary_row: dict, columns: list[str], record: dict | None) -> list[str]:
    """The comparison the study is designed to decide: its test and, with sequential seeds, every look
    against the boundary and the decision."""
    pr = study["primary"]
    digits = 3 if "accuracy" not in pr["metric"] else 2
    r = primary_row
    what = f"{METRICS[pr['metric']][0]}, {columns[pr['column']]}"
    out = [f"### Primary comparison: {pr['a']} − {pr['b']}, {what}", ""]
    if record is None:
        verdict = "resolved" if r["resolved"] else "not resolved"
        ci = "" if r["ci"] is None else f", {100 * (1 - r['alpha']):g} % CI [{_signed(r['ci'][0], digits)}, "
        ci += "" if r["ci"] is None else f"{_signed(r['ci'][1], digits)}]"
        power = "" if r["power"] is None else f"; power at {r['effect']:g}: {100 * r['power']:.0f} %"
        out += [
            f"Fixed design, {r['n']} seeds: mean {_signed(r['mean'], digits)}{ci}, p = {p_text(r['p'])} "
            f"(paired t-test, alpha {r['alpha']:g}): {verdict}{power}.",
            "",
        ]
        return out
    design = record["design"]
    looks = ", ".join(str(n) for n in design["looks"])
    out += [
        f"Sequential seeds: {design['boundary']} boundary over looks at {looks} seeds, overall alpha "
        f"{design['alpha']:g} (calibrated on {design['calibration']['sims']:,} simulated null studies: "
        f"{design['null_crossing_simulated']:.4f}). Stop when |t| reaches the look's critical value.",
        "",
        "| look | seeds | mean | t | nominal p | boundary p | critical abs(t) | crossed | repeated CI |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for k in record["looks"]:
        t = "—" if k["t"] is None else _signed(k["t"], 2)
        ci = f"[{_signed(k['repeated_ci'][0], digits)}, {_signed(k['repeated_ci'][1], digits)}]"
        out.append(
            f"| {k['look'] + 1} | {k['n']} | {_signed(k['mean'], digits)} | {t} | {p_text(k['p_nominal'])} | "
            f"{p_text(k['bound'])} | {k['critical_t']:.2f} | {'yes' if k['crossed'] else 'no'} | {ci} |"
        )
    decision = {
        "efficacy": f"crossed at {record['seeds']} seeds: resolved, "
        + (f"{pr['a']} lower" if record["looks"][-1]["mean"] < 0 else f"{pr['a']} higher"),
        "max": f"not resolved after the last look ({record['seeds']} seeds)",
        "continue": f"stopped before the last look ({record['seeds']} seeds): undecided",
    }[record["decision"]]
    op = record.get("operating")
    power = (
        ""
        if op is None
        else f" This design's power at {op['effect']:g} with the SD seen ({op['sd']:.{digits}f}): "
        f"{100 * op['power']:.0f} % (expected {op['expected_seeds']:.1f} seeds; simulated)."
    )
    out += [
        "",
        f"Decision: {decision}. The repeated CI covers the true difference at every look at once with "
        f"probability {1 - design['alpha']:g}; the nominal p-values are not p-values of the sequential "
        f"study.{power}",
        "",
    ]
    return out


def seeds_table(per_seed: dict, metric: str, columns: list[str], digits: int = 3) -> str:
    """Every (run, seed) value of one metric."""
    lines = ["| run | seed | " + " | ".join(columns) + " |", "|---|---|" + "---|" * len(columns)]
    for run, seeds in metric_values(per_seed, metric).items():
        for seed, values in seeds.items():
            lines.append(f"| {run} | {seed} | " + " | ".join(f"{v:.{digits}f}" for v in values) + " |")
    return "\n".join(lines)


def blocks_table(per_seed: dict, train_len: int, length: int, digits: int = 3) -> str:
    """Mean loss of each position block of the longest window (blocks of the training length)."""
    agg = aggregate(per_seed, "blocks")
    count = len(next(iter(agg.values())))
    heads = [f"[{k * train_len}, {min((k + 1) * train_len, length)})" for k in range(count)]
    lines = ["| run | " + " | ".join(heads) + " |", "|---|" + "---|" * count]
    for run, stats in agg.items():
        lines.append(f"| {run} | " + " | ".join(f"{s['mean']:.{digits}f}" for s in stats) + " |")
    return "\n".join(lines)


def study_compare(study: dict, per_seed: dict, metric: str) -> list[dict]:
    """Every compared pair at every length, at the study's alpha and its effect size for ``metric``."""
    return compare(per_seed, metric, study["compare"], study["alpha"], effect_for(metric, study))


def ppl_markdown(study: dict, per_seed: dict, info: dict, train_len: int, length_max: int) -> list[str]:
    """The perplexity study's tables: summaries, paired differences, position blocks, every seed."""
    cols = [f"{m}x ({m * train_len})" for m in study["eval"]["multiples"]]
    last = [f"{m}x: [{(m - 1) * train_len}, {m * train_len})" for m in study["eval"]["multiples"]]
    out = []
    for metric, columns in (("loss", cols), ("last_block", last)):
        table = summary_table(per_seed, metric, columns, info, alpha=study["alpha"])
        out += [f"### {METRICS[metric][0]}", "", table, ""]
    for metric, columns in (("loss", cols), ("last_block", last)):
        rows = study_compare(study, per_seed, metric)
        out += [f"### Paired differences, {METRICS[metric][0]}", "", pairs_table(rows, columns), ""]
    out += [
        f"### Loss (nats) by position block inside windows of {length_max} tokens, mean over seeds",
        "",
        blocks_table(per_seed, train_len, length_max),
        "",
    ]
    for metric, columns in (("loss", cols), ("last_block", last)):
        out += [f"### Each seed: {METRICS[metric][0]}", "", seeds_table(per_seed, metric, columns), ""]
    return out


def passkey_markdown(study: dict, per_seed: dict, info: dict, train_len: int) -> list[str]:
    """The passkey study's tables: accuracy per run, paired differences at each length, every seed."""
    cols = [f"{m}x ({m * train_len})" for m in study["eval"]["multiples"]]
    out = []
    for metric in ("accuracy", "digit_accuracy"):
        table = summary_table(per_seed, metric, cols, info, 2, study["alpha"])
        out += [f"### {METRICS[metric][0]}", "", table, ""]
    if len(study["seeds"]) > 1:
        rows = study_compare(study, per_seed, "accuracy")
        out += ["### Paired differences, exact-match accuracy", "", pairs_table(rows, cols, 2), ""]
    out += ["### Each seed: exact-match accuracy", "", seeds_table(per_seed, "accuracy", cols, 2), ""]
    return out
