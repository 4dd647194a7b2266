"""The prior's lanes in bf16/fp16: ``q_lanes . k_lanes`` as a kernel computes it (16-bit inputs, fp32
accumulation) against the prior evaluated in float64 straight from its formula.

The bound allowed is the same at every length and offset: one rounding of the spectral lanes (a per-head
coefficient times cos/sin on the query side, cos/sin on the key side) plus fp32's own rounding of the
per-key value. A single 16-bit lane for u(j) (the previous design) is checked to break it, so the
measurement can fail.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from goat_dist.config import ConfigError, load_config
from goat_dist.goat import GoatPrior, prior_lane_count, sequence_origin, split_exact

UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}  # max relative rounding error


def perturbed_prior(heads=4, R=4, M=4, seed=0, key_lanes=3) -> GoatPrior:
    """A prior with every term of trained size: slopes up to ~0.7, lambdas ~0.3, a strong sink MLP."""
    torch.manual_seed(seed)
    prior = GoatPrior(heads, pos_rank=R, abs_rank=M, training_seq_len=2048, key_lanes=key_lanes)
    with torch.no_grad():
        prior.lambda_sym.normal_(std=0.3)
        prior.lambda_asym.normal_(std=0.3)
        for p in prior.sink_mlp.parameters():
            p.normal_(std=0.5)
        prior.sink_gain.uniform_(0.5, 2.0)
        prior.sink_bump.fill_(3.0)
        # slopes softplus(0) = 0.69 (about ALiBi's steepest) down to softplus(-4) = 0.018
        prior.recency_slope_raw.copy_(torch.linspace(0.0, -4.0, heads))
    return prior


def exact_prior_rows(prior: GoatPrior, pos: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """K_ij in float64 for the query rows ``rows`` and all keys, (H, len(rows), L), from the formula
    (recency as ``slope * t_j``, absolute; the comparison below removes per-row constants)."""
    t = pos.double()
    delta = t[rows][:, None] - t[None, :]  # (rows, L)
    w = prior.rel_freqs.double()
    a, b = prior.lambda_sym.double(), prior.lambda_asym.double()
    phase = delta[None, :, :, None] * w  # (1, rows, L, R)
    K = (a[:, None, None, :] * phase.cos() + b[:, None, None, :] * phase.sin()).sum(-1)
    nu, denom = prior.abs_freqs.double(), float(prior.training_seq_len)
    feats = torch.cat(
        [
            (t[:, None] * nu).cos(),
            (t[:, None] * nu).sin(),
            (t / denom)[:, None],
            (t.log1p() / math.log1p(denom))[:, None],
        ],
        dim=-1,
    )
    fc1, fc2 = prior.sink_mlp.fc1, prior.sink_mlp.fc2
    mlp = F.linear(
        F.silu(F.linear(feats, fc1.weight.double(), fc1.bias.double())),
        fc2.weight.double(),
        fc2.bias.double(),
    )
    u = prior.sink_gain.double()[:, None] * mlp[:, 0][None] + prior.sink_bump.double()[:, None] * (pos == 0)
    u = u + F.softplus(prior.recency_slope_raw.double())[:, None] * t[None]  # (H, L)
    return K + u[:, None, :]


def lane_error(prior, pos, rows, dtype, one_lane_sink=False):
    """max over rows i and keys j <= i of |(lanes_ij - lanes_ii) - (K_ij - K_ii)|, and max |u|."""
    scale = 1 / math.sqrt(53)
    q, k = prior.lanes(pos[None], causal=True, scale=scale, dtype=dtype)
    q, k = q[0].float(), k[0].float()  # exact: kernel inputs upcast, products and sums in fp32
    if one_lane_sink:  # the previous design: u(j) in one 16-bit key lane, query side sqrt(d_c) = 1/scale
        u = prior.sink(pos[None], causal=True)[0]
        q = torch.cat(
            [q[..., : 2 * prior.pos_rank], torch.full_like(q[..., :1], 1 / scale).to(dtype).float()], -1
        )
        k = torch.cat([k[..., : 2 * prior.pos_rank], u[..., None].to(dtype).float()], -1)
    lanes = torch.einsum("ihd,jhd->hij", q[rows], k) * scale  # (H, rows, L) in fp32
    exact = exact_prior_rows(prior, pos, rows)
    diff = (lanes.double() - lanes.double().gather(2, rows[None, :, None].expand(len(lanes), -1, 1))) - (
        exact - exact.gather(2, rows[None, :, None].expand(len(exact), -1, 1))
    )
    causal = torch.arange(len(pos))[None, None, :] <= rows[None, :, None]
    u_max = prior.sink(pos[None], causal=True).abs().max().item()
    return diff.masked_fill(~causal, 0).abs().max().item(), u_max


def spectral_bound(prior: GoatPrior, dtype) -> float:
    """Two roundings (query coefficient x cos, key cos) per spectral lane, both lanes of every r."""
    coeff = (prior.lambda_sym.abs() + prior.lambda_asym.abs()).sum(-1).max().item()
    return 2 * 2 * UNIT_ROUNDOFF[dtype] * coeff


BF16, FP16 = torch.bfloat16, torch.float16
LANE_CASES = [(1024, 0, BF16), (131072, 10**6, BF16), (4096, 10**6, FP16), (65536, 0, FP16)]


@pytest.mark.parametrize("L,offset,dtype", LANE_CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_lane_products_equal_the_prior(L, offset, dtype):
    prior = perturbed_prior(heads=2)
    pos = torch.arange(L) + offset
    rows = torch.tensor([0, 1, L // 3, L // 2, L - 2, L - 1])
    err, u_max = lane_error(prior, pos, rows, dtype)
    fp32_level = 8 * 2.0**-24 * u_max  # the fp32 value of u and its fp32 sum in the kernel
    bound = 2 * spectral_bound(prior, dtype) + fp32_level
    assert err <= bound, f"lane error {err:.2e} > {bound:.2e} (spectral {spectral_bound(prior, dtype):.1e})"


def test_one_lane_sink_fails_the_same_check():
    """The same measurement catches a u(j) carried in one bf16 lane (a staircase of bf16 steps)."""
    prior = perturbed_prior(heads=2)
    L = 16384
    pos = torch.arange(L)
    rows = torch.tensor([L // 2, L - 1])
    err, u_max = lane_error(prior, pos, rows, torch.bfloat16, one_lane_sink=True)
    assert err > 0.5 and err > 100 * spectral_bound(prior, torch.bfloat16), err


def test_error_does_not_grow_with_length_or_offset():
    prior = perturbed_prior(heads=2)
    errs = {}
    for L, offset in [(512, 0), (32768, 0), (32768, 10**6)]:
        pos = torch.arange(L) + offset
        errs[(L, offset)] = lane_error(prior, pos, torch.tensor([L - 1, L // 2]), torch.bfloat16)[0]
    base = errs[(512, 0)]
    assert all(e <= 2 * base + 2e-3 for e in errs.values()), errs


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"]
)
def test_split_exact(dtype):
    torch.manual_seed(0)
    x = (torch.randn(4096) * torch.logspace(-2, 4, 4096)).requires_grad_(True)
    parts = split_exact(x, dtype)
    assert parts.shape == (4096, 3) and parts.dtype == torch.float32
    assert torch.equal(parts, parts.to(dtype).float()), "every part must be exact in the kernel dtype"
    err = (parts.double().sum(-1) - x.double()).abs()
    floor = 2.0**-25 if dtype == torch.float16 else 0.0  # fp16's subnormal spacing limits the last part
    assert (err <= 2.0**-24 * x.double().abs() + floor).all()
    if dtype == torch.float32:
        assert torch.equal(parts[:, 0], x) and not parts[:, 1:].any()
    w = torch.randn(4096)
    (parts * w[:, None]).sum().backward()
    assert torch.equal(x.grad, w), "the gradient of x is the lanes' common gradient, counted once"


def test_lanes_of_a_chunk_equal_the_rows_lanes_given_the_origin():
    """Context parallelism: lanes of any chunk, built from global positions and the row's origin, are
    exactly the full row's lanes there (no dependence on which other positions a rank holds)."""
    prior = perturbed_prior(heads=2)
    pos = (torch.arange(4096) + 777_000)[None]
    q_full, k_full = prior.lanes(pos, causal=True, scale=0.125, dtype=torch.bfloat16)
    origin = sequence_origin(pos)
    for chunk in (slice(0, 512), slice(1024, 1536), slice(3584, 4096)):
        q, k = prior.lanes(pos[:, chunk], causal=True, scale=0.125, dtype=torch.bfloat16, origin=origin)
        assert torch.equal(q, q_full[:, chunk]) and torch.equal(k, k_full[:, chunk])
    q, k = prior.lanes(pos[:, :512], causal=True, scale=0.125, dtype=torch.bfloat16)  # its own origin
    assert not torch.equal(k, k_full[:, :512]), "the chunk's own origin differs: the origin must be passed"


