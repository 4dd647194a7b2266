"""The GPT model: megatron-core tensor-parallel layers with GOAT, RoPE, ALiBi, learned or no positions."""

from .gpt import GPT, padded_vocab_size

__all__ = ["GPT", "padded_vocab_size"]
