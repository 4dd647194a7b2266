"""The planner's model configs, its parameter inventory against the real model, and its CLI."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from goat_dist.config import load_config
from goat_dist.plan import make_plan, param_inventory, total_params
from goat_dist.plan.hardware import GPUS, gpu
from goat_dist.plan.planner import PlanError, largest_micro_batch, memory_at

ROOT = Path(__file__).resolve().parents[3]
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


@pytest.mark.parametrize(
    "ablation",
    [
        ["model.goat.abs_rank=0"],
        ["model.goat.pos_rank=0"],
        ["model.goat.pos_rank=0", "model.goat.abs_rank=0"],
    ],
    ids=["no-sink", "no-spectral", "slope-only"],
)
def test_inventory_holds_for_goats_ablations(world1, ablation):
    """pos_rank 0 / abs_rank 0 build no K_rel / no sink MLP: the planner and the FLOP count agree."""
    from goat_dist.model import GPT
    from goat_dist.observe import flops

    cfg = load_config(None, ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=2",
                             "model.vocab_size=1000", "model.seq_len=32", "model.position=goat",
                             *ablation])  # fmt: skip
    model = GPT(cfg.model)
    built = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    assert built == [(p.name, p.shape) for p in param_inventory(cfg.model, 1)]
    assert not any(0 in shape for _, shape in built)  # no empty parameters for ZeRO to partition
    embedding = {"embedding.weight", "output.weight"}
    counted = sum(p.numel() for name, p in model.named_parameters() if name not in embedding)
    assert flops.non_embedding_params(cfg.model) == counted


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
    """In the trainer's words: the plan checks the layout as ``Trainer.__init__`` does."""
    cfg = load_config(ROOT / "configs/models/goat_1.3b.yaml", ["parallel.tp=2", "parallel.cp=2"])
    with pytest.raises(PlanError, match=r"world size 6 is not divisible by parallel.tp=2 x parallel.cp=2"):
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
    """ZeRO partitions over every replica of a TP slice (DP x CP, parallel/parallelize.py), so CP=2 x DP=4
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
        # two micro-batches a step, as the config's 512 gives every micro-batch size here (the fp32 sums)
        cfg = load_config(path, [f"train.micro_batch_size={micro}", f"train.global_batch_size={micro * 16}"])
        return make_plan(cfg, 1, 8, h100)["verdict"]

    assert verdict(1) == "fits"
    assert verdict(best) in ("fits", "tight")
    assert verdict(best + 1) == "does not fit"
    budget = int(h100.memory_bytes * 0.95)
    tight = [
        m for m in range(1, best + 1) if budget - memory_at(load_config(path), 8, m)["total"] < 0.1 * budget
    ]
    assert tight and all(verdict(m) == "tight" for m in tight)


def test_the_planners_deepspeed_options_are_the_trainers():
    """The byte counts assume DeepSpeed's buckets and overlap setting as the trainer configures them."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from goat_dist.engine.build import deepspeed_config
    from goat_dist.plan.memory import zero_options

    for stage in range(4):
        cfg = load_config(None, [f"parallel.zero_stage={stage}", "model.hidden_size=128"])
        zero = DeepSpeedZeroConfig(**deepspeed_config(cfg, 2)["zero_optimization"])
        assert zero_options(cfg) == {"reduce_bucket_size": zero.reduce_bucket_size,
                                     "overlap_comm": zero.overlap_comm,
                                     "contiguous_gradients": zero.contiguous_gradients}, stage  # fmt: skip


def test_a_zero2_rank_holds_the_whole_parameters_touching_its_partition():
    from goat_dist.plan.memory import partition_overlap

    # 15 elements over 2 ranks: partitions of 8 (padded to 2 x 2 x 4); rank 0 [0, 8) touches p0 and p1
    assert partition_overlap([3, 10, 2], 2) == [13, 12]
    assert partition_overlap([3, 10, 2], 4) == [13, 10, 10, 12]
    assert partition_overlap([10, 4, 6], 2) == [10, 10]
    assert partition_overlap([4], 4) == [4, 4, 0, 0]  # partitions of padding only hold nothing


def test_zero1_holds_whole_gradients_until_the_boundary_and_zero2_a_second_partition():
    """Mid-accumulation: ZeRO-1 keeps every parameter's whole gradient; ZeRO-2 its partition's whole
    parameters, plus the next micro-batch's copy when there is one; the busiest rank is the plan's
    (bf16 reduction and accumulation: fp32 accumulation is tested in test_plan_grad_reduction.py)."""
    from goat_dist.plan.memory import state_bytes, total_params

    path = ROOT / "configs/models/goat_1.3b.yaml"  # bf16, DP 8

    def state(stage: int, global_batch: int = 512, rank=None) -> dict:
        over = [f"parallel.zero_stage={stage}", f"train.global_batch_size={global_batch}",
                "parallel.grad_reduce_dtype=bf16", "parallel.grad_accum_dtype=bf16"]  # fmt: skip
        return state_bytes(load_config(path, over), 8, rank=rank)

    n = total_params(load_config(path).model)
    assert state(1)["grads"] == pytest.approx(2 * n, rel=1e-4)  # not 2 n / 8 (the prior's are fp32)
    accumulating, one_micro = state(2), state(2, global_batch=64)  # micro 8 x DP 8: no accumulation
    assert 2 * n / 8 < accumulating["grads"] == one_micro["grads"] < 1.5 * 2 * n / 8
    assert accumulating["buffers"] - one_micro["buffers"] == accumulating["grads"]
    ranks = [state(2, rank=r)["total"] for r in range(8)]
    assert max(ranks) == accumulating["total"] and min(ranks) < max(ranks)


