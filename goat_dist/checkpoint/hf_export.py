"""Hugging Face export (``export(..., fmt="hf")``): a directory ``transformers`` loads as is.

* ``position=rope`` becomes a standard ``LlamaForCausalLM`` (no remote code): goat-dist's rotate-half RoPE,
  RMSNorm, SwiGLU and grouped-query layout are Llama's. Settings Llama cannot express (GELU, LayerNorm,
  learned positions) are refused by name rather than exported as a different model.
* ``position=goat | alibi | none | learned`` becomes a ``trust_remote_code`` model: the self-contained
  ``modeling_goat.py`` / ``configuration_goat.py`` of ``hf_remote/`` (torch + transformers only) are copied
  in and ``config.json`` maps them with ``auto_map``.

``vocab_size`` is the model's real vocabulary, not its TP-padded one: goat-dist gives the padding columns
no probability (-inf logits), and no input id reaches the padding rows, so cutting them off keeps every
logit the same and keeps ``generate`` from ever sampling a padding id.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from data_tools.shard_format import MANIFEST_NAME, TOKENIZER_NAME

from ..shapes import ffn_size, head_dims, padded_vocab_size
from .manager import CheckpointError

REMOTE_DIR = Path(__file__).with_name("hf_remote")
REMOTE_FILES = ("configuration_goat.py", "modeling_goat.py")
REMOTE_POSITIONS = ("goat", "alibi", "none", "learned")
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16"}


def _settings(model: dict):
    """A ModelConfig from the run's model section (defaults for keys older runs lack)."""
    from ..config import GoatConfig, ModelConfig

    raw = dict(model)
    raw["goat"] = GoatConfig(**raw.get("goat", {}))
    return ModelConfig(**raw)


def check_llama(cfg) -> None:
    """Refuse a RoPE model Llama would compute differently, naming the setting."""
    problems = []
    if cfg.activation != "swiglu":
        problems.append(f"model.activation={cfg.activation} (Llama's MLP is SwiGLU)")
    if cfg.norm != "rmsnorm":
        problems.append(f"model.norm={cfg.norm} (Llama normalises with RMSNorm)")
    if problems:
        raise CheckpointError(
            "cannot export this position=rope model as LlamaForCausalLM: " + "; ".join(problems) + "."
        )


def _split_qkv(w: torch.Tensor, kv_heads: int, group: int, content_dim: int, head_dim: int):
    """goat-dist's fused projection, laid out per KV group as ``[q_1..q_group | k | v]`` (rows, or the
    entries of a bias), as separate q, k and v."""
    per = w.reshape(kv_heads, (group + 1) * content_dim + head_dim, *w.shape[1:])
    q, k, v = per.split([group * content_dim, content_dim, head_dim], dim=1)
    return (t.reshape(-1, *w.shape[1:]).contiguous() for t in (q, k, v))