def test_lanes_ignore_bf16_autocast():
    """Training runs under bf16 autocast: the sink MLP must still run in fp32 (its output is split)."""
    prior = perturbed_prior(heads=2)
    pos = (torch.arange(256) + 5000)[None]
    plain = prior.lanes(pos, causal=True, scale=0.125, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = prior.lanes(pos, causal=True, scale=0.125, dtype=torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(plain, cast))


def test_lanes_with_bf16_parameters_compute_in_fp32():
    """ZeRO-3 + bf16 replaces the prior's parameters by bf16 ones (bypassing ``_apply``): the lanes
    must still form, in fp32, equal to an fp32 prior holding the same (rounded) values."""
    prior = perturbed_prior(heads=2)
    for p in prior.parameters():
        p.data = p.data.bfloat16().float()
    rounded = [p.data.clone() for p in prior.parameters()]
    pos = (torch.arange(512) + 3000)[None]
    expected = prior.lanes(pos, causal=True, scale=0.125, dtype=torch.bfloat16)
    for p, value in zip(prior.parameters(), rounded):
        p.data = value.bfloat16()  # what DeepSpeed's cast does: .data replaced, module hooks bypassed
    got = prior.lanes(pos, causal=True, scale=0.125, dtype=torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))


def test_config_counts_the_same_lanes():
    assert (
        prior_lane_count(4, True) == 11 and prior_lane_count(4, False) == 8 and prior_lane_count(0, True) == 3
    )
    lanes = prior_lane_count(2, True)
    with pytest.raises(ConfigError, match="content lanes"):
        load_config(None, [f"model.hidden_size={8 * lanes}", "model.num_heads=8", "model.goat.pos_rank=2"])
    load_config(None, [f"model.hidden_size={8 * (lanes + 1)}", "model.num_heads=8", "model.goat.pos_rank=2"])


