"""A decoder-only GPT made of megatron-core tensor-parallel layers.

Read top to bottom: embedding -> N x (pre-norm attention, pre-norm MLP) -> final norm -> vocab-parallel
logits -> vocab-parallel cross-entropy. Activations between blocks are ``[s, b, h]``; under sequence
parallelism each TP rank holds ``s / tp`` of them.

The model is built plain for its ``distributed.Layout`` (its TP group: the megatron layers' shards and
collectives); ``parallel.parallelize`` (``parallel/model_parallel.py``) then applies sequence
parallelism's scatter/gather, the context-parallel split, activation checkpointing and compilation. The
forward reads no process state: every group it uses was handed to it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.model_parallel_config import ModelParallelConfig
from torch import nn

from ..config import ModelConfig
from ..data.loader import IGNORE_INDEX  # label of tokens that carry no loss
from ..distributed import Layout, current_layout
from ..kernels import document_segments
from ..parallel.context import ContextShard
from ..parallel.model_parallel import plain_call
from ..shapes import ffn_size, padded_vocab_size
from .attention import ParallelSelfAttention
from .compile import ColumnParallelLinear, RowParallelLinear, compiled_block_forward
from .loss import vocab_parallel_cross_entropy

if TYPE_CHECKING:
    from ..parallel.context import ContextParallel
    from ..parallel.model_parallel import FirstPassClock

__all__ = ["GPT", "ffn_size", "init_shard_", "init_shards_", "padded_vocab_size"]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _not_scattered(x: torch.Tensor) -> torch.Tensor:
    raise RuntimeError(
        "this GPT was built for sequence parallelism (sequence_parallel=True) and has not been set up to "
        "run with it: parallel.parallelize (or parallel.model_parallel.apply) adds the scatter"
    )


def make_norm(cfg: ModelConfig, sequence_parallel: bool) -> nn.Module:
    norm = (
        nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        if cfg.norm == "rmsnorm"
        else nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps, bias=cfg.bias)
    )
    for p in norm.parameters():
        p.sequence_parallel = sequence_parallel  # replicated; grads summed over TP under SP
    return norm


class ParallelMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, mp_config, init_method, output_init_method, tp_group):
        super().__init__()
        self.swiglu = cfg.activation == "swiglu"
        ffn = ffn_size(cfg)
        # SwiGLU's gate and up projections are one fused matrix; stride 2 gives each rank the matching
        # slices of both, so the split (and the initial weights) are the same for any TP size.
        self.fc1 = ColumnParallelLinear(
            cfg.hidden_size,
            2 * ffn if self.swiglu else ffn,
            config=mp_config,
            init_method=init_method,
            bias=cfg.bias,
            gather_output=False,
            stride=2 if self.swiglu else 1,
            tp_group=tp_group,
        )
        self.fc1.weight_stride = 2 if self.swiglu else 1  # megatron keeps it only in its own init
        self.fc2 = RowParallelLinear(
            ffn,
            cfg.hidden_size,
            config=mp_config,
            init_method=output_init_method,
            bias=cfg.bias,
            input_is_parallel=True,
            skip_bias_add=False,
            tp_group=tp_group,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.fc1(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        out, _ = self.fc2(h)
        return out


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, mp_config, init_method, output_init_method, tp_group):
        super().__init__()
        sp = mp_config.sequence_parallel
        self.attn_norm = make_norm(cfg, sp)
        self.attn = ParallelSelfAttention(cfg, mp_config, init_method, output_init_method, tp_group)
        self.mlp_norm = make_norm(cfg, sp)
        self.mlp = ParallelMLP(cfg, mp_config, init_method, output_init_method, tp_group)
        self.dropout = nn.Dropout(cfg.dropout)
        self.compiled = False  # model.compile: training forwards run compiled (``model/compile.py``)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, segments=None, shard=None) -> torch.Tensor:
        if self.compiled and self.training:
            return compiled_block_forward(self, x, position_ids, segments, shard)
        return self.layers(x, position_ids, segments, shard)

    def layers(self, x: torch.Tensor, position_ids: torch.Tensor, segments=None, shard=None) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x), position_ids, segments, shard=shard))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


SHARD_BLOCK = 64  # rows (columns of a row-parallel weight) per independently seeded block


def _block_seed(base: int, index: int, block: int) -> int:
    return (base * 0x9E3779B1 + index * 0x85EBCA77 + block * 0xC2B2AE3D) % 2**62


def _fill_normal_span_(out, dim: int, full: int, start: int, std: float, seeds) -> None:
    """Fill ``out`` with elements [start, start + out.shape[dim]) along ``dim`` of a full N(0, std) tensor
    that is cut into blocks of SHARD_BLOCK along ``dim``, each drawn from its own seed (``seeds(block)``):
    only the blocks that the span covers are drawn, one at a time, so the only memory besides ``out`` is
    one block (a construction that holds one layer at a time stays that small)."""
    length = out.shape[dim]
    first, last = start // SHARD_BLOCK, (start + length - 1) // SHARD_BLOCK
    gen = torch.Generator(device=out.device)
    for block in range(first, last + 1):
        shape = list(out.shape)
        shape[dim] = min(SHARD_BLOCK, full - block * SHARD_BLOCK)
        gen.manual_seed(seeds(block))
        drawn = torch.empty(shape, dtype=out.dtype, device=out.device).normal_(0, std, generator=gen)
        lo, hi = max(start, block * SHARD_BLOCK), min(start + length, block * SHARD_BLOCK + shape[dim])
        out.narrow(dim, lo - start, hi - lo).copy_(drawn.narrow(dim, lo - block * SHARD_BLOCK, hi - lo))


@torch.no_grad()
def init_shard_(
    weight: nn.Parameter, std: float, dim: int, stride: int, seeds, tp: int, rank: int, full_width_rows=None
) -> None:
    """Fill this rank's TP shard of a weight split along ``dim`` (megatron's ``stride``-interleaved
    split) with the values the whole weight would have at any TP size: every value depends only on its
    global position (``_fill_normal_span_``), and a rank draws only its own shard, on the weight's device,
    in place.

    ``full_width_rows`` (dim 0, stride 1: GOAT's fused q/k/v): ``(rows, spans)``, the shard's row count
    at the full head width and ``shapes.qkv_row_spans``; the shard then holds those rows of the
    full-width weight, so its values are the other position schemes' (and still TP-independent: a rank
    owns whole KV groups, so its full-width rows are the rank-th slice of the full-width weight).
    ``tp``, ``rank``: the TP size and this rank's place in it."""
    if weight.device.type == "meta":  # shapes only (the planner's dry run): nothing to draw
        if not hasattr(weight, "tensor_model_parallel"):
            tensor_parallel.set_tensor_model_parallel_attributes(weight, True, dim, stride)
        return
    if full_width_rows is not None:
        assert dim == 0 and stride == 1, (dim, stride)
        rows, spans = full_width_rows
        for row, wide, count in spans:  # one run of kept rows at a time: no full-width copy is held
            _fill_normal_span_(weight.narrow(0, row, count), 0, rows * tp, rank * rows + wide, std, seeds)
    else:
        full = weight.shape[dim] * tp
        chunk = full // (tp * stride)  # megatron's split: rank r holds chunks r, r + tp, ... of the weight
        for s in range(stride):
            piece = weight.narrow(dim, s * chunk, chunk)
            _fill_normal_span_(piece, dim, full, (s * tp + rank) * chunk, std, seeds)
    if not hasattr(weight, "tensor_model_parallel"):
        tensor_parallel.set_tensor_model_parallel_attributes(weight, True, dim, stride)


