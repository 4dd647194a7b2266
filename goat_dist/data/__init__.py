"""Data layer: offline corpus, BPE tokenizer, webdataset tar shards with a manifest, sequence packing.

Module boundaries: `corpus` produces texts, `tokenizer` turns texts into ids, `shards` owns the
on-disk format, `packing` turns shards into training sequences, `builtin` wires them together for
the default data set.
"""

from goat_dist.data.builtin import builtin_dataset_dir, prepare_builtin_dataset, split_shard_paths
from goat_dist.data.corpus import stdlib_documents
from goat_dist.data.packing import PackedSequences
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
    "PackedSequences",
    "ShardError",
    "ShardWriter",
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
