"""The evaluation pictures: perplexity against evaluation length, and the passkey accuracy grid."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.ticker import FormatStrFormatter, NullFormatter

from ..observe.figures import new_figure, save_png


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


def write_png(fig, path: str | Path) -> Path:
    return save_png(fig, path)
