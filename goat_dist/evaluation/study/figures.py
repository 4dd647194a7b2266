"""The passkey study's heatmaps with the seed spread in every cell: a mean alone would hide whether a
scheme retrieves on every seed or on one."""

from __future__ import annotations

import numpy as np

from ...observe.figures import new_figure
from .stats import aggregate


def passkey_grids(per_seed: dict, lengths: int, depths: int) -> dict:
    """{run: (mean, std, min, max)} over seeds, each (lengths, depths), from each seed's ``grid``."""
    out = {}
    for run, seeds in per_seed.items():
        stats = aggregate({run: seeds}, "grid")[run]
        shape = (lengths, depths)
        mean = np.asarray([s["mean"] for s in stats]).reshape(shape)
        std = np.asarray([0.0 if s["std"] is None else s["std"] for s in stats]).reshape(shape)
        low = np.asarray([min(s["values"]) for s in stats]).reshape(shape)
        high = np.asarray([max(s["values"]) for s in stats]).reshape(shape)
        out[run] = (mean, std, low, high)
    return out


def passkey_spread_figure(
    per_seed: dict, lengths: list[int], depths: list[float], train_len: int, title: str
):
    """One exact-match heatmap per run on one colour scale: the colour is the mean over seeds, each cell
    reads "mean ± std" over seeds (and "min-max" below it when there are 3 or more seeds)."""
    grids = passkey_grids(per_seed, len(lengths), len(depths))
    seeds = len(next(iter(per_seed.values())))
    n = len(grids)
    fig = new_figure(1.15 * len(lengths) * n + 1.8, 0.62 * len(depths) + 2.0, dpi=110)
    fig.subplots_adjust(left=0.06, right=0.92, bottom=0.2, top=0.8, wspace=0.12)
    image = None
    for k, (run, (mean, std, low, high)) in enumerate(grids.items()):
        ax = fig.add_subplot(1, n, k + 1)
        image = ax.imshow(mean.T, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
        for (col, row), value in np.ndenumerate(mean):
            text = f"{value:.2f}" if seeds < 2 else f"{value:.2f}±{std[col, row]:.2f}"
            if seeds >= 3:
                text += f"\n{low[col, row]:.2f}-{high[col, row]:.2f}"
            ax.text(col, row, text, ha="center", va="center", fontsize=6)
        marked = [f"{m}{'*' if m > train_len else ''}" for m in lengths]
        ax.set_xticks(range(len(lengths)), marked, fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths] if k == 0 else [])
        ax.set_title(run, fontsize=9)
        ax.set_xlabel("context length")
        if k == 0:
            ax.set_ylabel("key depth")
    fig.colorbar(image, cax=fig.add_axes((0.935, 0.2, 0.015, 0.6)), label="exact match, mean over seeds")
    spread = "" if seeds < 2 else "; cells: mean ± std" + (", min-max" if seeds >= 3 else "")
    fig.suptitle(f"{title}; * beyond the training length {train_len}{spread}", fontsize=10)
    return fig
