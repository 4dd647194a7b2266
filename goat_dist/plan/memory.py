"""Per-rank memory of a training run, from the config alone: parameters, gradients, optimizer state
(per ZeRO stage, as DeepSpeed stores them) and activations (per micro-batch, as this model saves them).

Every term is documented, with its derivation, in ``docs/planner.md``; the parameter inventory is checked
name by name against the real model (``goat-dist plan --materialize``, ``tests/test_plan*.py``) and the
byte counts against DeepSpeed engines and saved-tensor hooks on CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..attention.prior import prior_lane_count
from ..config import Config, ModelConfig
from ..model.gpt import ffn_size, padded_vocab_size

SINK_HIDDEN = 4  # attention.prior.SinkMLP's hidden width


@dataclass(frozen=True)
class ParamSpec:
    """One parameter as a TP rank holds it: its local shape, optimizer group and whether TP splits it."""

    name: str
    shape: tuple[int, ...]
    group: str  # decay | no_decay | prior (trainer.optim.param_groups)
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


def head_dims(cfg: ModelConfig) -> tuple[int, int, int, int]:
    """(heads, kv heads, head dim, q/k content dims): GOAT's prior takes 2R+3 lanes of each q/k head."""
    heads, kv = cfg.num_heads, cfg.num_kv_heads or cfg.num_heads
    head_dim = cfg.hidden_size // heads
    content = head_dim
    if cfg.position == "goat":
        content = head_dim - prior_lane_count(cfg.goat.pos_rank, cfg.goat.key_bias)
    return heads, kv, head_dim, content