# ---- one u(j) lane where the kernel computes in fp32 (the reference's 2R+1) ------------------------------
@pytest.mark.parametrize("R,key_bias", [(4, True), (2, True), (0, True), (4, False)])
def test_fp32_lane_count_is_the_references_pos_dim(R, key_bias):
    """Under fp32 (``model.goat.key_bias_lanes=auto``) the prior takes the reference's ``pos_dim`` lanes
    of each head, so a GOAT model keeps the reference's content width; bf16 keeps two more."""
    goat = pytest.importorskip("goat.attention", reason="test dependency goat-attention is not installed")
    from goat_dist import shapes

    ref = goat.GoatAttention(
        embed_dim=128, num_heads=4, pos_rank=R, abs_rank=4, enable_key_bias=key_bias, training_seq_len=64
    )
    fp32 = shapes.prior_lane_count(R, key_bias, shapes.key_lanes_for("fp32"))
    assert fp32 == ref.pos_dim
    assert shapes.prior_lane_count(R, key_bias, shapes.key_lanes_for("bf16")) == ref.pos_dim + 2 * key_bias
    flag = str(key_bias).lower()
    cfg = load_config(None, ["model.hidden_size=128", "model.num_heads=4", f"model.goat.pos_rank={R}",
                             f"model.goat.key_bias={flag}", "train.precision=fp32"])  # fmt: skip
    shapes.resolve_key_bias_lanes(cfg.model, cfg.train.precision)
    assert shapes.head_dims(cfg.model)[3] == ref.content_dim
    assert GoatPrior(4, R, 4, key_bias=key_bias, key_lanes=1).num_lanes == ref.pos_dim


def test_from_reference_maps_with_no_padding_lanes():
    """``from_reference`` keeps the reference's content dims; in fp32 its q/k are the reference's head
    dim wide (one u(j) lane, as the reference), in bf16 two lanes wider (the exact split)."""
    goat = pytest.importorskip("goat.attention", reason="test dependency goat-attention is not installed")
    from goat_dist.goat import fold_prior, from_reference

    torch.manual_seed(0)
    ref = goat.GoatAttention(embed_dim=128, num_heads=4, kv_num_heads=2, pos_rank=4, abs_rank=4,
                             training_seq_len=64, batch_first=True)  # fmt: skip
    mod = from_reference(ref, backend="sdpa")
    assert mod.content_dim == ref.content_dim and mod.prior.lane_count(torch.float32) == ref.pos_dim
    pos = torch.arange(16)[None]
    for dtype, width in ((torch.float32, ref.head_dim), (torch.bfloat16, ref.head_dim + 2)):
        q = torch.zeros(1, 16, 4, mod.content_dim, dtype=dtype)
        k = torch.zeros(1, 16, 2, mod.content_dim, dtype=dtype)
        q, k = fold_prior(q, k, mod.prior, pos, causal=True)
        assert q.shape[-1] == k.shape[-1] == width, dtype
    x = torch.randn(2, 16, 128)
    with torch.no_grad():
        want, _ = ref(x, x, x, is_causal=True, need_weights=False)
        assert (mod(x) - want).abs().max().item() < 1e-5


def test_one_key_lane_is_the_split_in_fp32():
    """In fp32 the split's second and third parts are identically zero: one lane carries the same u(j),
    so the 2R+1 layout computes the 2R+3 one's prior exactly; in bf16 only the split keeps it exact."""
    three, one = perturbed_prior(heads=2), perturbed_prior(heads=2, key_lanes=1)
    pos = (torch.arange(2048) + 1000)[None]
    q3, k3 = three.lanes(pos, causal=True, scale=0.125, dtype=torch.float32)
    q1, k1 = one.lanes(pos, causal=True, scale=0.125, dtype=torch.float32)
    assert q1.shape[-1] == one.num_lanes == q3.shape[-1] - 2
    assert torch.equal(q1, q3[..., :-2]) and torch.equal(k1, k3[..., :-2]) and not k3[..., -2:].any()
    rows = torch.tensor([2047, 1024])
    err1, _ = lane_error(one, pos[0], rows, torch.bfloat16)
    err3, _ = lane_error(three, pos[0], rows, torch.bfloat16)
    assert err1 > 10 * err3, (err1, err3)  # one bf16 lane rounds u(j): the reason bf16 keeps three
