"""Offline corpus tools: tokenizer training, shard preparation, inspection, the builtin data set.

Why a package of its own: data preparation runs on CPU nodes, long before and apart from
training, so nothing here imports torch, megatron or deepspeed (a test checks it; note that
`import webdataset` imports torch, so shards are written and read with the stdlib `tarfile`).
The trainer (`goat_dist.data`) reads what this writes through the same `shard_format` module.

Modules, one job each:
  shard_format  the on-disk format: names, sample keys, id dtypes, tar decoding, the manifest
  writer        ShardWriter: documents -> size-capped, reproducible tar shards
  digest        sha256/size of bytes streaming through a file (written or read shards)
  inputs        raw corpora (text, JSONL, Parquet, Arrow; .gz/.zst) -> documents, errors by file:line
  hf_datasets   Hugging Face datasets on disk (save_to_disk directories, Arrow files), read with pyarrow
  tokenizer     byte-level BPE: train, load, EOS
  encode        chunked, parallel, order-preserving tokenization
  prepare       the pipeline: documents -> train/val split -> shards + manifest (`prepare`)
  restart       what an interrupted `prepare` already finished
  inspection    `inspect` (counts, histogram, samples, full check) and `verify_shards`
  shard_files   the seconds-long check: every listed file there at its size (doctor, start of training)
  corpus        the Python stdlib as an offline text corpus
  builtin       the default data set: stdlib corpus -> tokenizer -> `prepare` pipeline, cached
  cli           the command line: `python -m data_tools ...` == `goat-dist data ...`
"""