def hf_tensors(cfg, tensors: dict[str, torch.Tensor], prefix: str = "model.") -> dict[str, torch.Tensor]:
    """goat-dist's TP=1 tensors under Llama-style names (the remote model uses the same ones, plus
    ``self_attn.prior.*`` and ``embed_positions``). The vocabulary is cut to ``cfg.vocab_size``."""
    heads, kv_heads, head_dim, content_dim = head_dims(cfg)
    ffn = ffn_size(cfg)
    out: dict[str, torch.Tensor] = {}
    left = dict(tensors)

    def take(name: str) -> torch.Tensor:
        try:
            return left.pop(name)
        except KeyError:
            raise CheckpointError(f"checkpoint lacks tensor {name!r}") from None

    out[f"{prefix}embed_tokens.weight"] = take("embedding.weight")[: cfg.vocab_size].contiguous()
    if cfg.position == "learned":
        out[f"{prefix}embed_positions.weight"] = take("pos_embedding.weight")
    for i in range(cfg.num_layers):
        src, dst = f"blocks.{i}.", f"{prefix}layers.{i}."
        for kind in ("weight", "bias"):
            if f"{src}attn.qkv.{kind}" in left:
                q, k, v = _split_qkv(
                    take(f"{src}attn.qkv.{kind}"), kv_heads, heads // kv_heads, content_dim, head_dim
                )
                out[f"{dst}self_attn.q_proj.{kind}"] = q
                out[f"{dst}self_attn.k_proj.{kind}"] = k
                out[f"{dst}self_attn.v_proj.{kind}"] = v
            if f"{src}attn.proj.{kind}" in left:
                out[f"{dst}self_attn.o_proj.{kind}"] = take(f"{src}attn.proj.{kind}")
            if f"{src}mlp.fc1.{kind}" in left:
                fc1 = take(f"{src}mlp.fc1.{kind}")
                if cfg.activation == "swiglu":  # TP=1: gate rows, then up rows (``h.chunk(2)``)
                    gate, up = fc1.split([ffn, ffn], dim=0)
                    out[f"{dst}mlp.gate_proj.{kind}"] = gate.contiguous()
                    out[f"{dst}mlp.up_proj.{kind}"] = up.contiguous()
                else:
                    out[f"{dst}mlp.up_proj.{kind}"] = fc1
            if f"{src}mlp.fc2.{kind}" in left:
                out[f"{dst}mlp.down_proj.{kind}"] = take(f"{src}mlp.fc2.{kind}")
            for norm, name in (("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm")):
                if f"{src}{norm}.{kind}" in left:
                    out[f"{dst}{name}.{kind}"] = take(f"{src}{norm}.{kind}")
        for name in [n for n in left if n.startswith(f"{src}attn.prior.")]:
            out[f"{dst}self_attn.prior.{name[len(src) + len('attn.prior.') :]}"] = take(name)
    for kind in ("weight", "bias"):
        if f"final_norm.{kind}" in left:
            out[f"{prefix}norm.{kind}"] = take(f"final_norm.{kind}")
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = take("output.weight")[: cfg.vocab_size].contiguous()
    if left:
        raise CheckpointError(f"tensors with no Hugging Face name: {sorted(left)[:5]}")
    return out


def _llama_config(cfg, dtype: str, special: dict) -> dict:
    heads = cfg.num_heads
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": ffn_size(cfg),
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": cfg.num_kv_heads or heads,
        "head_dim": cfg.hidden_size // heads,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_base,
        "rope_scaling": None,
        "attention_bias": cfg.bias,
        "mlp_bias": cfg.bias,
        "attention_dropout": 0.0,
        "initializer_range": cfg.init_std,
        "pretraining_tp": 1,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": DTYPE_NAMES[dtype],
        "use_cache": True,
        **special,
    }


def _remote_config(cfg, dtype: str, special: dict) -> dict:
    g = cfg.goat
    return {
        "architectures": ["GoatForCausalLM"],
        "model_type": "goat_dist",
        "auto_map": {
            "AutoConfig": "configuration_goat.GoatConfig",
            "AutoModelForCausalLM": "modeling_goat.GoatForCausalLM",
        },
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": ffn_size(cfg),
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads or cfg.num_heads,
        "activation": cfg.activation,
        "norm": cfg.norm,
        "norm_eps": cfg.norm_eps,
        "bias": cfg.bias,
        "position": cfg.position,
        "max_position_embeddings": cfg.seq_len,
        "goat_pos_rank": g.pos_rank,
        "goat_abs_rank": g.abs_rank,
        "goat_pos_base": g.pos_base,
        "goat_abs_base": g.abs_base,
        "goat_key_bias": g.key_bias,
        "goat_train_len": g.train_len or cfg.seq_len,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": DTYPE_NAMES[dtype],
        "use_cache": True,
        **special,
    }


# post-processors that add special tokens around a sequence (a BOS, a CLS/SEP); ``data prepare`` encoded
# with ``add_special_tokens=False``, so training never saw them
ADDING = ("TemplateProcessing", "BertProcessing", "RobertaProcessing")


def without_added_tokens(post: dict | None) -> dict | None:
    """``post`` (a tokenizer.json ``post_processor``) minus the parts that add special tokens; what
    remains (ByteLevel's offset trimming) changes no id."""
    if not isinstance(post, dict) or post.get("type") in ADDING:
        return None
    if post.get("type") == "Sequence":
        kept = [q for q in (without_added_tokens(p) for p in post.get("processors") or []) if q is not None]
        return None if not kept else kept[0] if len(kept) == 1 else {**post, "processors": kept}
    return post


