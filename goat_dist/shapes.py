"""The model's shapes, from its config alone: the one place their arithmetic is written.

Padded vocabulary, FFN width, GOAT's prior lanes and the q/k content width they leave, the fused q/k/v width
(and which of its rows a full-width draw keeps, ``qkv_row_spans``), and every parameter's name and TP-local
shape (``param_inventory``) in ``model.GPT``'s own ``named_parameters`` order. The model builds its layers
from these numbers, and the planner, the doctor, the FLOP count and the HF export size their figures with
them, so none of those needs megatron or torch to know how large the model is
(``tests/unit/core/test_shapes.py``
checks them against a built model).

The standard library only (``goat_dist.config``'s types for annotations): importable where no torch is,
and by ``config`` itself.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import ModelConfig

KEY_BIAS_LANES = 3  # lanes of the split per-key value u(j), exact in bf16/fp16: goat.exact.SPLIT_PARTS
FP32_KEY_BIAS_LANES = 1  # one fp32 lane already holds u(j) to fp32's precision: the reference's 2R+1
KEY_BIAS_LANE_CHOICES = ("auto", FP32_KEY_BIAS_LANES, KEY_BIAS_LANES)  # model.goat.key_bias_lanes
SINK_HIDDEN = 4  # goat.prior.SinkMLP's hidden width


def padded_vocab_size(vocab_size: int, multiple: int, tp: int) -> int:
    """Round the vocabulary up to ``multiple`` (and, only if needed, to ``multiple * tp``) so every TP
    rank holds an equal slice; the same size for every TP size whenever possible, so checkpoints and
    initial weights do not depend on the layout."""
    padded = math.ceil(vocab_size / multiple) * multiple
    if padded % tp:
        padded = math.ceil(vocab_size / (multiple * tp)) * multiple * tp
    return padded


def ffn_size(cfg: ModelConfig) -> int:
    """The MLP's hidden width: ``model.ffn_hidden_size``, else 4h (GELU) or 8h/3 rounded up to 64 (SwiGLU)."""
    if cfg.ffn_hidden_size:
        return cfg.ffn_hidden_size
    if cfg.activation == "gelu":
        return 4 * cfg.hidden_size
    return 64 * math.ceil(8 * cfg.hidden_size / 3 / 64)


def prior_lane_count(pos_rank: int, key_bias: bool, key_lanes: int = KEY_BIAS_LANES) -> int:
    """Lanes the prior takes from each q/k head: 2R spectral, plus ``key_lanes`` for the per-key value
    u(j) (3: split into parts exact in bf16/fp16; 1: one lane, exact in fp32 only)."""
    return 2 * pos_rank + (key_lanes if key_bias else 0)


def key_lanes_for(precision: str) -> int:
    """What ``model.goat.key_bias_lanes=auto`` means under ``train.precision``: 1 for fp32 (the split's
    extra parts would be identically zero there: two content dims lost per head for nothing), else 3.
    ``auto`` precision counts as bf16, what it means on CUDA (the planner's assumption); the trainer
    resolves the precision first, so a CPU run gets fp32's count."""
    return FP32_KEY_BIAS_LANES if precision == "fp32" else KEY_BIAS_LANES


def key_bias_lanes(goat) -> int:
    """The lanes u(j) takes (``goat``: a ``GoatConfig``): ``model.goat.key_bias_lanes``, or 3 while it is
    still ``auto`` (no precision known: a model built outside a run, or a checkpoint saved before the
    key existed, which had 3); exact in every dtype, so an unresolved config never builds a model that
    is wrong in bf16."""
    value = goat.key_bias_lanes
    return KEY_BIAS_LANES if value == "auto" else int(value)


def resolve_key_bias_lanes(cfg: ModelConfig, precision: str) -> int:
    """Fix ``cfg.goat.key_bias_lanes`` for a run of ``precision`` (``auto`` -> ``key_lanes_for``); a
    concrete value is kept. Called once the precision is known, before the model is built, so the saved
    config (and every checkpoint's) records the count its tensors were built with."""
    if cfg.goat.key_bias_lanes == "auto":
        cfg.goat.key_bias_lanes = key_lanes_for(precision)
    return int(cfg.goat.key_bias_lanes)


