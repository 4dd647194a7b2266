"""Training and validation batches for this rank, from the configured dataset(s)."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from ..config import Config, ConfigError
from ..data import build_train_loader, build_val_loader, prepare_builtin_dataset, read_manifest
from ..data.shards import is_url
from ..distributed import Layout


def data_sources(cfg: Config, layout: Layout, log=print) -> list[dict]:
    """``[{path, weight}]``: the builtin corpus (built once, by rank 0), one shard dir, a mixture, or the
    manifest-only directory that describes a generated task (``data.synthetic``)."""
    if cfg.data.synthetic:
        from ..data import synthetic

        cache = Path(cfg.data.cache_dir).expanduser()
        if layout.is_main:
            synthetic.source_dir(cfg.data.synthetic, cache)
        dist.barrier()
        sources = [{"path": str(synthetic.source_dir(cfg.data.synthetic, cache)), "weight": 1.0}]
    elif cfg.data.sources:
        sources = [
            {
                "path": s["path"] if is_url(s["path"]) else str(Path(s["path"]).expanduser()),
                "weight": float(s.get("weight", 1.0)),
            }
            for s in cfg.data.sources
        ]
    elif cfg.data.source == "builtin":
        cache = Path(cfg.data.cache_dir).expanduser()
        kwargs = dict(vocab_size=cfg.model.vocab_size, max_bytes=cfg.data.builtin_max_bytes)
        if layout.is_main:
            prepare_builtin_dataset(cache, log=log, **kwargs)
        dist.barrier()
        sources = [
            {"path": str(prepare_builtin_dataset(cache, log=lambda *a: None, **kwargs)), "weight": 1.0}
        ]
    else:
        sources = [{"path": str(Path(cfg.data.source).expanduser()), "weight": 1.0}]
    for src in sources:
        if is_url(src["path"]):
            continue  # remote: the loader reads its manifest
        vocab = read_manifest(src["path"])["vocab_size"]
        if vocab > cfg.model.vocab_size:
            raise ConfigError(
                f"data source {src['path']} was tokenized with vocab_size {vocab} but model.vocab_size is "
                f"{cfg.model.vocab_size}"
            )
    return sources


def train_loader(cfg: Config, layout: Layout, sources: list[dict], start_sample: int = 0):
    """This rank's micro-batches from global sample ``start_sample`` on (exact resume)."""
    d = cfg.data
    if d.synthetic:
        from ..data import synthetic

        return synthetic.build_loader(
            d.synthetic,
            "train",
            cfg.model.seq_len,
            cfg.train.micro_batch_size,
            layout.dp_rank,
            layout.dp,
            seed=cfg.train.seed,
            start_sample=start_sample,
            num_workers=d.num_workers,
        )
    return build_train_loader(
        sources,
        seq_len=cfg.model.seq_len,
        micro_batch_size=cfg.train.micro_batch_size,
        dp_rank=layout.dp_rank,
        dp_size=layout.dp,
        seed=cfg.train.seed,
        start_sample=start_sample,
        num_workers=d.num_workers,
        document_masking=d.document_masking,
        shuffle_buffer=d.shuffle_buffer,
        on_error=d.on_error,
        cache_dir=d.cache_dir,
        window_order=d.window_order,
    )


def val_loader(cfg: Config, layout: Layout, sources: list[dict]):
    d = cfg.data
    if d.synthetic:
        from ..data import synthetic

        return synthetic.build_loader(
            d.synthetic,
            "val",
            cfg.model.seq_len,
            cfg.train.micro_batch_size,
            layout.dp_rank,
            layout.dp,
            seed=0,
        )
    return build_val_loader(
        sources,
        seq_len=cfg.model.seq_len,
        micro_batch_size=cfg.train.micro_batch_size,
        dp_rank=layout.dp_rank,
        dp_size=layout.dp,
        num_workers=0,
        document_masking=d.document_masking,
        on_error=d.on_error,
        cache_dir=d.cache_dir,
    )