def _special_tokens(tokenizer: Path | None) -> dict:
    """eos/bos of the data's tokenizer: the data set manifest's ``eos_id`` (the token that ended every
    training document), else the token the file declares. Documents were separated by EOS alone, so it is
    also what preceded every document: it serves as BOS too (the GPT-2 convention), for ``generate()``
    without a prompt; the tokenizer never adds it (``write_tokenizer``)."""
    if tokenizer is None:
        return {}
    from tokenizers import Tokenizer

    from data_tools.tokenizer import find_eos_token

    tok = Tokenizer.from_file(str(tokenizer))
    token = None
    manifest = tokenizer.with_name(MANIFEST_NAME)
    if manifest.is_file():
        eos = json.loads(manifest.read_text()).get("eos_id")
        token = tok.id_to_token(eos) if eos is not None else None
    token = token or find_eos_token(tok)
    if token is None:
        return {}
    return {"token": token, "id": tok.token_to_id(token)}


def write_hf(
    dest: Path,
    model: dict,
    tensors: dict[str, torch.Tensor],
    metadata: dict,
    dtype: str,
    tokenizer: Path | None,
) -> None:
    """Write the Hugging Face directory into ``dest`` (an empty directory)."""
    cfg = _settings(model)
    if cfg.position == "rope":
        check_llama(cfg)
    elif cfg.position not in REMOTE_POSITIONS:
        raise CheckpointError(
            f"model.position={cfg.position}: no Hugging Face export for this position scheme"
        )
    padded = tensors["embedding.weight"].shape[0]
    if padded < cfg.vocab_size or padded != padded_vocab_size(cfg.vocab_size, cfg.vocab_pad_multiple, 1):
        raise CheckpointError(
            f"embedding has {padded} rows, not model.vocab_size={cfg.vocab_size} padded to "
            f"model.vocab_pad_multiple={cfg.vocab_pad_multiple}"
        )
    special = _special_tokens(tokenizer)
    ids = {}
    if special:
        ids = {"bos_token_id": special["id"], "eos_token_id": special["id"]}
    named = hf_tensors(cfg, tensors)
    save_file(named, str(dest / "model.safetensors"), metadata={**metadata, "format": "pt"})
    config = _llama_config(cfg, dtype, ids) if cfg.position == "rope" else _remote_config(cfg, dtype, ids)
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (dest / "generation_config.json").write_text(
        json.dumps({"_from_model_config": True, **ids}, indent=2) + "\n"
    )
    if cfg.position != "rope":
        for name in REMOTE_FILES:
            shutil.copyfile(REMOTE_DIR / name, dest / name)
    if tokenizer is not None:
        write_tokenizer(dest, tokenizer, special, cfg.seq_len)


def write_tokenizer(dest: Path, tokenizer: Path, special: dict, seq_len: int) -> None:
    """The tokenizer files ``AutoTokenizer`` reads, encoding a text to the ids ``data prepare`` gave it:
    no special token added around it (a Llama/Mistral file's post-processor prepends ``<s>``, which
    training never saw: it is dropped, and ``add_bos_token``/``add_eos_token`` are false), and a special
    token's string inside the text stays text (``split_special_tokens``, as prepare encoded it)."""
    data = json.loads(tokenizer.read_text(encoding="utf-8"))
    post = without_added_tokens(data.get("post_processor"))
    if post == data.get("post_processor"):
        shutil.copyfile(tokenizer, dest / TOKENIZER_NAME)
    else:
        data["post_processor"] = post
        (dest / TOKENIZER_NAME).write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": seq_len,
        "add_bos_token": False,
        "add_eos_token": False,
        "split_special_tokens": True,
    }
    if special:
        tok_config.update(bos_token=special["token"], eos_token=special["token"])
    (dest / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    if special:
        tokens = {"bos_token": special["token"], "eos_token": special["token"]}
        (dest / "special_tokens_map.json").write_text(json.dumps(tokens, indent=2) + "\n")
