"""Training and validation batches for this rank, from the configured dataset(s)."""

from __future__ import annotations

from pathlib import Path

from data_tools.builtin import prepare_builtin_dataset
from data_tools.shard_format import MANIFEST_NAME, read_manifest

from .. import collectives
from ..config import Config, ConfigError
from ..distributed import Layout
from .loader import build_train_loader, build_val_loader
from .shards import is_url


def data_sources(cfg: Config, layout: Layout, log=print) -> list[dict]:
    """``[{path, weight}]``: the builtin corpus (built once, by rank 0), one shard dir, a mixture, or the
    manifest-only directory that describes a generated task (``data.synthetic``)."""
    if cfg.data.synthetic:
        from . import synthetic

        cache = Path(cfg.data.cache_dir).expanduser()
        if layout.is_main:
            synthetic.source_dir(cfg.data.synthetic, cache)
        collectives.barrier()
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
        collectives.barrier()
        sources = [
            {"path": str(prepare_builtin_dataset(cache, log=lambda *a: None, **kwargs)), "weight": 1.0}
        ]
    else:
        sources = [{"path": str(Path(cfg.data.source).expanduser()), "weight": 1.0}]
    for src in sources:
        check_source(f"data source {src['path']}", src["path"], cfg.model.vocab_size)
    return sources


def check_source(setting: str, path: str, vocab_size: int) -> None:
    """A local data set at ``path`` exists and fits ``model.vocab_size``, else a ConfigError naming
    ``setting`` and the fix (URL sources: the loader reads and checks their manifest)."""
    if is_url(path):
        return
    where = Path(path).expanduser()
    if not (where / MANIFEST_NAME).is_file():
        raise ConfigError(
            f"{setting}: no data set there ({where / MANIFEST_NAME} not found); point it at a directory "
            "written by `goat-dist data prepare`, or use data.source=builtin"
        )
    vocab = read_manifest(where)["vocab_size"]
    if vocab > vocab_size:
        raise ConfigError(
            f"{setting} was tokenized with vocab_size {vocab}, larger than model.vocab_size={vocab_size}; "
            f"set model.vocab_size={vocab}, or leave it out (the data set's vocabulary is then used)"
        )


def pinned(layout: Layout) -> bool:
    """Batches in page-locked host memory on CUDA: the trainer's ``non_blocking`` copy to the device is
    then truly asynchronous (from pageable memory it is a synchronous staging copy)."""
    return layout.device.type == "cuda"


def train_loader(cfg: Config, layout: Layout, sources: list[dict], start_sample: int = 0):
    """This rank's micro-batches from global sample ``start_sample`` on (exact resume)."""
    d = cfg.data
    if d.synthetic:
        from . import synthetic

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
            pin_memory=pinned(layout),
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
        pin_memory=pinned(layout),
    )


def val_loader(cfg: Config, layout: Layout, sources: list[dict]):
    d = cfg.data
    if d.synthetic:
        from . import synthetic

        return synthetic.build_loader(
            d.synthetic,
            "val",
            cfg.model.seq_len,
            cfg.train.micro_batch_size,
            layout.dp_rank,
            layout.dp,
            seed=0,
            pin_memory=pinned(layout),
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
        pin_memory=pinned(layout),
    )
