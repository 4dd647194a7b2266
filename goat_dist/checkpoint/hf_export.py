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
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from data_tools.shard_format import MANIFEST_NAME, TOKENIZER_NAME

from ..shapes import ffn_size, head_dims, key_bias_lanes, padded_vocab_size
from . import tensor_file
from .errors import CheckpointError

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


def _qkv_part(w: torch.Tensor, part: int, kv_heads: int, group: int, content_dim: int, head_dim: int):
    """q, k or v (``part`` 0, 1, 2) of goat-dist's fused projection, laid out per KV group as
    ``[q_1..q_group | k | v]`` (rows, or the entries of a bias)."""
    per = w.reshape(kv_heads, (group + 1) * content_dim + head_dim, *w.shape[1:])
    t = per.split([group * content_dim, content_dim, head_dim], dim=1)[part]
    return t.reshape(-1, *w.shape[1:]).contiguous()


def hf_plan(cfg, names, prefix: str = "model.") -> list[tuple[str, str, Callable]]:
    """``(Hugging Face name, goat-dist name, cut)`` for every tensor: goat-dist's TP=1 tensors under
    Llama-style names (the remote model uses the same ones, plus ``self_attn.prior.*`` and
    ``embed_positions``), each ``cut(goat tensor)``; the vocabulary is cut to ``cfg.vocab_size``. A tensor
    the model should have and ``names`` lacks, or one with no Hugging Face name, is a CheckpointError."""
    heads, kv_heads, head_dim, content_dim = head_dims(cfg)
    ffn = ffn_size(cfg)
    plan: list[tuple[str, str, Callable]] = []
    left = set(names)

    def whole(t):
        return t

    def rows(n: int):
        return lambda t: t[:n].contiguous()

    def tail(n: int):
        return lambda t: t[n:].contiguous()

    def take(out: str, name: str, cut=whole) -> None:
        if name not in names:
            raise CheckpointError(f"checkpoint lacks tensor {name!r}")
        left.discard(name)
        plan.append((out, name, cut))

    take(f"{prefix}embed_tokens.weight", "embedding.weight", rows(cfg.vocab_size))
    if cfg.position == "learned":
        take(f"{prefix}embed_positions.weight", "pos_embedding.weight")
    for i in range(cfg.num_layers):
        src, dst = f"blocks.{i}.", f"{prefix}layers.{i}."
        for kind in ("weight", "bias"):
            if f"{src}attn.qkv.{kind}" in left:
                for part, proj in enumerate(("q_proj", "k_proj", "v_proj")):
                    cut = partial(
                        _qkv_part,
                        part=part,
                        kv_heads=kv_heads,
                        group=heads // kv_heads,
                        content_dim=content_dim,
                        head_dim=head_dim,
                    )
                    take(f"{dst}self_attn.{proj}.{kind}", f"{src}attn.qkv.{kind}", cut)
            if f"{src}attn.proj.{kind}" in left:
                take(f"{dst}self_attn.o_proj.{kind}", f"{src}attn.proj.{kind}")
            if f"{src}mlp.fc1.{kind}" in left:
                if cfg.activation == "swiglu":  # TP=1: gate rows, then up rows (``h.chunk(2)``)
                    take(f"{dst}mlp.gate_proj.{kind}", f"{src}mlp.fc1.{kind}", rows(ffn))
                    take(f"{dst}mlp.up_proj.{kind}", f"{src}mlp.fc1.{kind}", tail(ffn))
                else:
                    take(f"{dst}mlp.up_proj.{kind}", f"{src}mlp.fc1.{kind}")
            if f"{src}mlp.fc2.{kind}" in left:
                take(f"{dst}mlp.down_proj.{kind}", f"{src}mlp.fc2.{kind}")
            for norm, name in (("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm")):
                if f"{src}{norm}.{kind}" in left:
                    take(f"{dst}{name}.{kind}", f"{src}{norm}.{kind}")
        for name in sorted(n for n in left if n.startswith(f"{src}attn.prior.")):
            take(f"{dst}self_attn.prior.{name[len(src) + len('attn.prior.') :]}", name)
    for kind in ("weight", "bias"):
        if f"final_norm.{kind}" in left:
            take(f"{prefix}norm.{kind}", f"final_norm.{kind}")
    if not cfg.tie_embeddings:
        take("lm_head.weight", "output.weight", rows(cfg.vocab_size))
    if left:
        raise CheckpointError(f"tensors with no Hugging Face name: {sorted(left)[:5]}")
    return plan


def hf_tensors(cfg, tensors: dict[str, torch.Tensor], prefix: str = "model.") -> dict[str, torch.Tensor]:
    """goat-dist's TP=1 tensors under their Hugging Face names, all at once (``hf_plan``)."""
    return {out: cut(tensors[name]) for out, name, cut in hf_plan(cfg, set(tensors), prefix)}


def hf_entries(cfg, source) -> list[tensor_file.Entry]:
    """The Hugging Face tensors as entries a file is written from one at a time (``export.Tensors``):
    each source tensor is read once, when its first part is written, and dropped before the next is read;
    the shapes come from cutting a meta tensor of the source's shape."""
    held: dict[str, torch.Tensor] = {}

    def value(name: str) -> torch.Tensor:
        if name not in held:
            held.clear()
            held[name] = source.fetch(name)
        return held[name]

    entries = []
    for out, name, cut in hf_plan(cfg, set(source.shapes)):
        shape = list(cut(torch.empty(source.shapes[name], device="meta")).shape)
        entries.append(
            tensor_file.Entry(out, source.dtypes[name], shape, lambda n=name, c=cut: c(value(n)).contiguous())
        )
    return entries


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
        "goat_key_bias_lanes": key_bias_lanes(g),  # the saved count; a config from before the key: 3
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


def write_hf(dest: Path, model: dict, source, metadata: dict, dtype: str, tokenizer: Path | None) -> None:
    """Write the Hugging Face directory into ``dest`` (an empty directory); ``source`` gives the
    checkpoint's tensors one at a time (``export.Tensors``), so host memory holds about one tensor."""
    cfg = _settings(model)
    if cfg.position == "rope":
        check_llama(cfg)
    elif cfg.position not in REMOTE_POSITIONS:
        raise CheckpointError(
            f"model.position={cfg.position}: no Hugging Face export for this position scheme"
        )
    padded = source.shapes["embedding.weight"][0]
    if padded < cfg.vocab_size or padded != padded_vocab_size(cfg.vocab_size, cfg.vocab_pad_multiple, 1):
        raise CheckpointError(
            f"embedding has {padded} rows, not model.vocab_size={cfg.vocab_size} padded to "
            f"model.vocab_pad_multiple={cfg.vocab_pad_multiple}"
        )
    special = _special_tokens(tokenizer)
    ids = {}
    if special:
        ids = {"bos_token_id": special["id"], "eos_token_id": special["id"]}
    tensor_file.write(dest / "model.safetensors", hf_entries(cfg, source), {**metadata, "format": "pt"})
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