def init_shards_(
    part: nn.Module, base_seed: int, std: float, out_std: float, index: int, tp: int, tp_rank: int
) -> int:
    """Initialise the megatron TP layers of ``part``, each rank only its shards, to the same values for
    every TP size (``init_shard_``): N(0, std), N(0, out_std) for the output projections of the residual
    branches (the row-parallel layers), zero biases. The fused q/k/v is drawn at the full head width
    (``full_width_rows``), so the position schemes share every weight but GOAT's prior. Layers are
    numbered in module order from ``index`` (the same at every TP size, and the same whether the model is
    initialised whole or part by part); returns the next number."""
    layers = (tensor_parallel.VocabParallelEmbedding, tensor_parallel.ColumnParallelLinear)
    for module in part.modules():
        row = isinstance(module, tensor_parallel.RowParallelLinear)
        if not (row or isinstance(module, layers)):
            continue
        stride = getattr(module, "weight_stride", 1)
        seeds = lambda block, index=index: _block_seed(base_seed, index, block)
        wide = getattr(module, "full_width_rows", None)
        init_shard_(module.weight, out_std if row else std, 1 if row else 0, stride, seeds, tp, tp_rank, wide)
        if getattr(module, "bias", None) is not None:
            with torch.no_grad():
                module.bias.zero_()
        index += 1
    return index


