"""Load an exported model (``goat-dist ckpt export``, goat-dist's format or the Hugging Face one) on one
process, and generate text from it.

from goat_dist.inference import load_exported, generate
model, tokenizer = load_exported("exported/")
print(generate(model, tokenizer, "def fibonacci(n):", max_new_tokens=40))  # greedy, KV-cached
print(generate(model, tokenizer, "def", max_new_tokens=40, temperature=0.8, top_p=0.95, seed=1))

The KV cache and sampling live in ``goat_dist.generation``.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file

from data_tools.shard_format import TOKENIZER_NAME

from .config import GoatConfig, ModelConfig

EXPORT_HINT = "`goat-dist ckpt export RUN_DIR OUT` writes one"
# ``model_type`` of the config.json ``ckpt export --format hf`` writes: a RoPE model as Llama, the other
# position schemes as its own remote-code model (``checkpoint/hf_remote``)
HF_MODEL_TYPES = ("llama", "goat_dist")
# the remote-code config's defaults (``hf_remote/configuration_goat.py``) for a key its config.json lacks
REMOTE_DEFAULTS = {
    "activation": "swiglu",
    "norm": "rmsnorm",
    "norm_eps": 1e-5,
    "bias": False,
    "position": "goat",
    "goat_pos_rank": 4,
    "goat_abs_rank": 4,
    "goat_pos_base": 10_000.0,
    "goat_abs_base": 10_000.0,
    "goat_key_bias": True,
    "goat_key_bias_lanes": 3,
    "goat_train_len": 256,
    "initializer_range": 0.02,
    "tie_word_embeddings": True,
}


class ExportDirError(ValueError):
    """``--model`` is not a goat-dist export directory; the message says what it is and what to do."""


def is_hf_config(raw) -> bool:
    """Whether a config.json is a Hugging Face one (``ckpt export --format hf``), not goat-dist's own."""
    return isinstance(raw, dict) and ("model_type" in raw or "architectures" in raw)


