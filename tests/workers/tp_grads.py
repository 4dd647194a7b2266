"""The tiny GPT and batch whose gradients tests/workers/layout_runs.py computes under TP (+SP, +CP) and the
tests compare with one process's, and the TP=1-shaped gathering of a sharded gradient."""

import torch

from goat_dist.checkpoint.universal import merge, split_meta
from goat_dist.config import ModelConfig

TP_ALL_REDUCES = "_tp_all_reduces"  # the saved count of the backward's TP-sum collectives


def full_gradient(p: torch.nn.Parameter) -> torch.Tensor:
    """The TP=1-shaped gradient: every TP rank's slice, merged as the universal checkpoint merges them."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(p.grad) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, p.grad.contiguous(), group=group)
    return merge(parts, split_meta(p))


def tiny_config(position: str) -> ModelConfig:
    return ModelConfig(
        vocab_size=300,
        seq_len=32,
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        position=position,
        attention_backend="sdpa",
        tie_embeddings=False,
    )


def tiny_batch(cfg: ModelConfig):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=g)
    positions = torch.arange(cfg.seq_len).expand(2, -1) + torch.tensor([[0], [500]])
    return tokens[:, :-1], positions, tokens[:, 1:]
