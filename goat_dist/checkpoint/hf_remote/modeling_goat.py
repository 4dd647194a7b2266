# Copyright the goat-dist authors.
# SPDX-License-Identifier: Apache-2.0
# Licensed under the Apache License, Version 2.0 (the "License"); you may not use this file except in
# compliance with the License. You may obtain a copy at http://www.apache.org/licenses/LICENSE-2.0.
# Distributed on an "AS IS" BASIS, WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND.
"""A goat-dist decoder (GOAT prior, ALiBi, no positions or learned positions) for Hugging Face
``transformers`` with ``trust_remote_code=True``. Self-contained: torch (>= 2.5) and transformers only.

It computes what goat-dist's model computes, the same way, so logits agree to fp32 rounding:

* GOAT: ``softmax_j(q_c,i . k_c,j / sqrt(d_c) + K_ij)`` with ``K_ij = K_rel(t_i - t_j) + u(t_j)``, the
  prior formed in fp32 from fp32 parameters (fp64 Fourier phases) and folded into q/k as extra lanes, so
  one SDPA call computes content + prior. The per-key value u(j) goes in as ``goat_key_bias_lanes``
  lanes each exact in the model's dtype: with 3, a bf16 model sees it to 2^-27 of its size; with 1 (a
  model trained in fp32, the reference's 2R+1 lanes) it is exact in fp32 and rounded once in bf16.
* Cache: a folded key depends only on its own position and one per-sequence constant (the recency
  origin), so it is cached like a plain key. The origin is fixed by the first forward of a cache (the
  prompt's) and kept with the cache, with the positions of the cached keys (ALiBi reads them); positions
  continue past the prompt (``position_ids``, else the cache length onwards).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_goat import GoatConfig

SPLIT_PARTS = 3  # lanes per per-key value: 2^-27 relative in bf16, below fp32's own 2^-24
LANE_QUERY = 256.0  # the query side of split lanes: a power of two, exact in bf16, fp16 and fp32
# the output field that carries the cache: renamed from past_key_values in recent transformers
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


# ---- position schemes ----------------------------------------------------------------------------------
def alibi_slopes(n_heads):
    """ALiBi's head slopes (Press et al.), including the non-power-of-two interleaving rule."""

    def power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n_heads).is_integer():
        slopes = power_of_2(n_heads)
    else:
        closest = 2 ** math.floor(math.log2(n_heads))
        slopes = power_of_2(closest) + power_of_2(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def geometric_frequencies(rank, base, device=None):
    """``base ** (-r / (rank - 1))`` for r = 0..rank-1, in fp32."""
    idx = torch.arange(rank, dtype=torch.float32, device=device)
    return base ** (-idx / max(rank - 1, 1))


def fourier_features(t, freqs, dtype):
    """``[cos(w t), sin(w t)]`` along a new last dim; phases in fp64, exact at any offset."""
    phases = t.double()[..., None] * freqs.double()
    return torch.cat([torch.cos(phases), torch.sin(phases)], dim=-1).to(dtype)


def split_exact(x, dtype, parts=SPLIT_PARTS):
    """``x`` as ``parts`` values along a new last dim, each exact in ``dtype``, summing to ``x``."""
    pieces, rest = [], x
    for _ in range(parts):
        piece = rest.to(dtype).to(x.dtype)
        pieces.append(piece)
        rest = rest - piece
    return torch.stack(pieces, dim=-1)


def sequence_origin(position_ids):
    """The recency origin (B, 1): the middle of each row's positions, so ``|t_j - origin|`` stays small."""
    lo = position_ids.amin(dim=-1, keepdim=True)
    hi = position_ids.amax(dim=-1, keepdim=True)
    return torch.div(lo + hi, 2, rounding_mode="floor")


class PriorLinear(nn.Module):
    """A Linear whose parameters the generic weight init leaves alone (they come from the checkpoint)."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d_out, d_in))
        self.bias = nn.Parameter(torch.zeros(d_out))

    def forward(self, x):
        return F.linear(x, self.weight.to(x.dtype), self.bias.to(x.dtype))


class SinkMLP(nn.Module):
    def __init__(self, d_in, hidden=4):
        super().__init__()
        self.fc1 = PriorLinear(d_in, hidden)
        self.fc2 = PriorLinear(hidden, 1)

    def forward(self, x):
        return self.fc2(F.silu(self.fc1(x))).squeeze(-1)


class GoatPrior(nn.Module):
    """Per-KV-head GOAT prior and its folded (lane) form; kept fp32 whatever the model's dtype."""

    def __init__(self, config, num_kv_heads):
        super().__init__()
        self.num_kv_heads = num_kv_heads
        self.pos_rank, self.abs_rank = config.goat_pos_rank, config.goat_abs_rank
        self.pos_base, self.abs_base = config.goat_pos_base, config.goat_abs_base
        self.key_bias = config.goat_key_bias
        self.key_lanes = getattr(config, "goat_key_bias_lanes", SPLIT_PARTS)  # older exports: 3
        self.train_len = config.goat_train_len
        self.num_lanes = 2 * self.pos_rank + (self.key_lanes if self.key_bias else 0)
        if self.pos_rank > 0:  # pos_rank 0: no K_rel; abs_rank 0: no sink MLP (GOAT's ablations)
            self.lambda_sym = nn.Parameter(torch.zeros(num_kv_heads, self.pos_rank))
            self.lambda_asym = nn.Parameter(torch.zeros(num_kv_heads, self.pos_rank))
        self.sink_mlp = None
        if self.key_bias and self.abs_rank > 0:
            self.sink_mlp = SinkMLP(2 * self.abs_rank + 2)
            self.sink_gain = nn.Parameter(torch.ones(num_kv_heads))
        if self.key_bias:
            self.sink_bump = nn.Parameter(torch.zeros(num_kv_heads))
            self.recency_slope_raw = nn.Parameter(torch.zeros(num_kv_heads))

    def _apply(self, fn, recurse=True):
        # model.to(bfloat16) keeps the prior fp32: rounding it loses the small lambdas and slopes
        def keep_fp32(t):
            out = fn(t)
            if t.dtype == torch.float32 and out.is_floating_point() and out.element_size() < 4:
                return t.to(device=out.device)
            return out

        return super()._apply(keep_fp32, recurse)

    @property
    def compute_dtype(self):
        probe = next(iter(self.parameters()), None)
        return torch.float64 if probe is not None and probe.dtype == torch.float64 else torch.float32

    def sink(self, position_ids, origin):
        """u_h(t_j) (B, L, H_kv), causal recency measured from ``origin``."""
        dtype = self.compute_dtype
        bump, slope_raw = (p.to(dtype) for p in (self.sink_bump, self.recency_slope_raw))
        u = bump * (position_ids == 0)[..., None]
        if self.sink_mlp is not None:
            t = position_ids.to(dtype)
            denom = float(self.train_len)
            freqs = geometric_frequencies(self.abs_rank, self.abs_base, position_ids.device)
            feats = torch.cat(
                [
                    fourier_features(position_ids, freqs, dtype),
                    (t / denom)[..., None],
                    (torch.log1p(t) / math.log1p(denom))[..., None],
                ],
                dim=-1,
            )
            with torch.autocast(position_ids.device.type, enabled=False):
                mlp = self.sink_mlp(feats)
            u = u + self.sink_gain.to(dtype) * mlp[..., None]
        return u + F.softplus(slope_raw) * (position_ids - origin).to(dtype)[..., None]

    def lanes(self, position_ids, scale, dtype, origin):
        """Query and key lanes (B, L, H_kv, num_lanes) with ``scale * (q . k) = K_ij + c_i``."""
        B, L = position_ids.shape
        H, R = self.num_kv_heads, self.pos_rank
        cdt = self.compute_dtype
        q_parts, k_parts = [], []
        if R > 0:
            freqs = geometric_frequencies(R, self.pos_base, position_ids.device)
            feats = fourier_features(position_ids, freqs, cdt)[..., None, :]
            cos, sin = feats.split(R, dim=-1)
            a = self.lambda_sym.to(cdt) / scale
            b = self.lambda_asym.to(cdt) / scale
            q_parts += [a * cos + b * sin, a * sin - b * cos]
            k_parts += [cos.expand(B, L, H, R), sin.expand(B, L, H, R)]
        if self.key_bias:
            u = self.sink(position_ids, origin) / (scale * LANE_QUERY)
            q_parts.append(torch.full((B, L, H, self.key_lanes), LANE_QUERY, dtype=cdt, device=u.device))
            k_parts.append(split_exact(u, dtype, self.key_lanes))
        return torch.cat(q_parts, dim=-1).to(dtype), torch.cat(k_parts, dim=-1).to(dtype)


def rope_cos_sin(position_ids, head_dim, base):
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = position_ids.double()[..., None] * inv_freq.to(position_ids.device)
    angles = torch.cat([angles, angles], dim=-1)[:, :, None, :]
    return angles.cos().float(), angles.sin().float()


# ---- layers --------------------------------------------------------------------------------------------
def make_norm(config):
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.bias)


class GoatAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.position = config.position
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.hidden_size // self.heads
        self.prior = GoatPrior(config, self.kv_heads) if config.position == "goat" else None
        self.content_dim = self.head_dim - (self.prior.num_lanes if self.prior is not None else 0)
        if self.content_dim < 1:
            raise ValueError(f"head_dim {self.head_dim} leaves no content dims next to the prior's lanes")
        h, bias = config.hidden_size, config.bias
        self.q_proj = nn.Linear(h, self.heads * self.content_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.kv_heads * self.content_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=bias)

    def forward(self, x, position_ids, origin, mask, cache):
        B, L, _ = x.shape
        q = self.q_proj(x).view(B, L, self.heads, self.content_dim)
        k = self.k_proj(x).view(B, L, self.kv_heads, self.content_dim)
        v = self.v_proj(x).view(B, L, self.kv_heads, self.head_dim)
        scale = self.content_dim**-0.5
        if self.prior is not None:
            q_lanes, k_lanes = self.prior.lanes(position_ids, scale, q.dtype, origin)
            q_lanes = q_lanes.repeat_interleave(self.heads // self.kv_heads, dim=2)
            q, k = torch.cat([q, q_lanes], dim=-1), torch.cat([k, k_lanes], dim=-1)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        dv = v.shape[-1]
        if dv < q.shape[-1]:  # equal head dims keep SDPA off its slow math kernel
            v = F.pad(v, (0, q.shape[-1] - dv))
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=self.heads != self.kv_heads,
        )
        return self.o_proj(out[..., :dv].transpose(1, 2).reshape(B, L, -1))


class GoatMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        h, ffn, bias = config.hidden_size, config.intermediate_size, config.bias
        self.swiglu = config.activation == "swiglu"
        if self.swiglu:
            self.gate_proj = nn.Linear(h, ffn, bias=bias)
        self.up_proj = nn.Linear(h, ffn, bias=bias)
        self.down_proj = nn.Linear(ffn, h, bias=bias)

    def forward(self, x):
        if self.swiglu:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x)))


class GoatDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.input_layernorm = make_norm(config)
        self.self_attn = GoatAttention(config, layer_idx)
        self.post_attention_layernorm = make_norm(config)
        self.mlp = GoatMLP(config)

    def forward(self, x, position_ids, origin, mask, cache):
        x = x + self.self_attn(self.input_layernorm(x), position_ids, origin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class GoatPreTrainedModel(PreTrainedModel):
    config_class = GoatConfig
    base_model_prefix = "model"
    _no_split_modules = ["GoatDecoderLayer"]
    # the prior stays fp32 under dtype=bfloat16 / float16 (older transformers read one, newer the other)
    _keep_in_fp32_modules = ["prior"]
    _keep_in_fp32_modules_strict = ["prior"]
    _supports_sdpa = True
    _supports_cache_class = True
    supports_gradient_checkpointing = False

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)


class GoatModel(GoatPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_positions = None
        if config.position == "learned":
            self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(GoatDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = make_norm(config)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def _mask(self, position_ids, key_positions, attention_mask, past, dtype):
        """None (plain causal, SDPA's ``is_causal``), a boolean keep mask, or ALiBi's additive bias."""
        B, L = position_ids.shape
        alibi = self.config.position == "alibi"
        padded = attention_mask is not None and not bool(attention_mask.all())
        if past == 0 and not padded and not alibi:
            return None
        total = past + L
        rows = torch.arange(past, total, device=position_ids.device)
        keep = torch.arange(total, device=position_ids.device)[None, :] <= rows[:, None]
        keep = keep[None, None]
        if padded:
            keys = attention_mask[:, None, None, :total].bool()
            keep = keep & (keys | (torch.arange(total, device=keys.device) == rows[:, None]))  # never empty
        if not alibi:
            return keep
        # the slopes are exact in fp32 only: recompute them whatever dtype the model was cast to
        slopes = alibi_slopes(self.config.num_attention_heads).to(position_ids.device)
        distance = (position_ids[:, :, None] - key_positions[:, None, :]).float()
        bias = -slopes[None, :, None, None] * distance[:, None]
        return bias.masked_fill(~keep, float("-inf")).to(dtype)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None):
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, L = x.shape[:2]
        past = cache.get_seq_length() if cache is not None else 0
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError(
                "attention_mask must be 2-D (batch, keys): a padding mask; causality is built in"
            )
        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -L:]
            else:
                position_ids = torch.arange(past, past + L, device=x.device)[None]
        position_ids = position_ids.to(x.device).long().expand(B, L)
        key_positions, origin = position_ids, sequence_origin(position_ids)
        if cache is not None:
            state = getattr(cache, "_goat_dist_state", None)
            if past > 0:
                if state is None:
                    raise ValueError("this cache was filled by another model: it lacks GOAT's recency origin")
                key_positions = torch.cat([state["positions"][:, :past], position_ids], dim=1)
                origin = state["origin"]
            cache._goat_dist_state = {"positions": key_positions, "origin": origin}
        if self.embed_positions is not None:
            if int(position_ids.max()) >= self.config.max_position_embeddings:
                raise ValueError(f"learned positions stop at {self.config.max_position_embeddings}")
            x = x + self.embed_positions(position_ids)
        mask = self._mask(position_ids, key_positions, attention_mask, past, x.dtype)
        for layer in self.layers:
            x = layer(x, position_ids, origin, mask, cache)
        return self.norm(x)


def _new_cache(config):
    try:
        return DynamicCache(config=config)
    except TypeError:  # older transformers
        return DynamicCache()


class GoatForCausalLM(GoatPreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.model = GoatModel(config)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        return_dict=None,
        logits_to_keep=0,
        cache=None,
        **kwargs,
    ):
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if not use_cache:
            cache = None
        elif cache is None:
            cache = _new_cache(self.config)
        hidden = self.model(input_ids, attention_mask, position_ids, cache, inputs_embeds)
        keep = logits_to_keep or kwargs.get("num_logits_to_keep", 0)
        if isinstance(keep, int) and keep > 0:
            hidden = hidden[:, -keep:]
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(hidden, weight).float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
            )
        output = CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache})
        if return_dict is False:
            return output.to_tuple()
        return output
