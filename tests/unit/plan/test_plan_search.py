"""``goat-dist plan --search`` proposes only layouts the trainer accepts and the planner says fit, the
fastest first, and marks the config's own layout."""

from __future__ import annotations

from pathlib import Path

import pytest

from goat_dist import distributed
from goat_dist.config import load_config
from goat_dist.plan import make_plan
from goat_dist.plan.hardware import gpu
from goat_dist.plan.search import enumerate_layouts, format_search, search

ROOT = Path(__file__).resolve().parents[3]
MODEL = ROOT / "configs/models/goat_1.3b.yaml"  # 16 heads, seq 2048, global 512, TP 1 ZeRO-1 micro 8


def trainer_would_start(cfg, world: int) -> int:
    """The checks ``Trainer.__init__`` runs, as it runs them (``distributed.check_layout``, then
    ``trainer.gradient_accumulation``'s ``check_batch`` and ``check_rampup``): the accumulation."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    distributed.check_layout(
        world, p.tp, m.num_heads, m.num_kv_heads or m.num_heads, m.seq_len, p.sp, cp=p.cp
    )
    dp = world // (p.tp * p.cp)
    distributed.check_batch(t.global_batch_size, t.micro_batch_size, dp)
    distributed.check_rampup(t.global_batch_size, t.micro_batch_size, dp, t.batch_rampup, m.seq_len)
    return t.global_batch_size // (t.micro_batch_size * dp)


@pytest.mark.parametrize("device", ["h100-80gb", "a100-40gb"])
def test_search_proposes_only_accepted_fitting_layouts_and_the_best_fits(device):
    r = search(load_config(MODEL), 1, 8, gpu(device), top=40)
    assert r["best"], "nothing fits"
    assert r["accepted"] > r["fitting"] >= len(r["best"])  # some accepted layouts do not fit
    speeds = [c.throughput["tokens_per_s"] for c in r["best"]]
    assert speeds == sorted(speeds, reverse=True)
    for c in r["best"]:
        cfg = load_config(MODEL, c.overrides())  # loaded and validated as `goat-dist train` loads it
        assert trainer_would_start(cfg, 8) == c.grad_accum
        plan = make_plan(cfg, 1, 8, gpu(device))  # the plan of that layout says it fits
        assert plan["verdict"] in ("fits", "tight"), (c.overrides(), plan["verdict"])
        assert plan["throughput"]["tokens_per_s"] == pytest.approx(c.throughput["tokens_per_s"])
        assert c.peak <= plan["budget"]
    best = make_plan(load_config(MODEL, r["best"][0].overrides()), 1, 8, gpu(device))
    assert best["headroom"] >= 0


def test_search_leaves_out_what_the_trainer_refuses():
    """GQA with 2 KV heads: TP 4 and 8 are refused (check_layout); a global batch of 24 on 8 GPUs: every
    DP must divide it (check_batch); SP only with TP; CP only where the sequence splits into 2·CP chunks."""
    cfg = load_config(MODEL, ["model.num_kv_heads=2", "train.global_batch_size=24", "model.seq_len=1536"])
    layouts = list(enumerate_layouts(cfg, 8, 8))
    assert layouts
    for c in layouts:
        p, t = c.parallel, c.train
        assert p.tp in (1, 2) and (not p.sp or p.tp > 1)
        dp = 8 // (p.tp * p.cp)
        assert 24 % (t.micro_batch_size * dp) == 0
        assert 1536 % (2 * p.cp * (p.tp if p.sp else 1)) == 0
    seen = {(c.parallel.tp, c.parallel.sp, c.parallel.cp, c.parallel.zero_stage) for c in layouts}
    assert (2, True, 4, 3) in seen and (1, False, 1, 0) in seen
    assert {c.train.activation_checkpointing for c in layouts} == {"none", "selective", "full"}


def test_search_marks_the_configs_own_layout():
    r = search(load_config(MODEL), 1, 8, gpu("h100-80gb"))
    own = r["own"]
    assert own is not None and own.fits and (own.tp, own.zero_stage, own.micro_batch) == (1, 1, 8)
    text = format_search(r)
    assert text.count("<- config") == 1
    assert "1. parallel.tp=" in text and "fits " in text and "MFU" in text
    refused = search(load_config(MODEL, ["train.micro_batch_size=3"]), 1, 8, gpu("h100-80gb"))
    assert refused["own"] is None and "not divisible" in format_search(refused)


def test_plan_search_on_the_command_line(capsys):
    from goat_dist.cli import main

    assert main(["plan", "--config", str(MODEL), "--nodes", "1", "--search", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "layouts the trainer accepts" in out and "3. parallel.tp=" in out and "4. parallel" not in out


@pytest.mark.parametrize("name", ["goat_6.7b", "goat_30b"])
def test_shipped_configs_take_the_layout_the_search_picks_for_their_cluster(name):
    """configs/models/goat_{6.7b,13b,30b}.yaml run on 64 nodes x 8 H100 (their comments,
    tests/workers/rehearsals.py): their own layout is the search's first there."""
    r = search(load_config(ROOT / f"configs/models/{name}.yaml"), 64, 8, gpu("h100-80gb"), top=1)
    assert r["own_rank"] == 1 and r["best"][0].own, format_search(r)
