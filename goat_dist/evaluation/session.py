"""One evaluation's setup: process groups for the checkpoint's layout, the model on its device, the
autocast context, and where its data and outputs are. Shared by ``goat-dist eval`` and ``goat-dist study``."""

from __future__ import annotations

import os
from pathlib import Path


def free_large_buffers_at_once(threshold: int = 256 << 10) -> None:
    """Serve host buffers of ``threshold`` bytes and more from their own mappings, unmapped when freed.
    glibc raises its mmap threshold each time a large mapped buffer is freed (up to 32 MiB), so after the
    weights are read every activation buffer of a batch comes from the heap and stays there when freed:
    18 MiB per rank for one batch of a 12-layer, 768-wide model on 2 ranks, 0.06 x a 327 MiB model, on
    top of its slice. A fixed threshold turns that off (``mallopt(M_MMAP_THRESHOLD)``)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, threshold)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc: its allocator has its own policy
        pass


def release_freed_memory() -> None:
    """Hand memory freed on the host back to the system (glibc keeps freed heap pages for reuse): after the
    weights are read, what a rank holds is its slice of the model, not its slice plus the read's freed
    buffers, on which the evaluation's own working memory would stack."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to hand back this way
        pass


class Session:
    """Process groups, the loaded model on its device and the autocast context of one evaluation."""

    def __init__(self, checkpoint: str, tp: int | None, backend: str | None, precision: str):
        import torch

        from .. import distributed
        from ..precision import autocast_for
        from .checkpoint import build_model, read_checkpoint

        free_large_buffers_at_once()
        cfg, read = read_checkpoint(checkpoint, backend)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        tp = tp or world
        distributed.check_layout(
            world, tp, cfg.num_heads, cfg.num_kv_heads or cfg.num_heads, cfg.seq_len, False
        )
        self.layout = distributed.init(tp=tp)
        self.loaded = build_model(cfg, read, self.layout)
        self.model = self.loaded.model.to(self.layout.device)
        release_freed_memory()  # the read's buffers: a rank then holds its slice, not its slice + buffers
        self.device = self.layout.device
        self.autocast = autocast_for(precision, self.device)
        torch.set_grad_enabled(False)

    def release_model(self) -> None:
        """Drop the model once its numbers are computed, so that writing the report (rank 0 draws a figure)
        does not add to the peak host memory the weights set: a rank holds its TP slice, then the report."""
        import gc

        self.loaded.model = self.model = None
        gc.collect()

    def describe(self) -> dict:
        from ..observe.flops import non_embedding_params

        cfg, loaded = self.loaded.cfg, self.loaded
        return {
            "checkpoint": str(loaded.source),
            "step": loaded.step,
            "position": cfg.position,
            "train_seq_len": cfg.seq_len,
            "head_dim": cfg.hidden_size // cfg.num_heads,
            "num_layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size,
            "non_embedding_params": non_embedding_params(cfg),
            "attention_backend": self.model.blocks[0].attn.backend,
            "tp": self.layout.tp,
            "dp": self.layout.dp,
        }

    def out_dir(self, requested: str | None) -> Path:
        if requested:
            return Path(requested)
        base = self.loaded.run_dir or self.loaded.source
        return Path(base) / "eval"


def builtin_data(loaded, is_main: bool) -> str:
    """The builtin corpus the run trained on (its config's cache dir, vocabulary and size)."""
    from .. import collectives
    from ..config import DataConfig
    from ..data import prepare_builtin_dataset

    data = (loaded.run_config or {}).get("data") or {}
    defaults = DataConfig()
    kwargs = dict(
        vocab_size=loaded.cfg.vocab_size, max_bytes=data.get("builtin_max_bytes", defaults.builtin_max_bytes)
    )
    cache = Path(data.get("cache_dir", defaults.cache_dir)).expanduser()
    if is_main:
        prepare_builtin_dataset(cache, **kwargs)
    collectives.barrier()
    return str(prepare_builtin_dataset(cache, log=lambda *a: None, **kwargs))


def run_data_sets(loaded, is_main: bool, required: bool = True) -> list[str]:
    """The data sets the checkpoint's run trained on, from its config (``data.sources``, else
    ``data.source``; the builtin corpus only when the run trained on it, prepared again only if its cache
    is gone): what ``eval ppl`` and ``eval harness`` read by default, so a model trained on a user's corpus
    is never measured on another. ``required``: no data set (an export records none, a synthetic run has
    none) raises EvalError saying to pass ``--data``; else returns []."""
    from . import EvalError

    data = (loaded.run_config or {}).get("data")
    why = None
    if not data:
        why = f"{loaded.source} records no training data (an export directory keeps only the model)"
    elif data.get("synthetic"):
        why = f"the run trained on generated data (data.synthetic={data['synthetic']}), no text data set"
    elif data.get("sources"):
        return [str(s["path"]) for s in data["sources"] if isinstance(s, dict) and "path" in s]
    elif data.get("source", "builtin") == "builtin":
        return [builtin_data(loaded, is_main)]
    else:
        return [str(data["source"])]
    if required:
        raise EvalError(f"{why}: pass --data DIR (a `goat-dist data prepare` directory, or builtin)")
    return []
