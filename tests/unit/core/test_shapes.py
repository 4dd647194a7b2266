"""``goat_dist.shapes`` against sources that do not use it: the parameters and lanes of a built ``GPT``,
and counts done by hand. A wrong formula fails here whichever caller it would have misled."""

from __future__ import annotations

import math
import sys

import pytest

from goat_dist import shapes
from goat_dist.config import ConfigError, load_config

SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.vocab_size=1000",
         "model.seq_len=32"]  # fmt: skip
VARIANTS = {
    "goat": ["model.position=goat"],
    "goat-gqa-no-sink": ["model.position=goat", "model.num_kv_heads=2", "model.goat.abs_rank=0"],
    "goat-no-key-bias": ["model.position=goat", "model.goat.key_bias=false", "model.goat.pos_rank=2"],
    "goat-no-spectral": ["model.position=goat", "model.goat.pos_rank=0"],
    "goat-one-key-lane": ["model.position=goat", "model.num_kv_heads=2", "model.goat.key_bias_lanes=1"],
    "rope-gelu-layernorm": [
        "model.position=rope",
        "model.activation=gelu",
        "model.norm=layernorm",
        "model.bias=true",
        "model.tie_embeddings=false",
    ],  # fmt: skip
    "learned-ffn": ["model.position=learned", "model.ffn_hidden_size=200", "model.num_kv_heads=1"],
    "alibi": ["model.position=alibi"],
}


def config(variant: str):
    return load_config(None, [*SMALL, *VARIANTS[variant]]).model


def built(cfg):
    from goat_dist.model import GPT

    return GPT(cfg)


