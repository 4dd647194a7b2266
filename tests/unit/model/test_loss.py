"""The model's vocab-parallel cross-entropy on a TP group it is handed (``model/loss.py``) computes what
megatron-core's ``vocab_parallel_cross_entropy`` (which finds the group in ``parallel_state``) computes:
the same per-token losses and the same gradient, bit for bit, and matches torch's cross-entropy."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel


def test_the_loss_on_a_given_group_is_megatrons(world1):
    from goat_dist.model.loss import vocab_parallel_cross_entropy

    torch.manual_seed(0)
    logits = torch.randn(7, 3, 50) * 4
    target = torch.randint(0, 50, (7, 3))
    ours_in, theirs_in = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    ours = vocab_parallel_cross_entropy(ours_in * 1.0, target, world1.tp_group)
    theirs = tensor_parallel.vocab_parallel_cross_entropy(theirs_in * 1.0, target)
    assert torch.equal(ours, theirs)
    weights = torch.rand(7, 3)
    (ours * weights).sum().backward()
    (theirs * weights).sum().backward()
    assert torch.equal(ours_in.grad, theirs_in.grad)
    reference = F.cross_entropy(logits.reshape(-1, 50), target.reshape(-1), reduction="none").view(7, 3)
    torch.testing.assert_close(ours.detach(), reference)
