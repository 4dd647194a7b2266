"""What training reads at run time: weighted shard sources -> packed, per-rank micro-batches.

`sources` finds a data set's shards and token counts (local directory or URL prefix), `schedule`
decides which window of which source feeds which sample, `reader` reads token ranges of an epoch,
`shards` opens shards (local or URL) and `loader` turns it all into DataLoaders. `batches` resolves
the configured data set(s) and builds this rank's training and validation loaders; `contract` is the
data contract a checkpoint records (what ``consumed_samples`` depends on) and its resume check.

Everything offline (tokenizer training, corpus preparation, inspection, the builtin stdlib data
set, the shard format and writer) lives in the torch-free `data_tools` package; the names below
that come from there are the ones the trainer and inference call at run time.

May import: torch, numpy, webdataset, the torch-free ``data_tools``, ``goat_dist.atomic``,
``goat_dist.config``, ``goat_dist.collectives`` and ``goat_dist.distributed`` (the rank layout); never the
model or the trainer.
"""

from data_tools.builtin import builtin_dataset_dir, prepare_builtin_dataset
from data_tools.shard_format import ShardError, read_manifest, split_shard_paths
from data_tools.tokenizer import load_tokenizer
from goat_dist.data.loader import IGNORE_INDEX, PackedBatches, build_train_loader, build_val_loader
from goat_dist.data.shards import iter_documents

__all__ = [
    "IGNORE_INDEX",
    "PackedBatches",
    "ShardError",
    "build_train_loader",
    "build_val_loader",
    "builtin_dataset_dir",
    "iter_documents",
    "load_tokenizer",
    "prepare_builtin_dataset",
    "read_manifest",
    "split_shard_paths",
]
