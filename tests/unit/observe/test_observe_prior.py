"""Pictures of the GOAT prior: the numbers drawn are the module's own, and the pictures come out."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from goat_dist.goat import GoatPrior
from goat_dist.observe.figures import prior_images
from goat_dist.observe.prior_snapshot import chosen_layers, prior_curves, prior_snapshot


def trained_looking_prior(train_len: int = 16) -> GoatPrior:
    torch.manual_seed(0)
    prior = GoatPrior(3, pos_rank=3, abs_rank=2, training_seq_len=train_len)
    with torch.no_grad():  # away from the init, so every term matters
        for p in prior.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return prior


def test_relative_curve_is_the_fourier_formula_beyond_the_training_length():
    prior = trained_looking_prior()
    curves = prior_curves(prior, train_len=16, reach=4)
    d = torch.arange(4 * 16 + 1, dtype=torch.float64)
    w = prior.rel_freqs.double()
    a, b = prior.lambda_sym.detach().double(), prior.lambda_asym.detach().double()
    expected = (
        a[:, None, :] * torch.cos(d[None, :, None] * w) + b[:, None, :] * torch.sin(d[None, :, None] * w)
    ).sum(-1)
    assert curves["k_rel"].shape == (3, 65)
    torch.testing.assert_close(curves["k_rel"].double(), expected, atol=1e-5, rtol=1e-5)


def test_sink_curve_and_slope_are_the_modules():
    prior = trained_looking_prior()
    curves = prior_curves(prior, train_len=16)
    j = torch.arange(65)
    torch.testing.assert_close(curves["sink"], prior.sink(j[None], False)[0].T.detach())
    slopes = torch.nn.functional.softplus(prior.recency_slope_raw.detach())
    torch.testing.assert_close(curves["slope"], slopes, atol=1e-5, rtol=1e-5)


def test_log_prior_matrix_is_row_centred_and_causal():
    prior = trained_looking_prior()
    m = prior_curves(prior, train_len=16, grid=20)["log_prior"]
    assert m.shape == (3, 20, 20)
    upper = torch.ones(20, 20, dtype=torch.bool).triu(1)
    assert torch.isinf(m[:, upper]).all() and torch.isfinite(m[:, ~upper]).all()
    torch.testing.assert_close(m.amax(-1), torch.zeros(3, 20))
    positions = prior_curves(prior, train_len=16, grid=20)["positions"].long()
    full = prior.log_prior(positions[None], True)[0].detach()
    # differences within a row are the prior's own
    torch.testing.assert_close(
        m[:, 7, :7] - m[:, 7, :1], full[:, 7, :7] - full[:, 7, :1], atol=1e-4, rtol=1e-4
    )


def test_chosen_layers():
    assert chosen_layers(None, 12) == [0, 6, 11]
    assert chosen_layers(None, 1) == [0]
    assert chosen_layers([-1, 2], 4) == [2, 3]
    with pytest.raises(ValueError, match="layer 7"):
        chosen_layers([7], 4)


def test_snapshot_and_images_of_a_model(world1):
    from goat_dist.config import ModelConfig
    from goat_dist.model import GPT

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=128, seq_len=32, num_layers=3, hidden_size=64, num_heads=4, position="goat")
    snap = prior_snapshot(GPT(cfg), None, [0, 2], step=5)
    assert sorted(snap["layers"]) == [0, 1, 2] and snap["heads"] == [0, 2] and snap["train_len"] == 32
    assert snap["layers"][1]["k_rel"].shape == (2, 4 * 32 + 1)
    images = prior_images(snap)
    assert sorted(images) == [f"prior/layer_{i}/{kind}" for i in range(3) for kind in ("curves", "log_prior")]
    for image in images.values():
        assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3
        assert image.shape[0] > 200 and image.std() > 10  # something was drawn
    rope = ModelConfig(vocab_size=128, seq_len=32, num_layers=2, hidden_size=64, num_heads=4, position="rope")
    assert prior_snapshot(GPT(rope), None, None, step=5) is None
    with pytest.raises(ValueError, match="KV heads"):
        prior_snapshot(GPT(cfg), None, [9], step=5)


def test_curves_show_the_prior_extrapolating_smoothly():
    """K_rel is a fixed-frequency Fourier series: beyond the training length it is as bounded as inside."""
    prior = trained_looking_prior()
    curves = prior_curves(prior, train_len=16, reach=4)["k_rel"]
    bound = prior.lambda_sym.abs().sum(-1) + prior.lambda_asym.abs().sum(-1)
    assert (curves.abs() <= bound[:, None].detach() + 1e-5).all()
    assert not math.isclose(float(curves[:, 17:].std()), 0.0)


def test_curves_picture_keeps_its_labels_and_splits_eight_heads(tmp_path):
    """The rendered PNG: every label inside the page, and 8 heads in two rows of 4 (one band otherwise)."""
    from matplotlib.image import imread

    from goat_dist.observe.figures import prior_curves_figure, save_png

    d = np.arange(0, 401, dtype=float)
    rng = np.random.default_rng(0)
    k_rel = -12.5 + 0.01 * rng.normal(size=(8, d.size))  # long tick labels ("-12.52") push the y-label out
    curves = {"distance": d, "k_rel": k_rel, "sink": rng.normal(size=(8, d.size))}
    curves["slope"] = rng.normal(size=8)
    fig = prior_curves_figure(curves, list(range(8)), 100, "layer 0")
    png = imread(save_png(fig, tmp_path / "curves.png"))
    assert png.shape[:2] == (round(fig.bbox.height), round(fig.bbox.width))
    assert len(fig.axes) == 4 and all(len(ax.get_lines()) == 4 + 1 for ax in fig.axes)  # + the dashed line
    renderer = fig.canvas.get_renderer()
    page = fig.bbox
    for ax in fig.axes:
        for text in (ax.yaxis.label, ax.xaxis.label, ax.title, *ax.get_yticklabels()):
            if text.get_text():
                box = text.get_window_extent(renderer)
                assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1
