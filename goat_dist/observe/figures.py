"""Pictures: the GOAT prior for TensorBoard, and the helpers the evaluation plots share.

matplotlib through its object API on the Agg canvas (no pyplot, no global state, no display), so a
figure can be drawn in a training process, in a thread, or on a machine without a screen. A figure
becomes either an RGB array (``TensorBoard add_image``) or a PNG file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def new_figure(width: float, height: float, dpi: int = 90):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=dpi)  # no constrained layout: it triples the drawing time
    FigureCanvasAgg(fig)
    return fig


def to_rgb(fig) -> np.ndarray:
    """(H, W, 3) uint8 pixels of a drawn figure."""
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


def save_png(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def _legend(ax, n: int) -> None:
    ax.legend(fontsize=6 if n > 4 else 8, ncol=2 if n > 6 else 1, loc="best")


HEADS_PER_PANEL = 4  # more curves in one panel merge into a band where K_rel(d) flattens out


def head_groups(heads: list[int], size: int = HEADS_PER_PANEL) -> list[list[int]]:
    """Consecutive groups of at most ``size`` heads, one row of panels each."""
    return [heads[i : i + size] for i in range(0, len(heads), size)] or [[]]


def prior_curves_figure(curves: dict, heads: list[int], train_len: int, title: str):
    """K_rel(d) over distance (beyond the training length) and the sink lane u(j) over key position; one
    row of panels per group of ``HEADS_PER_PANEL`` heads, laid out tight so no label is cut off."""
    groups = head_groups(heads)
    fig = new_figure(10, 3.0 * len(groups) + 0.6)
    axes = np.atleast_2d(fig.subplots(len(groups), 2, squeeze=False))
    d = curves["distance"]
    row = 0
    for (left, right), group in zip(axes, groups):
        for h in group:
            left.plot(d, curves["k_rel"][row], lw=1, label=f"head {h}")
            right.plot(
                d, curves["sink"][row], lw=1, label=f"head {h}, recency slope {curves['slope'][row]:.3g}"
            )
            row += 1
        for ax in (left, right):
            ax.axvline(train_len, color="k", ls="--", lw=0.8)
            ax.grid(alpha=0.3)
            ax.set_xscale("symlog", linthresh=1.0)  # short distances and the far range both visible
            ax.set_xlim(0, float(d[-1]))
        left.set(
            title=f"{title}: relative prior K_rel(d)", xlabel="distance d = i - j (tokens)", ylabel="logit"
        )
        right.set(
            title="sink lane u(j) (recency slope listed)", xlabel="key position j (dashed: training length)"
        )
        _legend(left, len(group))
        _legend(right, len(group))
    fig.tight_layout()  # once, here: cheaper than a constrained layout at every draw
    return fig


def log_prior_figure(curves: dict, heads: list[int], train_len: int, title: str):
    """The log-prior matrix K_ij, row-centred (softmax ignores a row constant), one panel per head."""
    n = len(heads)
    cols = min(n, 4)
    rows = -(-n // cols)
    width, height = 2.7 * cols + 1.8, 2.6 * rows + 0.7  # inches; margins below are fixed in inches
    fig = new_figure(width, height)
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).ravel()
    fig.subplots_adjust(
        left=0.75 / width,
        right=1 - 1.3 / width,
        bottom=0.55 / height,
        top=1 - 0.6 / height,
        wspace=0.45,
        hspace=0.55,
    )
    matrices = curves["log_prior"]
    finite = matrices[np.isfinite(matrices)]
    vmin = max(float(finite.min()) if finite.size else -1.0, -30.0)
    extent = (0, float(curves["positions"][-1]), float(curves["positions"][-1]), 0)
    image = None
    for ax, row, h in zip(axes, range(n), heads):
        image = ax.imshow(matrices[row], extent=extent, vmin=vmin, vmax=0.0, cmap="viridis")
        ax.axvline(train_len, color="w", lw=0.6, ls="--")
        ax.axhline(train_len, color="w", lw=0.6, ls="--")
        ax.set_title(f"head {h}", fontsize=9)
        ax.set_xlabel("key j", fontsize=8)
        ax.set_ylabel("query i", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in axes[n:]:
        ax.axis("off")
    if image is not None:
        bar = fig.add_axes((1 - 1.05 / width, 0.55 / height, 0.15 / width, 1 - 1.15 / height))
        fig.colorbar(image, cax=bar, label="K_ij - max_j K_ij")
    fig.suptitle(f"{title}: log-prior over 2x the training length (dashed)", fontsize=10)
    return fig


def prior_images(snapshot: dict) -> dict[str, np.ndarray]:
    """TensorBoard image tag -> (H, W, 3) pixels, two per pictured layer."""
    out = {}
    for layer, curves in snapshot["layers"].items():
        title = f"layer {layer}"
        heads, train_len = snapshot["heads"], snapshot["train_len"]
        out[f"prior/layer_{layer}/curves"] = to_rgb(prior_curves_figure(curves, heads, train_len, title))
        out[f"prior/layer_{layer}/log_prior"] = to_rgb(log_prior_figure(curves, heads, train_len, title))
    return out