def _hf_model_section(raw: dict, where: str) -> dict:
    """goat-dist's model section from the config.json of a ``ckpt export --format hf`` directory
    (``hf_export._llama_config`` / ``_remote_config`` the other way round); a setting goat-dist cannot
    compute (a Llama with another activation, biases on one side, RoPE scaling) is an ExportDirError."""
    kind = raw.get("model_type")
    heads = int(raw["num_attention_heads"])
    kv = int(raw.get("num_key_value_heads") or heads)
    section = {
        "vocab_size": int(raw["vocab_size"]),
        "hidden_size": int(raw["hidden_size"]),
        "num_layers": int(raw["num_hidden_layers"]),
        "num_heads": heads,
        "num_kv_heads": None if kv == heads else kv,
        "ffn_hidden_size": int(raw["intermediate_size"]),
        "seq_len": int(raw["max_position_embeddings"]),
    }
    if kind == "goat_dist":
        r = {**REMOTE_DEFAULTS, **raw}
        return {
            **section,
            "activation": r["activation"],
            "norm": r["norm"],
            "norm_eps": float(r["norm_eps"]),
            "bias": bool(r["bias"]),
            "position": r["position"],
            "tie_embeddings": bool(r["tie_word_embeddings"]),
            "init_std": float(r["initializer_range"]),
            "goat": {
                "pos_rank": int(r["goat_pos_rank"]),
                "abs_rank": int(r["goat_abs_rank"]),
                "pos_base": float(r["goat_pos_base"]),
                "abs_base": float(r["goat_abs_base"]),
                "key_bias": bool(r["goat_key_bias"]),
                "key_bias_lanes": int(r["goat_key_bias_lanes"]),
                "train_len": int(r["goat_train_len"]) if r["goat_train_len"] else None,
            },
        }
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}  # transformers 5 saves the former
    theta = raw.get("rope_theta") or (rope.get("rope_theta") if isinstance(rope, dict) else None) or 10_000.0
    problems = []
    if raw.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {raw['hidden_act']!r} (goat-dist's RoPE model is SwiGLU: silu)")
    if bool(raw.get("attention_bias", False)) != bool(raw.get("mlp_bias", False)):
        problems.append("attention_bias != mlp_bias (goat-dist has one model.bias)")
    if isinstance(rope, dict) and rope.get("rope_type", "default") != "default":
        problems.append(f"rope type {rope.get('rope_type')!r} (goat-dist's RoPE is unscaled)")
    if raw.get("head_dim") not in (None, int(raw["hidden_size"]) // heads):
        problems.append(f"head_dim {raw.get('head_dim')} (goat-dist's is hidden_size / heads)")
    if problems:
        raise ExportDirError(f"--model {where}: a Llama goat-dist cannot compute: {'; '.join(problems)}")
    return {
        **section,
        "activation": "swiglu",
        "norm": "rmsnorm",
        "norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
        "bias": bool(raw.get("attention_bias", False)),
        "position": "rope",
        "rope_base": float(theta),
        "tie_embeddings": bool(raw.get("tie_word_embeddings", False)),
        "init_std": float(raw.get("initializer_range", 0.02)),
    }


def export_config(path: str | Path) -> tuple[dict, str]:
    """(goat-dist's model config, the format: ``goat`` or ``hf``) of a ``goat-dist ckpt export``
    directory (``config.json`` + ``model.safetensors``), in either of its formats, or an ExportDirError
    that says what was expected and what ``path`` is instead: a run, checkpoints or step directory
    (export it first), a Hugging Face model goat-dist did not export, or else."""
    path = Path(path)
    expects = (
        "expects a `goat-dist ckpt export` directory, either format (model.safetensors + config.json; "
        f"{EXPORT_HINT})"
    )
    if not path.is_dir():
        found = "a file" if path.exists() else "nothing there"
        raise ExportDirError(f"--model {path}: {expects}; found {found}")
    step_state = path / "trainer_state.json"  # what a step directory of a run holds
    if any((path / d).exists() for d in ("checkpoints", "latest")) or step_state.exists():
        what = "a step directory" if step_state.exists() else "a run directory with checkpoints"
        raise ExportDirError(
            f"--model {path}: {expects}; found {what}. Export it first: goat-dist ckpt export {path} "
            f"{path.name}-export, then --model {path.name}-export"
        )
    config = path / "config.json"
    if not config.is_file() or not (path / "model.safetensors").is_file():
        names = sorted(p.name for p in path.iterdir())[:8]
        raise ExportDirError(f"--model {path}: {expects}; found {', '.join(names) or 'an empty directory'}")
    try:
        raw = json.loads(config.read_text())
    except ValueError as e:
        raise ExportDirError(
            f"--model {path}: {config} is not JSON ({e}); export the checkpoint again"
        ) from e
    if not isinstance(raw, dict):
        raise ExportDirError(f"--model {path}: {config} is not a model config; {EXPORT_HINT}")
    if not is_hf_config(raw):
        return raw, "goat"
    kind = raw.get("model_type")
    if kind not in HF_MODEL_TYPES:
        raise ExportDirError(
            f"--model {path}: {expects}; found a Hugging Face model of type {kind!r}, which goat-dist did "
            f"not export (its Hugging Face exports are {' or '.join(HF_MODEL_TYPES)}). Load it with "
            "transformers"
        )
    try:
        return _hf_model_section(raw, str(path)), "hf"
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, ExportDirError):
            raise
        raise ExportDirError(
            f"--model {path}: {config} lacks or mistypes {e} of a `goat-dist ckpt export --format hf` "
            f"config; {EXPORT_HINT}"
        ) from None


def _padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    """The vocabulary rows cut off by the Hugging Face export, back as zeros (padding: no probability)."""
    if t.shape[0] >= rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def from_hf_tensors(
    cfg: ModelConfig, hf: dict[str, torch.Tensor], where: str = ""
) -> dict[str, torch.Tensor]:
    """goat-dist's TP=1 tensors from a Hugging Face export's (``checkpoint.hf_export.hf_plan`` the other
    way round): q/k/v fused again per KV group as ``[q_1..q_group | k | v]``, SwiGLU's gate and up
    stacked, the vocabulary padded back. A tensor missing, or one with no goat-dist name, is an
    ExportDirError naming it."""
    from .shapes import head_dims, padded_vocab_size

    heads, kv, head_dim, content = head_dims(cfg)
    group = heads // kv
    rows = padded_vocab_size(cfg.vocab_size, cfg.vocab_pad_multiple, 1)
    left = dict(hf)

    def take(name: str) -> torch.Tensor:
        if name not in left:
            raise ExportDirError(f"--model {where}: model.safetensors lacks tensor {name!r}")
        return left.pop(name)

    out = {"embedding.weight": _padded(take("model.embed_tokens.weight"), rows)}
    if cfg.position == "learned":
        out["pos_embedding.weight"] = take("model.embed_positions.weight")
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"blocks.{i}."
        for kind in ("weight", "bias"):
            if f"{src}self_attn.q_proj.{kind}" in left:
                q, k, v = (take(f"{src}self_attn.{p}_proj.{kind}") for p in "qkv")
                rest = q.shape[1:]
                parts = (q.reshape(kv, group * content, *rest), k.reshape(kv, content, *rest))
                fused = torch.cat([*parts, v.reshape(kv, head_dim, *rest)], dim=1)
                out[f"{dst}attn.qkv.{kind}"] = fused.reshape(-1, *rest)
            if f"{src}self_attn.o_proj.{kind}" in left:
                out[f"{dst}attn.proj.{kind}"] = take(f"{src}self_attn.o_proj.{kind}")
            if f"{src}mlp.gate_proj.{kind}" in left:  # SwiGLU, TP=1: gate rows, then up rows
                gate = take(f"{src}mlp.gate_proj.{kind}")
                out[f"{dst}mlp.fc1.{kind}"] = torch.cat([gate, take(f"{src}mlp.up_proj.{kind}")])
            elif f"{src}mlp.up_proj.{kind}" in left:
                out[f"{dst}mlp.fc1.{kind}"] = take(f"{src}mlp.up_proj.{kind}")
            if f"{src}mlp.down_proj.{kind}" in left:
                out[f"{dst}mlp.fc2.{kind}"] = take(f"{src}mlp.down_proj.{kind}")
            for norm, name in (("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm")):
                if f"{src}{name}.{kind}" in left:
                    out[f"{dst}{norm}.{kind}"] = take(f"{src}{name}.{kind}")
        prior = f"{src}self_attn.prior."
        for name in sorted(n for n in left if n.startswith(prior)):
            out[f"{dst}attn.prior.{name[len(prior) :]}"] = take(name)
    for kind in ("weight", "bias"):
        if f"model.norm.{kind}" in left:
            out[f"final_norm.{kind}"] = take(f"model.norm.{kind}")
    if not cfg.tie_embeddings:
        out["output.weight"] = _padded(take("lm_head.weight"), rows)
    else:
        left.pop("lm_head.weight", None)  # a tied head saved anyway is the embedding
    if left:
        raise ExportDirError(
            f"--model {where}: tensors goat-dist's model has no place for: {sorted(left)[:5]}"
        )
    return out


def load_exported(path: str | Path, dtype: torch.dtype = torch.float32):
    """(model in eval mode, tokenizer or None) of a ``goat-dist ckpt export`` directory, goat-dist's own
    format or the Hugging Face one (``--format hf``: its tensors mapped back, ``from_hf_tensors``).
    Initialises a one-process world if none exists."""
    from . import distributed
    from .model import GPT

    warnings.filterwarnings("ignore", module="megatron")
    path = Path(path)
    raw, fmt = export_config(path)
    try:
        raw["goat"] = GoatConfig(**raw.get("goat", {}))
        cfg = ModelConfig(**raw)
    except TypeError as e:  # keys of another program's config.json
        raise ExportDirError(
            f"--model {path}: {path / 'config.json'} is not a goat-dist model config ({e}); {EXPORT_HINT}"
        ) from None
    layout = distributed.current_layout() if torch.distributed.is_initialized() else distributed.init(tp=1)
    model = GPT(cfg, layout)
    state = load_file(str(path / "model.safetensors"))
    if fmt == "hf":
        state = from_hf_tensors(cfg, state, str(path))
    model.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=False)
    missing = set(dict(model.named_parameters())) - set(state)
    if missing:
        raise KeyError(f"{path}/model.safetensors lacks parameters: {sorted(missing)[:5]}")
    model = model.to(dtype).eval()
    tokenizer = None
    if (path / TOKENIZER_NAME).is_file():
        from data_tools.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(path / TOKENIZER_NAME)
    return model, tokenizer


def tokenizer_eos(tokenizer) -> int | None:
    """The id generation stops at: the end-of-text token the tokenizer declares (None if it has none)."""
    from data_tools.tokenizer import find_eos_token

    token = find_eos_token(tokenizer)
    return None if token is None else tokenizer.token_to_id(token)


def generate(
    model,
    tokenizer,
    prompt: str,
    max_new_tokens: int = 50,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    result: bool = False,
):
    """Prompt + continuation as text: greedy at ``temperature`` 0, else sampled (``top_k``, ``top_p``);
    stops at the tokenizer's end-of-text token. ``seed`` (or a CPU ``generator``, shared across calls)
    makes sampling reproducible. An empty prompt starts from end-of-text, where training documents
    start. ``result``: return ``(text, generation.Generation)`` for its token ids and timing."""
    from .generation import generate_ids

    eos = tokenizer_eos(tokenizer)
    ids = tokenizer.encode(prompt).ids or [0 if eos is None else eos]
    if generator is None and seed is not None:
        generator = torch.Generator().manual_seed(seed)
    out = generate_ids(
        model,
        ids,
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        generator=generator,
        eos_id=eos,
        use_cache=use_cache,
    )
    text = tokenizer.decode(out.ids)
    return (text, out) if result else text
