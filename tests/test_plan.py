"""The planner's model configs, its parameter inventory against the real model, and its CLI."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from goat_dist.config import load_config
from goat_dist.plan import make_plan, param_inventory, total_params
from goat_dist.plan.hardware import GPUS, gpu
from goat_dist.plan.planner import PlanError, largest_micro_batch, memory_at

ROOT = Path(__file__).resolve().parents[1]
MODELS = sorted((ROOT / "configs" / "models").glob("*.yaml"))
SIZE = {"125m": 125e6, "350m": 350e6, "760m": 760e6, "1.3b": 1.3e9, "2.7b": 2.7e9, "6.7b": 6.7e9,
        "13b": 13e9, "30b": 30e9}  # fmt: skip


def _keys(path: Path) -> list[str]:
    return re.findall(r"^ *[a-z_0-9]+:", path.read_text(), flags=re.M)


def test_every_size_and_twin_is_there():
    names = {p.stem for p in MODELS}
    assert {f"goat_{s}" for s in SIZE} <= names
    assert {"rope_125m", "alibi_125m", "rope_1.3b", "alibi_1.3b"} <= names


@pytest.mark.parametrize("path", MODELS, ids=lambda p: p.stem)
def test_model_config_parses_and_its_size_matches_its_name(path):
    cfg = load_config(path)
    assert _keys(path) == _keys(ROOT / "configs" / "tiny.yaml")  # the embedded default's format
    position, size = path.stem.split("_")
    assert cfg.model.position == position
    n = total_params(cfg.model)
    assert abs(n / SIZE[size] - 1) <= 0.10, f"{path.name}: {n:,} parameters"
    head_dim = cfg.model.hidden_size // cfg.model.num_heads
    assert head_dim in (64, 128)
    nodes = re.search(r"--nnodes=(\d+)", path.read_text())
    world = 8 * int(nodes.group(1) if nodes else 1)
    plan = make_plan(cfg, world // 8, 8, gpu("h100-80gb"))  # its own layout on 8 x 80 GB GPUs per node
    assert plan["layout"]["grad_accum"] == int(plan["layout"]["grad_accum"])
    assert plan["verdict"] == "fits", (path.name, plan["headroom"])


@pytest.mark.parametrize("position", ["goat", "rope", "alibi", "learned"])
@pytest.mark.parametrize("extra", [[], ["model.bias=true", "model.norm=layernorm", "model.activation=gelu",
                                        "model.tie_embeddings=false", "model.num_kv_heads=2"]])  # fmt: skip
def test_inventory_is_the_models_own_parameter_list(world1, position, extra):
    from goat_dist.model import GPT

    cfg = load_config(None, ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=4",
                             "model.vocab_size=1000", "model.seq_len=32", f"model.position={position}",
                             *extra])  # fmt: skip
    model = GPT(cfg.model)
    built = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    assert built == [(p.name, p.shape) for p in param_inventory(cfg.model, 1)]
    assert total_params(cfg.model) == sum(p.numel() for p in model.parameters())


def test_memory_grows_with_the_micro_batch_and_the_largest_fit_is_the_boundary():
    cfg = load_config(ROOT / "configs/models/goat_1.3b.yaml")
    h100 = gpu("h100-80gb")
    best = largest_micro_batch(cfg, 8, h100)
    assert best >= 1
    assert (
        memory_at(cfg, 8, best)["total"]
        <= int(h100.memory_bytes * 0.95)
        < memory_at(cfg, 8, best + 1)["total"]
    )
    # a bigger GPU fits more; ZeRO-3 and TP shrink the state
    assert largest_micro_batch(cfg, 8, gpu("h200")) > best > largest_micro_batch(cfg, 8, gpu("a100-40gb"))
    z3 = load_config(ROOT / "configs/models/goat_1.3b.yaml", ["parallel.zero_stage=3"])
    assert memory_at(z3, 8, 1)["state"]["total"] < memory_at(cfg, 8, 1)["state"]["total"]


def test_impossible_layouts_are_refused_with_their_numbers():
    cfg = load_config(ROOT / "configs/models/goat_1.3b.yaml", ["parallel.tp=3"])
    with pytest.raises(PlanError, match="tp=3"):
        make_plan(cfg, 1, 8, gpu("h100-80gb"))


def test_gpu_table():
    assert set(GPUS) == {"h100-80gb", "h200", "a100-80gb", "a100-40gb", "b200"}
    assert gpu("h100-80gb").peak_bf16 == 989.4e12 and gpu("a100-40gb").peak_bf16 == 312e12
    with pytest.raises(ValueError, match="known"):
        gpu("t4")


def test_a_world_that_tp_x_cp_does_not_divide_is_refused():
    cfg = load_config(ROOT / "configs/models/goat_1.3b.yaml", ["parallel.tp=2", "parallel.cp=2"])
    with pytest.raises(PlanError, match=r"world size 6 is not divisible by tp x cp = 2 x 2"):
        make_plan(cfg, 1, 6, gpu("h100-80gb"))


def test_materialize_refuses_what_it_cannot_build(world1):
    from goat_dist.plan.dry_run import materialize

    cfg = load_config(ROOT / "configs/models/goat_125m.yaml", ["parallel.cp=2"])
    with pytest.raises(PlanError, match="without a torch.distributed world"):  # world1 holds one here
        materialize(cfg, 16, log=lambda *a: None)


def test_materialize_says_cp_is_not_built_yet():
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "goat_dist",
            "plan",
            "--config",
            str(ROOT / "configs/models/goat_125m.yaml"),
            "--nodes",
            "2",
            "--materialize",
            "parallel.cp=2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2 and "parallel.cp > 1 is not built yet" in out.stderr, out.stderr[-2000:]


def test_context_parallelism_partitions_zero_over_dp_x_cp_and_costs_a_kv_exchange():
    """ZeRO partitions over every replica of a TP slice (DP x CP, trainer/parallelize.py), so CP=2 x DP=4
    holds the state of DP=8; CP halves each rank's sequence (activations) and adds the K/V exchange."""
    path = ROOT / "configs/models/goat_1.3b.yaml"
    h100 = gpu("h100-80gb")
    base = ["parallel.zero_stage=1", "model.seq_len=32768", "train.micro_batch_size=1"]
    cp1 = make_plan(load_config(path, base), 1, 8, h100)
    cp2 = make_plan(load_config(path, [*base, "parallel.cp=2"]), 1, 8, h100)
    assert (cp2["layout"]["cp"], cp2["layout"]["dp"]) == (2, 4)
    assert cp2["memory"]["state"] == cp1["memory"]["state"]
    assert cp2["memory"]["activations"]["total"] < 0.55 * cp1["memory"]["activations"]["total"]
    assert cp1["throughput"]["cp_comm_s"] == 0 < cp2["throughput"]["cp_comm_s"]


def test_the_verdict_words_follow_the_headroom():
    """fits: at least 10 % of the budget left; tight: less; does not fit: over the budget."""
    path = ROOT / "configs/models/goat_1.3b.yaml"
    h100 = gpu("h100-80gb")
    best = largest_micro_batch(load_config(path), 8, h100)

    def verdict(micro: int) -> str:
        cfg = load_config(path, [f"train.micro_batch_size={micro}", f"train.global_batch_size={micro * 8}"])
        return make_plan(cfg, 1, 8, h100)["verdict"]

    assert verdict(1) == "fits"
    assert verdict(best) in ("fits", "tight")
    assert verdict(best + 1) == "does not fit"
    budget = int(h100.memory_bytes * 0.95)
    tight = [
        m for m in range(1, best + 1) if budget - memory_at(load_config(path), 8, m)["total"] < 0.1 * budget
    ]
    assert tight and all(verdict(m) == "tight" for m in tight)
