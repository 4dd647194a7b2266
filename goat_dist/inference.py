"""Load an exported model (``goat-dist ckpt export``) on one process, and greedy generation.

from goat_dist.inference import load_exported, generate
model, tokenizer = load_exported("exported/")
print(generate(model, tokenizer, "def fibonacci(n):", max_new_tokens=40))
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file

from data_tools.shard_format import TOKENIZER_NAME

from .config import GoatConfig, ModelConfig


def load_exported(path: str | Path, dtype: torch.dtype = torch.float32):
    """(model in eval mode, tokenizer or None). Initialises a one-process world if none exists."""
    from . import distributed
    from .model import GPT

    warnings.filterwarnings("ignore", module="megatron")
    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    raw["goat"] = GoatConfig(**raw.get("goat", {}))
    cfg = ModelConfig(**raw)
    if not torch.distributed.is_initialized():
        distributed.init(tp=1)
    model = GPT(cfg)
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


@torch.no_grad()
def generate(model, tokenizer, prompt: str, max_new_tokens: int = 50) -> str:
    """Greedy decoding (the whole sequence re-run per token: a smoke path, not a server)."""
    ids = tokenizer.encode(prompt).ids or [0]
    vocab = model.vocab_size
    for _ in range(max_new_tokens):
        window = ids[-model.cfg.seq_len :]
        tokens = torch.tensor([window])
        logits = model(tokens, torch.arange(len(window))[None])[0, -1, :vocab]
        ids.append(int(logits.argmax()))
    return tokenizer.decode(ids)
