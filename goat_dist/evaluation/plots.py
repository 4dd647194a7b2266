"""The evaluation pictures: perplexity against evaluation length, the passkey accuracy grid, and the
study's pictures (loss with error bars over seeds; passkey heatmaps side by side)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.ticker import FormatStrFormatter, NullFormatter

from ..observe.figures import new_figure


def ppl_figure(curves: dict[str, list[dict]], train_len: int, title: str):
    """One line per model: perplexity at each evaluation length (log-log); dashed: the training length."""
    fig = new_figure(6.4, 4.2, dpi=110)
    ax = fig.add_subplot()
    fig.subplots_adjust(left=0.14, right=0.97, bottom=0.13, top=0.9)
    for name, results in curves.items():
        lengths = [r["length"] for r in results]
        ax.plot(lengths, [r["ppl"] for r in results], marker="o", lw=1.5, label=name)
    ax.axvline(train_len, color="k", ls="--", lw=0.8, label=f"training length {train_len}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    values = [r["ppl"] for results in curves.values() for r in results]
    lo, hi = min(values), max(values)
    if hi / lo < 1.12:  # never zoom a 1 % difference to fill the axes: show at least +-6 % around it
        middle = (lo * hi) ** 0.5
        ax.set_ylim(min(lo, middle / 1.06), max(hi, middle * 1.06))
    lengths = sorted({r["length"] for results in curves.values() for r in results})
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_formatter(FormatStrFormatter("%.4g"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%.4g"))
    ax.tick_params(axis="y", which="minor", labelsize=7)
    ax.set(
        xlabel="evaluation length (tokens, fresh non-overlapping windows)", ylabel="perplexity", title=title
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return fig


def passkey_figure(
    lengths: list[int],
    depths: list[float],
    accuracy,
    train_len: int,
    title: str,
    digit_accuracy=None,
):
    """Exact-match accuracy heatmap: rows = key depth, columns = evaluation length. Each cell shows the
    exact-match rate and, below it, the share of single digits right (chance 0.1)."""
    fig = new_figure(1.15 * len(lengths) + 2.6, 0.55 * len(depths) + 1.9, dpi=110)
    ax = fig.add_subplot()
    fig.subplots_adjust(left=0.16, right=0.86, bottom=0.2, top=0.86)
    grid = np.asarray(accuracy, dtype=float).T  # (depths, lengths)
    digits = None if digit_accuracy is None else np.asarray(digit_accuracy, dtype=float).T
    image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    for (row, col), value in np.ndenumerate(grid):
        text = f"{value:.2f}" if digits is None else f"{value:.2f}\ndigits {digits[row, col]:.2f}"
        ax.text(col, row, text, ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(lengths)), [f"{n}{'*' if n > train_len else ''}" for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set(
        xlabel=f"context length (* beyond the training length {train_len})", ylabel="key depth", title=title
    )
    fig.colorbar(image, cax=fig.add_axes((0.88, 0.2, 0.025, 0.66)), label="exact-match accuracy")
    return fig


def _errorbars(ax, x, per_seed: dict, metric: str, shift: float, label: str, index=None):
    """Mean +- std over seeds as an error bar, each seed as a faint dot (x shifted so runs don't hide
    each other's bars)."""
    seeds = list(per_seed.values())
    values = np.asarray([s[metric] if index is None else s[metric][index] for s in seeds], dtype=float)
    mean = values.mean(0)
    std = values.std(0, ddof=1) if len(values) > 1 else np.zeros_like(mean)
    xs = np.asarray(x, dtype=float) * shift
    bar = ax.errorbar(xs, mean, yerr=std, marker="o", ms=3.5, lw=1.3, capsize=2.5, label=label)
    for row in values:
        ax.plot(xs, row, ls="none", marker=".", ms=3, alpha=0.35, color=bar[0].get_color())


def study_figure(per_seed: dict, lengths: list[int], train_len: int, title: str):
    """Three panels, mean +- std over seeds: loss over whole windows of each length; loss on each
    length's last training-length block (the extrapolated positions); loss by position block inside the
    longest window. ``per_seed``: {run: {seed: ppl_metrics}}."""
    fig = new_figure(15.0, 4.4, dpi=100)
    axes = [fig.add_subplot(1, 3, k + 1) for k in range(3)]
    fig.subplots_adjust(left=0.05, right=0.99, bottom=0.14, top=0.85, wspace=0.22)
    count = len(per_seed)
    blocks = len(next(iter(next(iter(per_seed.values())).values()))["blocks"])
    centres = [(k + 0.5) * train_len for k in range(blocks)]
    for i, (run, seeds) in enumerate(per_seed.items()):
        shift = 2 ** (0.06 * (i - (count - 1) / 2))  # a small multiplicative offset on the log-x axis
        _errorbars(axes[0], lengths, seeds, "loss", shift, run)
        _errorbars(axes[1], lengths, seeds, "last_block", shift, run)
        _errorbars(axes[2], centres, seeds, "blocks", shift, run)
    panels = (
        ("whole windows of each length", "evaluation length (tokens)", lengths),
        ("positions [(m-1)L, mL) of windows of mL", "evaluation length mL (tokens)", lengths),
        (f"by position, windows of {lengths[-1]}", "position in the window (block centre)", None),
    )
    for ax, (name, xlabel, ticks) in zip(axes, panels):
        ax.axvline(train_len, color="k", ls="--", lw=0.8)
        ax.set_xscale("log", base=2)
        if ticks:
            ax.set_xticks(ticks, [str(n) for n in ticks])
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set(xlabel=xlabel, ylabel="validation loss (nats)", title=name)
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{title}; dashed: the training length {train_len}", fontsize=10)
    return fig


def passkey_grid_figure(grids: dict, lengths: list[int], depths: list[float], train_len: int, title: str):
    """One exact-match heatmap per run, side by side on one colour scale. ``grids``: {run: accuracy
    (lengths x depths), mean over seeds}."""
    n = len(grids)
    fig = new_figure(0.9 * len(lengths) * n + 1.8, 0.5 * len(depths) + 2.0, dpi=110)
    fig.subplots_adjust(left=0.06, right=0.92, bottom=0.2, top=0.8, wspace=0.12)
    image = None
    for k, (run, grid) in enumerate(grids.items()):
        ax = fig.add_subplot(1, n, k + 1)
        values = np.asarray(grid, dtype=float).T  # (depths, lengths)
        image = ax.imshow(values, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
        for (row, col), value in np.ndenumerate(values):
            ax.text(col, row, f"{value:.2f}", ha="center", va="center", fontsize=7)
        marked = [f"{m}{'*' if m > train_len else ''}" for m in lengths]
        ax.set_xticks(range(len(lengths)), marked, fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths] if k == 0 else [])
        ax.set_title(run, fontsize=9)
        ax.set_xlabel("context length")
        if k == 0:
            ax.set_ylabel("key depth")
    fig.colorbar(image, cax=fig.add_axes((0.935, 0.2, 0.015, 0.6)), label="exact match")
    fig.suptitle(f"{title}; * beyond the training length {train_len}", fontsize=10)
    return fig


def write_png(fig, path: str | Path) -> Path:
    """The picture at ``path``, atomically: a reader never sees half a file, nor a crash leave one."""
    import io

    from ..atomic import atomic_write_bytes

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    atomic_write_bytes(path, buf.getvalue())
    return path
