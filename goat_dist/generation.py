"""Autoregressive generation with a KV cache, on one process, for every position scheme.

The training forward (``GPT.forward``) is left as it is: ``cached_forward`` walks the same submodules
(embedding, blocks' norms, qkv, MLP, projection, final norm, logits) with the same weights, but keeps
each layer's keys and values so a new token costs one position's forward instead of the whole
sequence's. What each scheme caches:

Each layer's position scheme (``model/positions.py``: ``fold``, ``scale``, ``bias``) is applied as in
training:

* goat: keys with the prior's key lanes folded in (``fold_prior``). Those lanes depend only on the key's
  own position and the row's recency origin, so they are cached like plain keys. The origin is fixed
  for the whole generation (the middle of prompt + new tokens): softmax ignores any per-row constant,
  so a fixed origin gives the same attention as the full forward's (whose origin moves with the
  length) up to rounding, and keeps the recency values bounded as in training;
* rope: keys already rotated by their position;
* alibi: plain keys; the bias ``-slope * (t_i - t_j)`` is rebuilt from positions at each step;
* learned, none: plain keys (learned positions are added at the embedding, so stop at model.seq_len).

Positions are absolute and continue past the prompt (no sliding window), also past model.seq_len for
goat, rope, alibi and none (length extrapolation). Attention runs through torch SDPA whatever
``model.attention_backend`` says: one kernel that works on CPU and GPU, in fp32 and bf16.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .goat import split_grouped_qkv
from .kernels import sdpa_call


class KVCache:
    """Per-layer keys and values of the positions seen so far, preallocated for ``max_len`` positions.

    Keys are stored as the attention kernel takes them (GOAT lanes folded in, RoPE applied), so a step
    appends one position per layer and attends to the prefix. ``origin`` (B, 1): GOAT's recency origin,
    fixed for the cache's lifetime so cached key lanes stay valid."""

    def __init__(self, model, batch: int, max_len: int):
        self.max_len = max_len
        self.length = 0
        self.keys: list[torch.Tensor | None] = [None] * len(model.blocks)
        self.values: list[torch.Tensor | None] = [None] * len(model.blocks)
        device = next(model.parameters()).device
        self.origin = torch.full((batch, 1), (max_len - 1) // 2, dtype=torch.long, device=device)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, L, H_kv, D) at positions ``length .. length + L``; return the keys and values
        of positions ``0 .. length + L`` (views of the cache)."""
        start, end = self.length, self.length + k.shape[1]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions, asked for {end}")
        if self.keys[layer] is None:
            b, _, h, d = k.shape
            self.keys[layer] = k.new_empty(b, self.max_len, h, d)
            self.values[layer] = v.new_empty(b, self.max_len, *v.shape[2:])
        self.keys[layer][:, start:end] = k
        self.values[layer][:, start:end] = v
        return self.keys[layer][:, :end], self.values[layer][:, :end]


def _check_one_process(model) -> None:
    if model.tp != 1 or model.sequence_parallel:
        raise ValueError("cached generation runs on one process: build the model with TP=1 and no SP")


def _cached_attention(attn, x: torch.Tensor, positions: torch.Tensor, cache: KVCache, layer: int):
    """``ParallelSelfAttention`` for new positions only: x [L, b, h] -> [L, b, h], keys from the cache."""
    mixed, _ = attn.qkv(x)
    q, k, v = split_grouped_qkv(
        mixed.transpose(0, 1), attn.local_kv_heads, attn.group, attn.content_dim, attn.head_dim
    )
    scheme = attn.position
    q, k = scheme.fold(q, k, positions, cache.origin)
    start = cache.length
    keys, values = cache.append(layer, k, v)
    L, S = q.shape[1], keys.shape[1]
    query_pos = start + torch.arange(L, device=q.device)
    key_pos = torch.arange(S, device=q.device)
    bias = scheme.bias(query_pos, key_pos)  # ALiBi's (1, H, L, S); None for the other schemes
    mask, causal = None, False
    if bias is None and start == 0:
        causal = L > 1  # prefill: the training kernel's own causal path
    elif bias is None and L > 1:
        mask = key_pos[None, :] <= query_pos[:, None]
    elif bias is not None:
        keep = key_pos[None, :] <= query_pos[:, None]
        mask = bias.masked_fill(~keep, float("-inf")).to(q.dtype)
    out = sdpa_call(q, keys, values, scale=scheme.scale, mask=mask, causal=causal)
    b, s = out.shape[:2]
    out, _ = attn.proj(out.reshape(b, s, -1).transpose(0, 1))
    return out


def cached_forward(model, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits (B, L, vocab) fp32 of ``tokens`` (B, L), the positions that follow ``cache.length``;
    their keys and values are added to the cache. Equals ``model(whole sequence)``'s last L rows."""
    B, L = tokens.shape
    start = cache.length
    positions = torch.arange(start, start + L, device=tokens.device)[None].expand(B, -1)
    x = model.embedding(tokens)
    if model.pos_embedding is not None:
        if start + L > model.cfg.seq_len:
            raise ValueError(f"learned positions stop at model.seq_len={model.cfg.seq_len}")
        x = x + model.pos_embedding(positions)
    x = x.transpose(0, 1).contiguous()
    for i, block in enumerate(model.blocks):
        x = x + _cached_attention(block.attn, block.attn_norm(x), positions, cache, i)
        x = x + block.mlp(block.mlp_norm(x))
    cache.length += L
    logits = model.vocab_parallel_logits(model.final_norm(x))
    return logits.transpose(0, 1)[..., : model.vocab_size]


# ---- sampling --------------------------------------------------------------------------------------


def check_sampling(temperature: float, top_k: int | None, top_p: float | None, max_new_tokens: int) -> None:
    """ValueError naming the parameter (and its ``goat-dist generate`` flag) that is out of range."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens (--max-new-tokens) must be >= 1, got {max_new_tokens}")
    if not temperature >= 0:
        raise ValueError(f"temperature (--temperature) must be >= 0 (0: greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k (--top-k) must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p (--top-p) must be in (0, 1], got {top_p}")
    if temperature == 0 and (top_k is not None or top_p is not None):
        flag = "--top-k" if top_k is not None else "--top-p"
        raise ValueError(f"{flag} needs a sampling temperature: --temperature 0 is greedy; set it > 0")


def next_token(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> int:
    """One token id from fp32 logits (vocab,): argmax at temperature 0, else a draw from the softmax of
    ``logits / temperature`` cut to the ``top_k`` best and the smallest set of mass ``top_p``. The draw
    runs on CPU with ``generator``, so a seed gives the same tokens on any device."""
    if temperature == 0:
        return int(logits.argmax())
    logits = logits.float().cpu() / temperature
    if top_k is not None and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p  # mass before this token already reaches top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


# ---- the loop ----------------------------------------------------------------------------------------


@dataclass
class Generation:
    ids: list[int]  # prompt + new tokens
    new: list[int]  # the new tokens (the last one is EOS when generation stopped there)
    seconds: float  # generation time: prefill + decoding, no tokenizing or loading
    logits: list[torch.Tensor] = field(default_factory=list)  # per new token, when kept: (vocab,) fp32


@torch.no_grad()
def generate_ids(
    model,
    prompt: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    eos_id: int | None = None,
    use_cache: bool = True,
    keep_logits: bool = False,
) -> Generation:
    """Continue ``prompt`` by up to ``max_new_tokens`` tokens, stopping after ``eos_id``.

    ``use_cache=False`` re-runs the whole sequence through ``model.forward`` per token: the reference
    the cache is tested against. ``keep_logits``: keep each step's logits (for those tests)."""
    check_sampling(temperature, top_k, top_p, max_new_tokens)
    if not prompt:
        raise ValueError("prompt has no tokens")
    total = len(prompt) + max_new_tokens
    if model.cfg.position == "learned" and total > model.cfg.seq_len:
        raise ValueError(
            f"learned positions stop at model.seq_len={model.cfg.seq_len}: a prompt of {len(prompt)} tokens "
            f"plus max_new_tokens (--max-new-tokens) {max_new_tokens} is {total}"
        )
    device = next(model.parameters()).device
    ids, new, kept = list(prompt), [], []
    start = time.perf_counter()
    cache = None
    if use_cache:
        _check_one_process(model)
        cache = KVCache(model, 1, total)
        logits = cached_forward(model, torch.tensor([ids], device=device), cache)[0, -1]
    for step in range(max_new_tokens):
        if not use_cache:
            tokens = torch.tensor([ids], device=device)
            logits = model(tokens, torch.arange(len(ids), device=device)[None])[0, -1, : model.vocab_size]
        if keep_logits:
            kept.append(logits.float().cpu())
        token = next_token(logits, temperature, top_k, top_p, generator)
        ids.append(token)
        new.append(token)
        if token == eos_id:
            break
        if use_cache and step + 1 < max_new_tokens:
            logits = cached_forward(model, torch.tensor([[token]], device=device), cache)[0, -1]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return Generation(ids, new, time.perf_counter() - start, kept)