def goat_lane_count(cfg: ModelConfig) -> int:
    """Lanes GOAT's prior takes from each q/k head of ``cfg`` (2R+3, or 2R+1 with one u(j) lane)."""
    g = cfg.goat
    return prior_lane_count(g.pos_rank, g.key_bias, key_bias_lanes(g))


def head_dims(cfg: ModelConfig) -> tuple[int, int, int, int]:
    """(heads, kv heads, head dim, q/k content dims): GOAT's prior takes ``goat_lane_count`` lanes of each
    q/k head."""
    heads, kv = cfg.num_heads, cfg.num_kv_heads or cfg.num_heads
    head_dim = cfg.hidden_size // heads
    content = head_dim
    if cfg.position == "goat":
        content = head_dim - goat_lane_count(cfg)
    return heads, kv, head_dim, content


def grouped_qkv_width(num_kv_heads: int, group: int, content_dim: int, head_dim: int) -> int:
    """Columns of the fused q/k/v projection: per KV head, ``group`` queries and one key of
    ``content_dim`` each, and one value of the full ``head_dim``."""
    return num_kv_heads * ((group + 1) * content_dim + head_dim)


def qkv_row_spans(
    num_kv_heads: int, group: int, content_dim: int, head_dim: int
) -> list[tuple[int, int, int]]:
    """Where the rows of a fused q/k/v projection (``grouped_qkv_width`` layout) sit in the same
    projection at the full head width (``content_dim == head_dim``): ``(row, full-width row, count)``
    runs, adjacent runs merged. Each q/k head keeps its first ``content_dim`` rows (GOAT's lanes are the
    rest, as in the reference, which projects the full head and drops the lanes), every v row is kept.

    Why: the initial weights are drawn at the full width and these rows kept, so every position scheme
    starts from the same q/k/v values (``model.gpt.init_shards_``); GOAT differs only by its prior."""
    spans: list[tuple[int, int, int]] = []
    row = full = 0
    for _ in range(num_kv_heads):
        for count in [content_dim] * (group + 1) + [head_dim]:
            last = spans[-1] if spans else None
            if last and last[0] + last[2] == row and last[1] + last[2] == full:
                spans[-1] = (last[0], last[1], last[2] + count)
            else:
                spans.append((row, full, count))
            row, full = row + count, full + head_dim
    return spans


