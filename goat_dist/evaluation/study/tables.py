"""The study's markdown tables: mean +- std per run, paired differences, position blocks, every seed."""

from __future__ import annotations

from .spec import METRICS
from .stats import aggregate, best_resolved, compare, metric_values


def _cell(stats: dict, digits: int) -> str:
    if stats["std"] is None:
        return f"{stats['mean']:.{digits}f}"
    return f"{stats['mean']:.{digits}f} ± {stats['std']:.{digits}f}"


def summary_table(per_seed: dict, metric: str, columns: list[str], info: dict, digits: int = 3) -> str:
    """Mean +- std per run and column; bold: the best mean (every run that ties it at the shown precision);
    a dagger: better than every other run, resolved."""
    higher = METRICS[metric][1]
    agg = aggregate(per_seed, metric)
    best = best_resolved(per_seed, metric, higher)
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


def pairs_table(rows: list[dict], columns: list[str], digits: int = 3) -> str:
    """One row per pair: mean +- SE of the paired per-seed difference a - b; ✓ where resolved."""
    pairs = list(dict.fromkeys((r["a"], r["b"]) for r in rows))
    lines = ["| a − b | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for a, b in pairs:
        cells = []
        for r in (r for r in rows if (r["a"], r["b"]) == (a, b)):
            se = "" if r["se"] is None else f" ± {r['se']:.{digits}f}"
            cells.append(f"{r['mean']:+.{digits}f}{se}" + (" ✓" if r["resolved"] else ""))
        lines.append(f"| {a} − {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


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


def ppl_markdown(study: dict, per_seed: dict, info: dict, train_len: int, length_max: int) -> list[str]:
    """The perplexity study's tables: summaries, paired differences, position blocks, every seed."""
    cols = [f"{m}x ({m * train_len})" for m in study["eval"]["multiples"]]
    last = [f"{m}x: [{(m - 1) * train_len}, {m * train_len})" for m in study["eval"]["multiples"]]
    out = []
    for metric, columns in (("loss", cols), ("last_block", last)):
        out += [f"### {METRICS[metric][0]}", "", summary_table(per_seed, metric, columns, info), ""]
    for metric, columns in (("loss", cols), ("last_block", last)):
        rows = compare(per_seed, metric, study["compare"])
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
    cols = [f"{m}x ({m * train_len})" for m in study["eval"]["multiples"]]
    out = []
    for metric in ("accuracy", "digit_accuracy"):
        out += [f"### {METRICS[metric][0]}", "", summary_table(per_seed, metric, cols, info, 2), ""]
    if len(study["seeds"]) > 1:
        rows = compare(per_seed, "accuracy", study["compare"])
        out += ["### Paired differences, exact-match accuracy", "", pairs_table(rows, cols, 2), ""]
    out += ["### Each seed: exact-match accuracy", "", seeds_table(per_seed, "accuracy", cols, 2), ""]
    return out
