"""Cross-entropy over vocab-parallel logits, on the TP group it is given.

megatron-core's ``vocab_parallel_cross_entropy`` finds its TP group in the process-global
``parallel_state``; this is the same computation (megatron's own ``VocabParallelCrossEntropy`` steps,
three all-reduces over the group) with the group passed in, so the model's forward reads no process
state. No label smoothing (goat-dist trains without it).
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy

from .. import collectives


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group) -> torch.Tensor:
        steps = VocabParallelCrossEntropy
        logits, logits_max = steps.calculate_logits_max(logits)
        tp = 1 if group is None else group.size()
        if tp > 1:
            collectives.all_reduce(logits_max, "max", group=group)
        local = logits.size(-1)
        first = (0 if group is None else group.rank()) * local
        target_mask, masked_target, predicted, sum_exp, exp_logits = steps.calculate_predicted_logits(
            logits, target, logits_max, first, first + local
        )
        if tp > 1:
            collectives.all_reduce(predicted, group=group)
            collectives.all_reduce(sum_exp, group=group)
        softmax, loss = steps.calculate_cross_entropy_loss(exp_logits, predicted, sum_exp)
        ctx.save_for_backward(softmax, target_mask, masked_target)
        return loss

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        softmax, target_mask, masked_target = ctx.saved_tensors
        steps = VocabParallelCrossEntropy
        grad_2d, arange, update, grad = steps.prepare_gradient_calculation_operands(softmax, target_mask)
        grad = steps.calculate_gradients(grad_2d, arange, masked_target, update, grad, grad_output)
        return grad, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group) -> torch.Tensor:
    """Per-token loss of ``logits`` [..., V / tp] (this rank's vocabulary columns, rank r holding columns
    ``r * V/tp ...``) against ``target`` [...] (global token ids), summed over ``group`` (the TP group;
    None: a whole vocabulary). Works in place on an fp32 copy of the logits."""
    return _CrossEntropy.apply(logits, target, group)
