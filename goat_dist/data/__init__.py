"""Data layer: offline corpus, BPE tokenizer, webdataset tar shards with a manifest, sequence packing.

Module boundaries: `corpus` produces texts, `tokenizer` turns texts into ids, `shards` owns the
on-disk format, `builtin` wires them together for the default data set.

The production path: `inputs` reads raw corpora, `prepare` (+ `restart`) tokenizes them into
shards, `inspection` verifies them, `commands` exposes all three as `goat-dist data ...`; `loader`
serves per-rank micro-batches from weighted sources (`sources`: where the shards are, `schedule`:
which window feeds which sample, `reader`: reading token ranges).
"""

from goat_dist.data.builtin import builtin_dataset_dir, prepare_builtin_dataset, split_shard_paths
from goat_dist.data.corpus import stdlib_documents
from goat_dist.data.loader import PackedBatches, build_train_loader, build_val_loader
from goat_dist.data.shards import (
    FORMAT,
    ShardError,
    ShardWriter,
    iter_documents,
    read_manifest,
    verify_shards,
    write_manifest,
)
from goat_dist.data.tokenizer import EOS_TOKEN, eos_id, load_tokenizer, train_bpe

__all__ = [
    "EOS_TOKEN",
    "FORMAT",
    "PackedBatches",
    "ShardError",
    "ShardWriter",
    "build_train_loader",
    "build_val_loader",
    "builtin_dataset_dir",
    "eos_id",
    "iter_documents",
    "load_tokenizer",
    "prepare_builtin_dataset",
    "read_manifest",
    "split_shard_paths",
    "stdlib_documents",
    "train_bpe",
    "verify_shards",
    "write_manifest",
]
