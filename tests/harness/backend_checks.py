"""Checks of an attention backend against ``sdpa``, shared by the tests of the ``flash`` and ``flash4`` paths
(``tests/unit/kernels/test_flash_paths.py``, ``test_flash4_paths.py``), each run on CPU through its stand-in
(``harness.flash_standin``, ``harness.flash4_standin``) in fp32."""

from __future__ import annotations

import copy

import torch

from goat_dist.goat import GoatSelfAttention
from harness.models import tiny_model_config

# The sink MLP's output bias moves every key's logit equally: softmax ignores it, its exact gradient is 0
# and any fp32 kernel returns rounding noise there, so it is only checked to be noise-sized.
SHIFT_ONLY = "prior.sink_mlp.fc2.bias"
# The other per-key (sink) parameters' gradients are sums over keys of terms that nearly cancel (the same
# shift invariance): two fp32 kernels summing in different orders agree to ~1e-4 relative there, not 1e-5
# (as in tests/unit/goat/test_attention_parity.py). A folding or masking error would show as O(1).
CANCELLING = {"prior.sink_mlp.fc1.bias": 1e-3, "prior.sink_mlp.fc1.weight": 1e-3, "prior.sink_gain": 1e-3}


def assert_grads_close(a: torch.nn.Module, b: torch.nn.Module, rel: float = 1e-5, floor: float = 1e-7):
    grads = {name: (pa.grad, pb.grad) for (name, pa), pb in zip(a.named_parameters(), b.parameters())}
    largest = max(ga.norm().item() for ga, _ in grads.values() if ga is not None)
    for name, (ga, gb) in grads.items():
        assert (ga is None) == (gb is None), name
        if ga is None:
            continue
        if name.endswith(SHIFT_ONLY):
            assert max(ga.norm().item(), gb.norm().item()) <= 1e-5 * largest, f"{name} should be ~0"
            continue
        tol = next((t for suffix, t in CANCELLING.items() if name.endswith(suffix)), rel)
        err, size = (ga - gb).norm().item(), gb.norm().item()
        assert err <= tol * size + floor, f"{name}: |diff| {err:.3e} vs |grad| {size:.3e}"


GOAT_CASES = [
    # kv heads, R, M, key bias, position offset, content dim (None: head_dim - lanes)
    (4, 4, 4, True, 0, None),
    (2, 2, 8, True, 1000, None),
    (1, 0, 2, True, 100_000, None),
    (2, 4, 4, False, 7, None),
    (2, 4, 4, True, 0, 23),  # q/k two lanes wider than v, as from_reference builds them: v is padded
]


def assert_goat_backend_matches_sdpa(backend, standin, kv, R, M, key_bias, offset, content_dim, causal):
    """A GOAT module with trained-size prior terms on ``backend`` (a CPU stand-in) against the same module
    on sdpa: outputs, input gradients and parameter gradients to 1e-5 in fp32, through one kernel call."""
    torch.manual_seed(0)
    sdpa = GoatSelfAttention(
        128, 4, kv, pos_rank=R, abs_rank=M, key_bias=key_bias, backend="sdpa", content_dim=content_dim
    )
    with torch.no_grad():  # prior terms of trained size, so a folding slip would show
        for p in sdpa.prior.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    other = copy.deepcopy(sdpa)
    other.backend = backend
    x = torch.randn(2, 40, 128)
    pos = torch.arange(40) + offset
    xs, xo = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ys, yo = sdpa(xs, pos, causal=causal), other(xo, pos, causal=causal)
    assert standin.calls == ["flash_attn_func"]
    assert (ys - yo).abs().max().item() <= 1e-5
    g = torch.randn_like(ys)
    ys.backward(g)
    yo.backward(g)
    assert (xs.grad - xo.grad).abs().max().item() <= 1e-5
    assert_grads_close(sdpa, other)


def model_pair(position: str, backend: str, kv_heads: int = 2):
    """The tiny GPT (seq_len 64) built twice from one seed, on sdpa and on ``backend``: (cfg, sdpa, other)."""
    from goat_dist.model import GPT

    cfg = tiny_model_config(seq_len=64, num_kv_heads=kv_heads, position=position, attention_backend="sdpa")
    torch.manual_seed(0)
    sdpa, other = GPT(cfg), GPT(cfg)  # (megatron layers hold process groups: no deepcopy)
    other.load_state_dict(sdpa.state_dict())
    for module in other.modules():
        if hasattr(module, "backend"):
            module.backend = backend
    return cfg, sdpa, other
