"""Training and validation batches for this rank, from the configured dataset."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
from torch.utils.data import DataLoader

from ..config import Config, ConfigError
from ..data import PackedSequences, prepare_builtin_dataset, read_manifest, split_shard_paths
from ..distributed import Layout


def dataset_dir(cfg: Config, layout: Layout, log=print) -> Path:
    """The shard directory: the builtin corpus (built once, by rank 0) or a ``goat data`` output."""
    if cfg.data.source == "builtin":
        cache = Path(cfg.data.cache_dir).expanduser()
        if layout.is_main:
            prepare_builtin_dataset(
                cache, vocab_size=cfg.model.vocab_size, max_bytes=cfg.data.builtin_max_bytes, log=log
            )
        dist.barrier()
        path = prepare_builtin_dataset(
            cache, vocab_size=cfg.model.vocab_size, max_bytes=cfg.data.builtin_max_bytes, log=lambda *a: None
        )
    else:
        path = Path(cfg.data.source).expanduser()
    manifest = read_manifest(path)
    if manifest["vocab_size"] > cfg.model.vocab_size:
        raise ConfigError(
            f"data.source {path} was tokenized with vocab_size {manifest['vocab_size']} but "
            f"model.vocab_size is {cfg.model.vocab_size}"
        )
    return path


def loader(cfg: Config, layout: Layout, path: Path, split: str, seed_offset: int = 0, start_sample: int = 0):
    shards = split_shard_paths(path, split)
    if not shards:
        raise ConfigError(f"data.source {path} has no '{split}' shards")
    dataset = PackedSequences(
        shards,
        seq_len=cfg.model.seq_len,
        seed=cfg.train.seed + seed_offset,
        dp_rank=layout.dp_rank,
        dp_size=layout.dp,
        shuffle_buffer=cfg.data.shuffle_buffer,
    )
    batches = iter(
        DataLoader(dataset, batch_size=cfg.train.micro_batch_size, num_workers=cfg.data.num_workers)
    )
    per_rank = start_sample // layout.dp  # this rank's share of the samples already consumed
    for _ in range(per_rank // cfg.train.micro_batch_size):
        next(batches)
    return batches