def qkv_width(cfg: ModelConfig) -> int:
    """Columns of the fused q/k/v projection (TP = 1): per KV group, q and k content dims and a full v."""
    heads, kv, head_dim, content = head_dims(cfg)
    return grouped_qkv_width(kv, heads // kv, content, head_dim)


@dataclass(frozen=True)
class ParamSpec:
    """One parameter as a TP rank holds it: its local shape, optimizer group and whether TP splits it."""

    name: str
    shape: tuple[int, ...]
    group: str  # decay | no_decay | prior (optim.param_groups)
    tp_split: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _norm(prefix: str, cfg: ModelConfig) -> list[ParamSpec]:
    out = [ParamSpec(f"{prefix}.weight", (cfg.hidden_size,), "no_decay", False)]
    if cfg.norm == "layernorm" and cfg.bias:
        out.append(ParamSpec(f"{prefix}.bias", (cfg.hidden_size,), "no_decay", False))
    return out


def _linear(
    prefix: str, out_features: int, in_features: int, bias: bool, bias_split: bool
) -> list[ParamSpec]:
    out = [ParamSpec(f"{prefix}.weight", (out_features, in_features), "decay", True)]
    if bias:
        out.append(ParamSpec(f"{prefix}.bias", (out_features,), "no_decay", bias_split))
    return out


def _prior(prefix: str, cfg: ModelConfig, kv: int) -> list[ParamSpec]:
    """GOAT's prior (``goat.prior.GoatPrior``) over ``kv`` KV heads, in its registration order."""
    g, out = cfg.goat, []
    if g.pos_rank > 0:  # pos_rank 0 / abs_rank 0: the prior has no K_rel / no sink MLP at all
        out += [ParamSpec(f"{prefix}.lambda_sym", (kv, g.pos_rank), "prior", True),
                ParamSpec(f"{prefix}.lambda_asym", (kv, g.pos_rank), "prior", True)]  # fmt: skip
    if g.key_bias and g.abs_rank > 0:
        out += [ParamSpec(f"{prefix}.sink_gain", (kv,), "prior", True)]
    if g.key_bias:
        out += [
            ParamSpec(f"{prefix}.sink_bump", (kv,), "prior", True),
            ParamSpec(f"{prefix}.recency_slope_raw", (kv,), "prior", True),
        ]
    if g.key_bias and g.abs_rank > 0:
        features = 2 * g.abs_rank + 2
        out += [
            ParamSpec(f"{prefix}.sink_mlp.fc1.weight", (SINK_HIDDEN, features), "prior", False),
            ParamSpec(f"{prefix}.sink_mlp.fc1.bias", (SINK_HIDDEN,), "prior", False),
            ParamSpec(f"{prefix}.sink_mlp.fc2.weight", (1, SINK_HIDDEN), "prior", False),
            ParamSpec(f"{prefix}.sink_mlp.fc2.bias", (1,), "prior", False),
        ]
    return out


def _inventory(cfg: ModelConfig, vocab_tp: int, split: int) -> list[ParamSpec]:
    """The parameters with the vocabulary padded for TP = ``vocab_tp`` and TP-split dims divided by
    ``split`` (``vocab_tp`` for one rank's shapes, 1 for the whole model's)."""
    h, heads = cfg.hidden_size, cfg.num_heads
    _, kv, head_dim, _ = head_dims(cfg)
    vocab = padded_vocab_size(cfg.vocab_size, cfg.vocab_pad_multiple, vocab_tp)
    ffn = ffn_size(cfg)
    fc1 = 2 * ffn if cfg.activation == "swiglu" else ffn
    out = [ParamSpec("embedding.weight", (vocab // split, h), "decay", True)]
    if cfg.position == "learned":
        out.append(ParamSpec("pos_embedding.weight", (cfg.seq_len, h), "decay", False))
    for i in range(cfg.num_layers):
        b = f"blocks.{i}"
        out += _norm(f"{b}.attn_norm", cfg)
        if cfg.position == "goat":
            out += _prior(f"{b}.attn.prior", cfg, kv // split)
        out += _linear(f"{b}.attn.qkv", qkv_width(cfg) // split, h, cfg.bias, True)
        out += _linear(f"{b}.attn.proj", h, heads * head_dim // split, cfg.bias, False)
        out += _norm(f"{b}.mlp_norm", cfg)
        out += _linear(f"{b}.mlp.fc1", fc1 // split, h, cfg.bias, True)
        out += _linear(f"{b}.mlp.fc2", h, ffn // split, cfg.bias, False)
    out += _norm("final_norm", cfg)
    if not cfg.tie_embeddings:
        out.append(ParamSpec("output.weight", (vocab // split, h), "decay", True))
    return out


def param_inventory(cfg: ModelConfig, tp: int = 1) -> list[ParamSpec]:
    """Every parameter of ``model.GPT`` on one TP rank (all TP ranks hold the same shapes), in the
    model's own ``named_parameters`` order."""
    return _inventory(cfg, tp, tp)


def total_params(cfg: ModelConfig, tp: int = 1) -> int:
    """The model's parameter count, embeddings and vocabulary padding included: every TP-split parameter
    whole, every replicated one once, with the vocabulary padded as for ``tp`` ranks (TP = 1 by default)."""
    return sum(p.numel for p in _inventory(cfg, tp, 1))


def block_params(cfg: ModelConfig) -> int:
    """Parameters of one transformer block (TP = 1 shapes), the GOAT prior included."""
    one_block = _inventory(dataclasses.replace(cfg, num_layers=1), 1, 1)
    return sum(p.numel for p in one_block if p.name.startswith("blocks."))


def non_embedding_params(cfg: ModelConfig) -> int:
    """N: all blocks plus the final norm; the token and position embeddings and the output matrix
    excluded."""
    embeddings = ("embedding.weight", "pos_embedding.weight", "output.weight")
    return sum(p.numel for p in _inventory(cfg, 1, 1) if p.name not in embeddings)