def test_the_logits_fp32_copy_is_counted():
    """The loss keeps fp32 logits (counted as activations); next to them the masked fp32 copy when the
    vocabulary is padded, or the bf16 logits being cast."""
    from goat_dist.plan.memory import transient_bytes

    def logits(*overrides):
        cfg = load_config(None, ["model.seq_len=64", *overrides])
        return transient_bytes(cfg, 1, 2)["logits"]

    assert logits("model.vocab_size=1000", "train.precision=fp32") == 4 * 2 * 64 * 1024
    assert logits("model.vocab_size=1000", "train.precision=bf16") == 4 * 2 * 64 * 1024
    assert logits("model.vocab_size=1024", "train.precision=bf16") == 2 * 2 * 64 * 1024
    assert logits("model.vocab_size=1024", "train.precision=fp32") == 0


def test_context_parallelism_keeps_the_whole_rows_k_and_v():
    """6.7B at 32k tokens with TP=2, CP=2: 2 (K, V) x 2 B x 32 KV heads / 2 x 128 x 32,768 tokens x 32
    layers = 8 GiB, counted in the activations; selective checkpointing recomputes the gather."""
    from goat_dist.plan.memory import activation_bytes

    path = ROOT / "configs/models/goat_6.7b.yaml"
    over = ["parallel.cp=2", "model.seq_len=32768", "train.micro_batch_size=1"]
    over += ["parallel.tp=2", "train.activation_checkpointing=none"]  # not the config's TP 4, selective
    act = activation_bytes(load_config(path, over), 1)
    assert act["cp_kv"] == 8 * 2**30
    assert act["total"] > act["cp_kv"] and act["layers"] > act["cp_kv"]
    assert activation_bytes(load_config(path, over[1:]), 1)["cp_kv"] == 0
    selective = load_config(path, [*over, "train.activation_checkpointing=selective"])
    assert activation_bytes(selective, 1)["cp_kv"] == 0


def test_checkpoint_figures():
    """12 B per parameter of every TP slice; each rank writes its share (the busiest rank: rounded-up
    partitions) and a node its ranks'; a sync save holds one tensor at a time, an async one the share."""
    from goat_dist.plan.checkpoint import SAVE_OVERHEAD_S, checkpoint_cost

    path = ROOT / "configs/models/goat_30b.yaml"
    for stage in range(4):
        cfg = load_config(path, ["parallel.tp=8", f"parallel.zero_stage={stage}"])  # DP 16 at 128 GPUs
        c = checkpoint_cost(cfg, world=128, gpus_per_node=8, fs_gbps=10)
        inv = param_inventory(cfg.model, 8)
        slice_params = sum(p.numel for p in inv)
        assert c["bytes"] == pytest.approx(12 * 8 * slice_params, rel=1e-3)
        assert c["bytes_per_rank"] == pytest.approx(c["bytes"] / 128, rel=1e-3)
        assert c["bytes_per_node"] == 8 * c["bytes_per_rank"]
        assert c["host_async_per_node"] == pytest.approx(c["bytes_per_node"], rel=1e-3)
        largest = max(p.numel for p in inv)  # the embedding's TP slice, smaller than a ZeRO-1/2 partition
        piece = largest if stage in (1, 2) else -(-largest // 16)  # ZeRO 0, 3: its share over DP 16
        assert c["host_sync_per_node"] == 8 * 4 * piece
        assert c["save_s"] == pytest.approx(c["bytes"] / 10e9 + SAVE_OVERHEAD_S)
    cp = checkpoint_cost(load_config(path, ["parallel.tp=8", "parallel.cp=2"]), world=128, gpus_per_node=8)
    assert cp["bytes_per_rank"] == pytest.approx(c["bytes"] / 128, rel=1e-3)  # CP ranks share it too
    with pytest.raises(ValueError, match="--fs-gbps must be > 0"):
        checkpoint_cost(cfg, 128, 8, fs_gbps=0)
    from goat_dist.trainer import deadline

    assert SAVE_OVERHEAD_S == deadline.SAVE_OVERHEAD_S  # the planner's overhead is the deadline's


def test_plan_prints_the_checkpoint_and_takes_fs_gbps(capsys):
    import json

    from goat_dist.cli import build_parser

    config = str(ROOT / "configs/models/goat_30b.yaml")
    argv = ["plan", "--config", config, "--nodes", "16"]
    args = build_parser().parse_args([*argv, "--json", "--fs-gbps", "20"])
    assert args.func(args) == 0
    plan = json.loads(capsys.readouterr().out)
    c = plan["checkpoint"]
    assert c["fs_gbps"] == 20 and c["save_s"] == pytest.approx(c["bytes"] / 20e9 + 5.0)
    assert 350e9 < c["bytes"] < 370e9 and c["bytes_per_node"] == pytest.approx(c["bytes"] / 16, rel=1e-3)
    args = build_parser().parse_args(argv)
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert f"checkpoint   {c['bytes'] / 1e9:.2f} GB" in text
    assert f"{c['bytes_per_rank'] / 1e9:.2f} GB per rank, {c['bytes_per_node'] / 1e9:.2f} GB per node" in text
    assert "host memory per node for a save: sync" in text and "async" in text
    assert f"save ~{c['bytes'] / 10e9 + 5.0:.1f} s at 10 GB/s" in text  # the default bandwidth
    bad = build_parser().parse_args([*argv, "--fs-gbps", "-1"])
    assert bad.func(bad) == 2 and "--fs-gbps must be > 0" in capsys.readouterr().err