def qkv_width(cfg: ModelConfig) -> int:
    """Columns of the fused q/k/v projection (TP = 1): per KV group, q and k content dims and a full v."""
    heads, kv, head_dim, content = head_dims(cfg)
    return kv * ((heads // kv + 1) * content + head_dim)


def param_inventory(cfg: ModelConfig, tp: int = 1) -> list[ParamSpec]:
    """Every parameter of ``model.GPT`` on one TP rank (all TP ranks hold the same shapes), in the
    model's own ``named_parameters`` order."""
    h, heads = cfg.hidden_size, cfg.num_heads
    _, kv, head_dim, _ = head_dims(cfg)
    vocab = padded_vocab_size(cfg.vocab_size, cfg.vocab_pad_multiple, tp)
    ffn = ffn_size(cfg)
    fc1 = 2 * ffn if cfg.activation == "swiglu" else ffn
    out = [ParamSpec("embedding.weight", (vocab // tp, h), "decay", True)]
    if cfg.position == "learned":
        out.append(ParamSpec("pos_embedding.weight", (cfg.seq_len, h), "decay", False))
    for i in range(cfg.num_layers):
        b = f"blocks.{i}"
        out += _norm(f"{b}.attn_norm", cfg)
        if cfg.position == "goat":
            g, local_kv = cfg.goat, kv // tp
            p = f"{b}.attn.prior"
            out += [ParamSpec(f"{p}.lambda_sym", (local_kv, g.pos_rank), "prior", True),
                    ParamSpec(f"{p}.lambda_asym", (local_kv, g.pos_rank), "prior", True)]  # fmt: skip
            if g.key_bias:
                features = 2 * g.abs_rank + 2
                out += [
                    ParamSpec(f"{p}.sink_gain", (local_kv,), "prior", True),
                    ParamSpec(f"{p}.sink_bump", (local_kv,), "prior", True),
                    ParamSpec(f"{p}.recency_slope_raw", (local_kv,), "prior", True),
                    ParamSpec(f"{p}.sink_mlp.fc1.weight", (SINK_HIDDEN, features), "prior", False),
                    ParamSpec(f"{p}.sink_mlp.fc1.bias", (SINK_HIDDEN,), "prior", False),
                    ParamSpec(f"{p}.sink_mlp.fc2.weight", (1, SINK_HIDDEN), "prior", False),
                    ParamSpec(f"{p}.sink_mlp.fc2.bias", (1,), "prior", False),
                ]
        out += _linear(f"{b}.attn.qkv", qkv_width(cfg) // tp, h, cfg.bias, True)
        out += _linear(f"{b}.attn.proj", h, heads * head_dim // tp, cfg.bias, False)
        out += _norm(f"{b}.mlp_norm", cfg)
        out += _linear(f"{b}.mlp.fc1", fc1 // tp, h, cfg.bias, True)
        out += _linear(f"{b}.mlp.fc2", h, ffn // tp, cfg.bias, False)
    out += _norm("final_norm", cfg)
    if not cfg.tie_embeddings:
        out.append(ParamSpec("output.weight", (vocab // tp, h), "decay", True))
    return out


def total_params(cfg: ModelConfig) -> int:
    """The model's parameter count (TP = 1, embeddings included, vocabulary padding included)."""
    return sum(p.numel for p in param_inventory(cfg, 1))


# ---- parameters, gradients, optimizer state ----------------------------------------------------------
def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _flat_partition(numel: int, dp: int) -> int:
    """ZeRO-1/2: a group is flattened, padded to a multiple of ``dp`` (and of 2 elements, DeepSpeed's
    NCCL alignment) and split into ``dp`` equal partitions."""
    return _ceil_div(numel, 2 * dp) * 2


def state_bytes(cfg: Config, dp: int) -> dict[str, int]:
    """Per-rank bytes of parameters, gradients and optimizer state after a backward pass (the state a rank
    holds through a step), as DeepSpeed keeps them with torch AdamW, plus its communication buckets.

    ``bf16``: 2-byte working weights and gradients, fp32 master weights, fp32 Adam moments (DeepSpeed's
    bf16 mode); GOAT's prior keeps fp32 working weights under ZeRO 0-2. ``fp32``: no master copy at ZeRO-0
    (the optimizer steps the parameters), a flat fp32 copy per partition at ZeRO 1-3 (DeepSpeed clones it).
    """
    m, stage = cfg.model, cfg.parallel.zero_stage
    bf16 = cfg.train.precision == "bf16"
    w = 2 if bf16 else 4  # working weight / gradient bytes
    inv = param_inventory(m, cfg.parallel.tp)
    n = sum(p.numel for p in inv)
    prior = sum(p.numel for p in inv if p.group == "prior")
    # the prior's fp32 working copy (parallelize.py); under ZeRO-3 + bf16, its gathered fp32 values
    prior_extra = (4 - w) * prior if stage < 3 else (4 * prior if bf16 else 0)  # (zero3_prior.py)
    steps = 4 * len(inv)  # torch AdamW's per-parameter fp32 `step` tensors
    bucket = m.hidden_size**2 * w  # parallelize.deepspeed_config: reduce bucket of h^2 elements
    if stage == 0:
        params = w * n + prior_extra
        grads = params
        optimizer = (4 * n if bf16 else 0) + 8 * n + steps
        buffers = 0
    elif stage in (1, 2):
        groups: dict[str, int] = {}
        for p in inv:
            groups[p.group] = groups.get(p.group, 0) + p.numel
        part = sum(_flat_partition(size, dp) for size in groups.values())
        params = w * sum(_flat_partition(size, dp) * dp for size in groups.values()) + prior_extra
        grads = w * part  # the reduced gradient partition, in the gradient dtype
        optimizer = 12 * part + steps  # fp32 master partition + two fp32 moments
        buffers = bucket
    else:
        persistent = 10 * m.hidden_size  # stage3_param_persistence_threshold (parallelize.deepspeed_config)
        part = sum(_ceil_div(p.numel, dp) for p in inv)  # every parameter partitioned on its own
        kept = sum(p.numel for p in inv if p.numel <= persistent)  # small ones also kept whole
        params = w * (part + kept) + prior_extra
        grads = w * part
        optimizer = 12 * part + steps
        buffers = bucket
    total = params + grads + optimizer + buffers
    return {"params": params, "grads": grads, "optimizer": optimizer, "buffers": buffers, "total": total}


def transient_bytes(cfg: Config, dp: int, micro_batch: int) -> dict[str, int]:
    """Peaks on top of the steady state and the saved activations (not part of the validated state):

    * ``zero3_gather``: ZeRO-3 all-gathers a layer's weights for its forward/backward plus a prefetch
      bucket (0.9 h^2 elements);
    * ``fp32_grads``: bf16 mode creates fp32 gradients for the master copy at the step (all of them at
      ZeRO-0, the partition at ZeRO 1-3);
    * ``logits``: the 2-byte logits of the bf16 LM head live next to their fp32 copy during the loss;
    * ``recompute``: full activation checkpointing rebuilds one layer's activations during its backward.
    """
    m, stage = cfg.model, cfg.parallel.zero_stage
    bf16 = cfg.train.precision == "bf16"
    w = 2 if bf16 else 4
    tp = cfg.parallel.tp
    inv = param_inventory(m, tp)
    n = sum(p.numel for p in inv)
    layer = sum(p.numel for p in inv if p.name.startswith("blocks.0."))
    out = {"zero3_gather": 0, "fp32_grads": 0, "logits": 0, "recompute": 0}
    if stage == 3:
        out["zero3_gather"] = w * (layer + int(0.9 * m.hidden_size**2))
    if bf16:
        out["fp32_grads"] = 4 * (n if stage == 0 else _ceil_div(n, dp))
        vocab = padded_vocab_size(m.vocab_size, m.vocab_pad_multiple, tp) // tp
        out["logits"] = 2 * micro_batch * _seq_per_rank(cfg) * vocab
    if cfg.train.activation_checkpointing == "full":
        out["recompute"] = activation_bytes(cfg, micro_batch, recompute_layer=True)["per_layer"]
    out["total"] = sum(out.values())
    return out


# ---- activations ---------------------------------------------------------------------------------------
def _cp(cfg: Config) -> int:
    """Context-parallel size when the config has one (``parallel.cp``), else 1."""
    return int(getattr(cfg.parallel, "cp", 1) or 1)


def _seq_per_rank(cfg: Config) -> int:
    return cfg.model.seq_len // _cp(cfg)


def activation_bytes(cfg: Config, micro_batch: int, recompute_layer: bool = False) -> dict[str, int]:
    """Bytes saved for backward during one forward pass of ``micro_batch`` sequences on one rank.

    Korthikanti et al. (2022), eq. 1-5, redone for this model as it runs (pre-norm, no dropout masks,
    SwiGLU/GELU, GQA, GOAT lanes, a flash-style kernel that keeps no L x L matrix). Per layer and token,
    in elements (``a`` bytes each: 2 in bf16, 4 in fp32; fp32 terms stay 4 bytes), with t = TP and the
    sequence-parallel split ``t_sp`` = t under SP, else 1:

    * two RMSNorms: input and normalised input, in fp32 (torch's RMSNorm upcasts), ``2h / t_sp`` each, plus
      the fp32 rstd; LayerNorm: input (in fp32) and mean/rstd;
    * inputs of the q/k/v projection and of fc1: ``h / t_sp`` each (megatron keeps the un-gathered input);
    * the q/k/v projection's output ``W / t`` (kept alive because v is a view of it);
    * the kernel's q and k (content + prior lanes): ``(H + H_kv) D / t``; its output ``H D / t`` (also the
      projection's input); its log-sum-exp ``H / t`` (fp32);
    * SwiGLU: fc1's output ``2f / t``, silu(gate) ``f / t``, fc2's input ``f / t``; GELU: ``2f / t``;
    * GOAT: the per-position Fourier features and sink-MLP activations, fp32 and not split:
      ``2R + (2M + 2) + 4 + 4 + 1 + 1`` elements and a 1-byte BOS mask; RoPE: cos and sin, ``2D`` fp32.

    Outside the layers: the final norm, the LM head's input (gathered to the whole sequence when tied),
    the vocab-parallel softmax ``V / t`` in fp32 and the token/label ids. Under full checkpointing a layer
    keeps only its input ``h / t_sp``; selective checkpointing drops the kernel's q, k, output and lse and
    the lanes but keeps the projection output (the checkpoint's input) and the output.
    """
    m, tp = cfg.model, cfg.parallel.tp
    sp = cfg.parallel.sp
    bf16 = cfg.train.precision == "bf16"
    a = 2 if bf16 else 4
    tsp = tp if sp else 1
    tokens = micro_batch * _seq_per_rank(cfg)
    h = m.hidden_size
    heads, kv, head_dim, _ = head_dims(m)
    ffn = ffn_size(m)
    ac = cfg.train.activation_checkpointing
    if m.norm == "rmsnorm":  # one norm; a layer has two
        norm = 4 * (2 * h / tsp + 1 / tsp)
        norm_out = a  # the norm's output (the next linear's input) is in the activation dtype
    else:
        norm = 4 * (h / tsp + 2 / tsp)
        norm_out = 4 if bf16 else a  # autocast runs layer_norm in fp32: the next linear gets an fp32 input
    linear_in = norm_out * 2 * h / tsp
    qkv_out = a * qkv_width(m) / tp
    kernel = a * (heads + kv) * head_dim / tp + 4 * heads / tp
    kernel_out = a * heads * head_dim / tp
    mlp = a * (4 * ffn if m.activation == "swiglu" else 2 * ffn) / tp
    lanes = 0.0
    if m.position == "goat":
        g = m.goat
        lanes = 4 * 2 * g.pos_rank
        if g.key_bias:
            lanes += 4 * ((2 * g.abs_rank + 2) + 2 * SINK_HIDDEN + 1 + 1) + 1
    elif m.position == "rope":
        lanes = 4 * 2 * head_dim
    quadratic = 0.0
    if (m.position == "alibi" and m.attention_backend == "sdpa") or m.attention_backend == "eager":
        # an explicit (B, H, L, L) bias (ALiBi through SDPA) or fp32 logits (eager). ``auto`` plans for a
        # GPU, where it means flash-attn: no L x L tensor for any scheme (flash computes ALiBi itself).
        quadratic = 4 * heads / tp * _seq_per_rank(cfg) * (1 if m.attention_backend != "eager" else 2)
    full_layer = 2 * norm + linear_in + qkv_out + kernel + kernel_out + mlp + lanes + quadratic
    if ac == "full" and not recompute_layer:
        layer = a * h / tsp
    elif ac == "selective" and not recompute_layer:
        layer = 2 * norm + linear_in + qkv_out + kernel_out + mlp
    else:
        layer = full_layer
    vocab = padded_vocab_size(m.vocab_size, m.vocab_pad_multiple, tp)
    head_in = a * h / (tsp if not m.tie_embeddings else 1)
    final = norm + head_in + 4 * vocab / tp
    ids = 8 + 8 + 2 + (8 if ac != "none" else 0)  # token ids, targets, two masks; checkpointed: positions
    per_layer = int(layer * tokens)
    outside = int((final + ids) * tokens + vocab / tp)  # + the padding mask over the vocabulary slice
    total = m.num_layers * per_layer + outside
    return {"per_layer": per_layer, "layers": m.num_layers * per_layer, "outside": outside, "total": total}