# ---- hand counts ------------------------------------------------------------------------------------------
def test_shapes_needs_neither_torch_nor_megatron():
    """Read as text: the module imports only the standard library and goat_dist.config."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(shapes))
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported - {"", "config", "__future__"} <= set(sys.stdlib_module_names), imported


@pytest.mark.parametrize(
    "vocab, multiple, tp, expected",
    [
        (1000, 128, 1, 1024),
        (1000, 128, 2, 1024),  # 1024 splits in two: the same size as TP = 1
        (1000, 128, 3, 1152),  # 1024 does not split in three: 3 x 384
        (1024, 128, 8, 1024),
        (50257, 128, 1, 50304),
        (50257, 128, 6, 50304),  # 6 x 8384
        (50257, 128, 5, 50560),  # 50304 does not split in five: 79 x 640
        (7, 1, 4, 8),
    ],
)
def test_padded_vocab_size_by_hand(vocab, multiple, tp, expected):
    assert shapes.padded_vocab_size(vocab, multiple, tp) == expected


def test_ffn_size_by_hand():
    swiglu = load_config(None, ["model.hidden_size=128", "model.activation=swiglu"]).model
    assert shapes.ffn_size(swiglu) == 384  # 8 * 128 / 3 = 341.3, rounded up to a multiple of 64
    gelu = load_config(None, ["model.hidden_size=128", "model.activation=gelu"]).model
    assert shapes.ffn_size(gelu) == 512
    fixed = load_config(None, ["model.hidden_size=128", "model.ffn_hidden_size=200"]).model
    assert shapes.ffn_size(fixed) == 200


def test_prior_lane_count_by_hand():
    assert shapes.prior_lane_count(4, True) == 11  # 2R spectral + 3 parts of u(j)
    assert shapes.prior_lane_count(4, False) == 8
    assert shapes.prior_lane_count(0, True) == 3
    assert shapes.prior_lane_count(0, False) == 0
    assert shapes.prior_lane_count(4, True, 1) == 9  # one u(j) lane: the reference's 2R+1
    assert shapes.prior_lane_count(4, False, 1) == 8


def test_key_bias_lanes_auto_follows_the_precision():
    """auto: 1 lane under fp32 (the split's other parts are identically zero there), 3 under bf16 and
    under precision auto (what it means on CUDA); unresolved, a config builds the 3 exact everywhere."""
    assert [shapes.key_lanes_for(p) for p in ("fp32", "bf16", "auto")] == [1, 3, 3]
    cfg = load_config(None, ["model.hidden_size=64", "model.num_heads=4"]).model
    assert cfg.goat.key_bias_lanes == "auto" and shapes.key_bias_lanes(cfg.goat) == 3
    assert shapes.head_dims(cfg) == (4, 4, 16, 16 - 11)
    assert shapes.resolve_key_bias_lanes(cfg, "fp32") == 1 == cfg.goat.key_bias_lanes
    assert shapes.head_dims(cfg) == (4, 4, 16, 16 - 9)
    assert shapes.resolve_key_bias_lanes(cfg, "bf16") == 1  # resolved once: a concrete value is kept
    fixed = load_config(None, ["model.goat.key_bias_lanes=3"]).model
    assert shapes.resolve_key_bias_lanes(fixed, "fp32") == 3
    with pytest.raises(ConfigError, match="model.goat.key_bias_lanes"):
        load_config(None, ["model.goat.key_bias_lanes=2"])


def test_qkv_row_spans_by_hand():
    """GOAT's fused q/k/v rows within the full-width one (content rows first in every q/k head)."""
    # 2 KV groups of 2 queries, content 5 of head 8: per group q0 q1 k at 0, 8, 16 and v at 24-31
    assert shapes.qkv_row_spans(2, 2, 5, 8) == [
        (0, 0, 5), (5, 8, 5), (10, 16, 5), (15, 24, 13),  # group 0's v and group 1's first q are adjacent
        (28, 40, 5), (33, 48, 5), (38, 56, 8),
    ]  # fmt: skip
    assert shapes.qkv_row_spans(3, 1, 8, 8) == [(0, 0, 72)]  # no lanes: the identity


def test_qkv_widths_by_hand():
    # 2 KV heads of 4 queries each, 5 content dims per q/k head, 8 per v head: 2 * (4 * 5 + 5 + 8)
    assert shapes.grouped_qkv_width(2, 4, 5, 8) == 66
    cfg = load_config(None, ["model.hidden_size=64", "model.num_heads=4", "model.num_kv_heads=2",
                             "model.position=goat", "model.goat.pos_rank=2"]).model  # fmt: skip
    assert shapes.head_dims(cfg) == (4, 2, 16, 16 - 7)
    assert shapes.qkv_width(cfg) == 2 * (2 * 9 + 9 + 16)
    rope = load_config(None, ["model.hidden_size=64", "model.num_heads=4", "model.position=rope"]).model
    assert shapes.qkv_width(rope) == 3 * 64


def test_tp_shapes_split_only_what_tp_splits():
    cfg = config("rope-gelu-layernorm")
    whole, local = shapes.param_inventory(cfg, 1), shapes.param_inventory(cfg, 2)
    assert [p.name for p in whole] == [p.name for p in local]
    for w, part in zip(whole, local, strict=True):
        assert part.tp_split == w.tp_split
        assert part.numel * (2 if w.tp_split else 1) == w.numel, w.name
    assert shapes.total_params(cfg, 2) == shapes.total_params(cfg)  # 1024 rows split in two


def test_total_params_pads_the_vocabulary_for_tp():
    tied, untied = config("goat"), config("rope-gelu-layernorm")
    h = tied.hidden_size
    assert shapes.total_params(tied, 3) - shapes.total_params(tied) == (1152 - 1024) * h
    assert shapes.total_params(untied, 3) - shapes.total_params(untied) == 2 * (1152 - 1024) * h


# ---- the built model --------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_shapes_are_the_built_models(world1, variant):
    import torch

    cfg = config(variant)
    model = built(cfg)
    params = dict(model.named_parameters())
    assert [(p.name, p.shape) for p in shapes.param_inventory(cfg)] == [
        (name, tuple(p.shape)) for name, p in params.items()
    ]
    assert shapes.total_params(cfg) == sum(p.numel() for p in params.values())
    block = sum(p.numel() for name, p in params.items() if name.startswith("blocks.0."))
    assert shapes.block_params(cfg) == block
    embeddings = {"embedding.weight", "pos_embedding.weight", "output.weight"}
    assert shapes.non_embedding_params(cfg) == sum(
        p.numel() for n, p in params.items() if n not in embeddings
    )

    vocab = shapes.padded_vocab_size(cfg.vocab_size, cfg.vocab_pad_multiple, 1)
    assert params["embedding.weight"].shape[0] == vocab == model.padded_vocab
    ffn = shapes.ffn_size(cfg)
    assert params["blocks.0.mlp.fc2.weight"].shape == (cfg.hidden_size, ffn)
    fc1 = params["blocks.0.mlp.fc1.weight"].shape[0]
    assert fc1 == (2 * ffn if cfg.activation == "swiglu" else ffn)
    assert params["blocks.0.attn.qkv.weight"].shape[0] == shapes.qkv_width(cfg)

    attn = model.blocks[0].attn
    heads, kv, head_dim, content = shapes.head_dims(cfg)
    assert (head_dim, content) == (attn.head_dim, attn.content_dim)
    assert (
        shapes.grouped_qkv_width(kv, heads // kv, content, head_dim)
        == params["blocks.0.attn.qkv.weight"].shape[0]
    )
    if cfg.position == "goat":  # the lanes the prior really builds (in every dtype), counted off its output
        for dtype in (torch.float32, torch.bfloat16):
            q_lanes, k_lanes = attn.prior.lanes(torch.arange(8)[None], True, scale=1.0, dtype=dtype)
            lanes = shapes.goat_lane_count(cfg)
            assert q_lanes.shape[-1] == k_lanes.shape[-1] == lanes == head_dim - content
    for p in shapes.param_inventory(cfg):
        assert p.numel == math.prod(params[p.name].shape)


# ---- the lane count: resolved once, sized alike, kept across a start ------------------------------------
@pytest.mark.parametrize("precision,lanes", [("fp32", 1), ("bf16", 3), ("auto", 3)])
def test_planner_and_flops_size_the_lanes_the_run_builds(precision, lanes):
    """The planner resolves auto lanes as the trainer will under its precision (auto: bf16, on CUDA),
    on a copy; its parameter count and the FLOPs' dense term are those of that model."""
    import dataclasses

    from goat_dist.observe.flops import flops_per_token
    from goat_dist.plan.hardware import gpu
    from goat_dist.plan.planner import make_plan, planned_config

    cfg = load_config(None, [*SMALL, f"train.precision={precision}"])
    planned = planned_config(cfg)
    assert planned.model.goat.key_bias_lanes == lanes and cfg.model.goat.key_bias_lanes == "auto"
    model = dataclasses.replace(cfg.model, goat=dataclasses.replace(cfg.model.goat, key_bias_lanes=lanes))
    plan = make_plan(cfg, 1, 1, gpu("h100-80gb"))
    assert plan["params"] == shapes.total_params(model) == shapes.total_params(planned.model)
    assert flops_per_token(planned.model)["dense"] == 6 * shapes.non_embedding_params(model)


def _step_dir(tmp_path, lanes) -> object:
    """A checkpoint directory whose config.yaml has a GOAT model of ``lanes`` u(j) lanes (None: a
    checkpoint from before the key)."""
    import yaml

    step = tmp_path / f"step-{lanes}"
    step.mkdir()
    goat = {"pos_rank": 4} if lanes is None else {"pos_rank": 4, "key_bias_lanes": lanes}
    (step / "config.yaml").write_text(yaml.safe_dump({"model": {"position": "goat", "goat": goat}}))
    return step


def _run(precision: str, lanes="auto"):
    return load_config(None, [*SMALL, f"train.precision={precision}", f"model.goat.key_bias_lanes={lanes}"])


@pytest.mark.parametrize(
    "saved,precision,expected",
    [
        (None, "fp32", 3),
        (3, "fp32", 3),
        (1, "fp32", 1),
        (3, "bf16", 3),
        ("none", "fp32", 1),
        ("none", "bf16", 3),
    ],
)
def test_auto_keeps_a_checkpoints_lane_count_where_it_is_exact(tmp_path, saved, precision, expected):
    """A start from a checkpoint keeps its count where that is exact under the run's precision (3 in
    any, 1 in fp32; a checkpoint from before the key has 3); no checkpoint: the precision's count."""
    from goat_dist.checkpoint.extension import resolve_key_bias_lanes

    cfg = _run(precision)
    start = None if saved == "none" else _step_dir(tmp_path, saved)
    assert (
        resolve_key_bias_lanes(cfg, start, log=lambda *a: None) == expected == cfg.model.goat.key_bias_lanes
    )
    init = _run(precision)
    assert resolve_key_bias_lanes(init, None, start, log=lambda *a: None) == expected


@pytest.mark.parametrize(
    "saved,precision,given,why",
    [(1, "bf16", "auto", "auto under train.precision=bf16"), (3, "fp32", 1, "set in the config")],
)
def test_a_start_that_changes_the_lane_count_is_refused_by_name(tmp_path, saved, precision, given, why):
    """An fp32 (2R+1) checkpoint resumed under bf16 would get 2R+3 lanes (and the converse when the key
    says so): refused before the model is built, naming the key and both lane counts."""
    from goat_dist.checkpoint import CheckpointError
    from goat_dist.checkpoint.extension import resolve_key_bias_lanes

    step = _step_dir(tmp_path, saved)
    now = 3 if saved == 1 else 1  # the other count
    for purpose, args, where in (
        ("resume", (step,), "cannot resume from"),
        ("init", (None, step), "train.init_from="),
    ):
        with pytest.raises(CheckpointError) as caught:
            resolve_key_bias_lanes(_run(precision, given), *args, log=lambda *a: None)
        message = str(caught.value)
        assert message.startswith(where), (purpose, message)
        assert f"model.goat.key_bias_lanes is {saved} there ({8 + saved} = 2R+{saved}" in message
        assert f"and {now} here ({8 + now} = 2R+{now}, {why})" in message
        assert f"Set model.goat.key_bias_lanes={saved} to continue" in message
