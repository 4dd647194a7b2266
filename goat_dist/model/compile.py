"""``model.compile``: ``torch.compile`` per transformer block, as torchtitan does.

Why per block: one compiled function serves every block (the blocks run the same code; their parameters
are graph inputs), so compilation costs one block's, whatever the depth; the embedding, the loss and the
engine's hooks stay eager. GOAT adds O(L) elementwise work per layer (Fourier features, the sink MLP, the
exact lane split) that the compiler fuses with the norms, SwiGLU and the residual adds.

What is compiled and when (``parallel.model_parallel.apply`` sets it up; ``resolve_compile`` there reads
``model.compile``):

* only a block's *training* forward (and its backward): evaluation, attention probes and offline
  evaluation at many lengths run the same blocks eagerly, so their shapes never recompile anything;
* ``dynamic=False``: one static graph per distinct training shape (the micro-batch; with document
  masking, batches with and without a document boundary), each compiled once; at most
  ``torch._dynamo.config.recompile_limit`` (8) of them, past which a new shape runs eagerly;
* ``fullgraph=False``: at TP = 1 a block is one graph; megatron's parallel linear layers under TP > 1
  (their collectives), context parallelism's attention (its K/V all-gather) and FlashAttention's kernels
  (``flash4``, ``flash``) run eagerly between graphs (``ColumnParallelLinear`` below, ``attention.py``);
* inductor rounds at every dtype cast as eager does (``OPTIONS``): GOAT's exact low-precision lanes
  depend on it.

ZeRO-3 gathers parameters in module hooks. A compiled block is marked a ZeRO-3 leaf module (DeepSpeed's
``_z3_leaf``): the whole block's parameters are gathered in the block's own hooks, which run outside the
compiled forward, and no hook runs inside it.
"""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel


def _block_forward(block, x, position_ids, segments, shard):
    return block.layers(x, position_ids, segments, shard)


# Inductor keeps low-precision intermediates in fp32 unless told to round at every cast as eager does;
# GOAT's exact lane split (``goat.exact.split_exact``) is a chain of such roundings, and without them its
# three bf16 parts collapse into one (the per-key value then keeps 8 bits instead of ~27).
OPTIONS = {"emulate_precision_casts": True}

_compiled = None


def compiled_block_forward(block, x, position_ids, segments=None, shard=None):
    """``block.layers(...)`` through one ``torch.compile`` shared by every block of every model."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_block_forward, dynamic=False, fullgraph=False, options=OPTIONS)
    return _compiled(block, x, position_ids, segments, shard)


@torch.compiler.disable
def _eager(forward, layer, *args, **kwargs):
    return forward(layer, *args, **kwargs)


class ColumnParallelLinear(tensor_parallel.ColumnParallelLinear):
    """megatron's column-parallel layer; under TP > 1 it runs eagerly inside a compiled block.

    Why: its collectives (the all-gather under sequence parallelism, the backward all-reduce) are
    custom autograd functions over process groups that dynamo breaks the graph at anyway, after tracing
    part of megatron's Python (its memory buffer, a warn-once flag) into guards that recompile per layer
    shape. Eager, the graph breaks exactly at the layer, and the matmul is the same kernel."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.communicates = self.tp_group is not None and self.tp_group.size() > 1

    def forward(self, *args, **kwargs):
        if self.communicates and torch.compiler.is_compiling():
            return _eager(tensor_parallel.ColumnParallelLinear.forward, self, *args, **kwargs)
        return super().forward(*args, **kwargs)


class RowParallelLinear(tensor_parallel.RowParallelLinear):
    """megatron's row-parallel layer; under TP > 1 it runs eagerly inside a compiled block (its all-reduce
    or reduce-scatter, see ``ColumnParallelLinear``).

    It also passes its TP group to the matmul it calls: megatron-core 0.16 passes ``tp_group=None`` and
    the matmul then warns (on rank 0 only), and a ``warnings.warn`` inside a compiled block is a graph
    break. That matmul communicates nothing, so the group changes no result."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.communicates = self.tp_group is not None and self.tp_group.size() > 1

    def forward(self, *args, **kwargs):
        if self.communicates and torch.compiler.is_compiling():
            return _eager(tensor_parallel.RowParallelLinear.forward, self, *args, **kwargs)
        return super().forward(*args, **kwargs)

    def _forward_impl(self, input, weight, *args, **kwargs):
        if kwargs.get("tp_group", self.tp_group) is None:
            kwargs["tp_group"] = self.tp_group
        return super()._forward_impl(input, weight, *args, **kwargs)
