"""Load an exported model (``goat-dist ckpt export``) on one process, and generate text from it.

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


class ExportDirError(ValueError):
    """``--model`` is not a goat-dist export directory; the message says what it is and what to do."""


def export_config(path: str | Path) -> dict:
    """The model config of a ``goat-dist ckpt export`` directory (``config.json`` + ``model.safetensors``),
    or an ExportDirError that says what was expected and what ``path`` is instead: a run, checkpoints or
    step directory (export it first), a Hugging Face export (load it with transformers), or else."""
    path = Path(path)
    expects = f"expects a `goat-dist ckpt export` directory (model.safetensors + config.json; {EXPORT_HINT})"
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
    if not isinstance(raw, dict) or "model_type" in raw or "architectures" in raw:
        kind = raw.get("model_type") if isinstance(raw, dict) else None
        raise ExportDirError(
            f"--model {path}: {expects}; found a Hugging Face export (config.json model_type {kind!r}). "
            "Load that one with transformers (AutoModelForCausalLM.from_pretrained(PATH, "
            "trust_remote_code=True)), or export with --format goat for goat-dist generate"
        )
    return raw


def load_exported(path: str | Path, dtype: torch.dtype = torch.float32):
    """(model in eval mode, tokenizer or None). Initialises a one-process world if none exists."""
    from . import distributed
    from .model import GPT

    warnings.filterwarnings("ignore", module="megatron")
    path = Path(path)
    raw = export_config(path)
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