class _Parts:
    """Finishes the model part by part: initialises each part's TP shards (numbering its layers after the
    previous parts') and hands it to ``built``."""

    def __init__(self, base_seed: int, std: float, out_std: float, built, tp: int, tp_rank: int):
        self.base_seed, self.std, self.out_std, self.built = base_seed, std, out_std, built
        self.tp, self.tp_rank = tp, tp_rank
        self.index = 0

    def done(self, part: nn.Module) -> nn.Module:
        self.index = init_shards_(
            part, self.base_seed, self.std, self.out_std, self.index, self.tp, self.tp_rank
        )
        if self.built is not None:
            self.built(part)
        return part


class GPT(nn.Module):
    """The decoder, built for one layout's TP group; run in parallel by ``parallel.parallelize``.

    Set at construction and read by the forward (``parallel.model_parallel.apply`` replaces the parallel
    ones): ``into_sequence_region`` (the embeddings into the blocks' region: the SP scatter),
    ``tied_output_input`` (a tied output layer's input: the SP gather, else the copy into the TP region),
    ``block_call`` (how a block runs: plain or recomputed), ``context`` (context parallelism, None
    without), ``compile_clock`` (times the first compiled pass, None without compilation)."""

    layout: Layout
    tp_group: object  # the TP process group every TP collective of this model runs on
    into_sequence_region: Callable[[torch.Tensor], torch.Tensor]
    tied_output_input: Callable[[torch.Tensor], torch.Tensor]
    block_call: Callable
    context: ContextParallel | None
    compile_clock: FirstPassClock | None
    activation_checkpointing: str

    def __init__(
        self,
        cfg: ModelConfig,
        layout: Layout | None = None,
        sequence_parallel: bool = False,
        built=None,
        documents: bool = True,
    ):
        """``layout``: the process groups the model is split over and communicates on (its TP group);
        None: this process's (``distributed.current_layout``).

        ``sequence_parallel``: megatron's TP layers are built for sequence parallelism (their gathers and
        reduce-scatters); ``parallel.parallelize`` adds the scatter before the blocks, without which such a
        model refuses to run.

        ``built``: called with each part of the model (the embedding, the learned positions, every block,
        the final norm, the output layer; together every parameter), in module order, once that part is
        built and initialised and before the next one is built. A training engine that partitions the
        parameters over data-parallel ranks takes them there (``engine.construct``), so a rank never holds
        more than its partitions plus one part's whole tensors. The values do not depend on it.

        ``documents``: whether positions may restart inside a row (packed documents,
        ``data.document_masking``). The forward then finds the documents, which reads the positions on
        the host once per micro-batch (``kernels.document_segments``); False skips that and its sync:
        every row is one sequence."""
        super().__init__()
        layout = current_layout() if layout is None else layout
        tp, tp_rank, tp_group = layout.tp, layout.tp_rank, layout.tp_group
        # from the global seed, identical on every rank; on the CPU generator also when the model is built
        # under a device context (the planner materialises shards on the meta device)
        base_seed = int(torch.randint(0, 2**62, (1,), device="cpu"))
        self.cfg = cfg
        self.layout = layout
        self.tp = tp  # the TP size the layers below are split for
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel  # megatron's layers below are built for it
        self.documents = documents  # look for packed documents in every forward
        self.vocab_size = cfg.vocab_size
        self.padded_vocab = padded_vocab_size(cfg.vocab_size, cfg.vocab_pad_multiple, tp)
        self.vocab_first = tp_rank * (self.padded_vocab // tp)  # this rank's first vocabulary column
        mp = ModelParallelConfig(
            tensor_model_parallel_size=tp,
            sequence_parallel=sequence_parallel,
            # allocated on the device and filled by init_shards_; under a device context (the planner
            # builds shards on the meta device) megatron's "CPU" allocation follows the context instead
            use_cpu_initialization=torch.get_default_device().type == "meta",
            perform_initialization=False,  # megatron's own init draws every full weight on every rank
            params_dtype=torch.float32,
            gradient_accumulation_fusion=False,
        )
        std = cfg.init_std
        init = lambda w: nn.init.normal_(w, mean=0.0, std=std)
        out_init = lambda w: nn.init.normal_(w, mean=0.0, std=std / math.sqrt(2 * cfg.num_layers))

        parts = _Parts(base_seed, std, std / math.sqrt(2 * cfg.num_layers), built, tp, tp_rank)
        embedding = tensor_parallel.VocabParallelEmbedding(
            self.padded_vocab, cfg.hidden_size, init_method=init, config=mp, tp_group=tp_group
        )
        self.embedding = parts.done(embedding)
        self.pos_embedding = None
        if cfg.position == "learned":
            self.pos_embedding = nn.Embedding(cfg.seq_len, cfg.hidden_size)
            init(self.pos_embedding.weight)
            parts.done(self.pos_embedding)
        self.blocks = nn.ModuleList()
        for _ in range(cfg.num_layers):
            self.blocks.append(parts.done(TransformerBlock(cfg, mp, init, out_init, tp_group)))
        self.final_norm = parts.done(make_norm(cfg, sequence_parallel))
        self.output = None
        if not cfg.tie_embeddings:
            self.output = parts.done(
                ColumnParallelLinear(
                    cfg.hidden_size,
                    self.padded_vocab,
                    config=mp,
                    init_method=init,
                    bias=False,
                    gather_output=False,
                    tp_group=tp_group,
                )
            )
        # run as built: no sequence or context split, no recomputation, eager
        self.into_sequence_region = _not_scattered if sequence_parallel else _identity
        self.tied_output_input = functools.partial(
            tensor_parallel.copy_to_tensor_model_parallel_region, group=tp_group
        )
        self.block_call = plain_call
        self.activation_checkpointing = "none"
        self.context = None
        self.compile_clock = None

    # ---- forward ----------------------------------------------------------------------------------
    def hidden_states(
        self, tokens: torch.Tensor, position_ids: torch.Tensor, shard: ContextShard | None = None
    ) -> torch.Tensor:
        """tokens, position_ids (b, s) -> final hidden states [s(/tp under SP), b, h].

        Context parallel: tokens and position_ids are this rank's chunks; ``shard`` holds what the
        whole rows define (document segments, GOAT's origin) and the CP group."""
        x = self.embedding(tokens)  # [b, s, h], all-reduced over TP
        if self.pos_embedding is not None:
            # checked where it costs no host sync (positions on the host); on a GPU the embedding's
            # own bounds check stops an out-of-range position
            if position_ids.device.type == "cpu" and int(position_ids.max()) >= self.cfg.seq_len:
                raise ValueError(f"learned positions stop at model.seq_len={self.cfg.seq_len}")
            x = x + self.pos_embedding(position_ids)
        x = x.transpose(0, 1).contiguous()
        # None unless positions restart (packed documents); under CP the shard holds the whole rows'
        segments = document_segments(position_ids) if shard is None and self.documents else None
        x = self.into_sequence_region(x)  # scatter under SP (parallel.model_parallel)
        clock = self.compile_clock if self.training else None  # model.compile: times the first pass
        if clock is not None and clock.waiting:
            clock.start()
        first = x
        for block in self.blocks:
            x = self.block_call(self, block, x, position_ids, segments, shard)  # checkpointed under ``full``
        if clock is not None and clock.waiting:
            clock.stop(first, x)
        return self.final_norm(x)

    def vocab_parallel_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[s, b, padded_vocab / tp] logits; padding columns are -inf so they never get probability."""
        if self.output is not None:
            logits, _ = self.output(hidden)
        else:
            hidden = self.tied_output_input(hidden)  # gather under SP, else copy to the TP region
            logits = F.linear(hidden, self.embedding.weight)
        logits = logits.float()
        if self.padded_vocab != self.vocab_size:
            local = logits.shape[-1]
            first = self.vocab_first
            padding = torch.arange(first, first + local, device=logits.device) >= self.vocab_size
            logits = logits.masked_fill(padding, float("-inf"))
        return logits

    def forward(self, tokens, position_ids, labels=None):
        """Mean next-token loss when ``labels`` are given, else vocab-parallel logits [b, s, V/tp].

        Context parallel (``parallel.cp`` > 1): every CP rank is given the whole rows and keeps its two
        chunks (``parallel/context.py``); logits are those of its chunks, and the loss is
        ``cp x (its tokens' loss sum) / (tokens of the whole rows)``, whose mean over the CP group is the
        whole rows' mean (gradients are averaged over DP x CP, so the factor cp cancels there too).
        The CP group is ``self.context``, set by ``parallel.model_parallel.apply``."""
        shard = None if self.context is None else self.context.shard(position_ids, self.documents)
        count = None
        if shard is not None:
            if labels is not None:
                count = (labels != IGNORE_INDEX).sum().clamp(min=1)
                labels = shard.split(labels)
            tokens, position_ids = shard.split(tokens), shard.split(position_ids)
        logits = self.vocab_parallel_logits(self.hidden_states(tokens, position_ids, shard))
        if labels is None:
            return logits.transpose(0, 1)
        labels = labels.transpose(0, 1).contiguous()
        keep = labels != IGNORE_INDEX  # e.g. the unreadable part of a skipped corrupt shard
        losses = vocab_parallel_cross_entropy(logits, labels.clamp(min=0), self.tp_group)
        if shard is not None:
            return (losses * keep).sum() * shard.cp / count
        return (losses * keep).sum() / keep.sum().clamp(min=1)
