"""Model FLOPs per trained token, stated in one function so MFU means one thing everywhere.

Why a formula and not a profiler: MFU compares the work the *model* needs with what the hardware could
do, independent of how the kernels implement it (recomputation under activation checkpointing, padding,
fused ops do not count). The convention (Kaplan et al. / PaLM appendix B, with the causal half):

    flops_per_token = 6 * N  +  6 * h * V_pad  +  6 * n_layers * n_heads * (d_qk + d_v) * (L + 1) / 2

* ``6 * N``: every non-embedding parameter is one multiply-add (2 FLOPs) forward and two backward.
  ``N`` counts all parameters of the transformer blocks and the final norm (norm weights, biases and the
  GOAT prior's few parameters included: they are < 0.1 % and make ``N`` equal to the model's own count);
  the token and learned-position embeddings are lookups and cost nothing.
* ``6 * h * V_pad``: the logits matmul (tied or not), over the padded vocabulary it really multiplies.
* attention scores and the weighted sum: per query head ``2 * d_qk`` FLOPs per (query, key) pair for
  ``q.k`` and ``2 * d_v`` for ``p.v``, forward; times 3 for training. ``d_qk`` is the head dim the kernel
  sees: for GOAT the content dims plus the ``2R + 3`` (``2R + 1`` with one u(j) lane) prior lanes, i.e. the
  full head dim, like every other scheme; ``d_v`` is the head dim. **Causal convention**: only unmasked pairs
  count; query ``i`` sees ``i + 1`` keys, ``(L + 1) / 2`` on average over a window of ``L`` tokens (the
  non-causal count would be ``L``; kernels that skip masked blocks do roughly this work).
"""

from __future__ import annotations

from ..config import ModelConfig
from ..shapes import block_params, non_embedding_params, padded_vocab_size

__all__ = ["block_params", "flops_per_token", "non_embedding_params"]  # the counts: goat_dist.shapes


def flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> dict[str, float]:
    """Training FLOPs per token at context ``seq_len`` (default ``cfg.seq_len``), by term and ``total``.

    See the module docstring for the convention; divide by 3 for a forward pass alone."""
    L = cfg.seq_len if seq_len is None else seq_len
    head_dim = cfg.hidden_size // cfg.num_heads
    d_qk = d_v = head_dim
    dense = 6.0 * non_embedding_params(cfg)
    lm_head = 6.0 * cfg.hidden_size * padded_vocab_size(cfg.vocab_size, cfg.vocab_pad_multiple, 1)
    attention = 6.0 * cfg.num_layers * cfg.num_heads * (d_qk + d_v) * (L + 1) / 2
    return {"dense": dense, "lm_head": lm_head, "attention": attention, "total": dense + lm_head + attention}
