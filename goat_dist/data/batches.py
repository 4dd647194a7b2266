"""Training and validation batches for this rank, from the configured dataset(s), and the checks made on
those data sets before training reads them (``check_sources``): a user's mistake is found at the start,
by name, not when training reaches it."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from data_tools.builtin import prepare_builtin_dataset
from data_tools.shard_files import shard_file_problems, summarize_problems
from data_tools.shard_format import MANIFEST_NAME, ShardError, read_manifest

from .. import collectives
from ..config import Config, ConfigError
from ..distributed import Layout
from .loader import build_train_loader, build_val_loader
from .shards import is_url


def data_sources(cfg: Config, layout: Layout, log=print) -> list[dict]:
    """``[{path, weight}]``: the builtin corpus (built once, by rank 0), one shard dir, a mixture, or the
    manifest-only directory that describes a generated task (``data.synthetic``). Checked as
    ``check_sources`` checks them (a check already made in this process is not repeated)."""
    if cfg.data.synthetic:
        from . import synthetic

        cache = Path(cfg.data.cache_dir).expanduser()
        if layout.is_main:
            synthetic.source_dir(cfg.data.synthetic, cache)
        collectives.barrier()
        return [{"path": str(synthetic.source_dir(cfg.data.synthetic, cache)), "weight": 1.0}]
    if cfg.data.sources:
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
    named = _named(cfg) or [(f"data source {s['path']}", s["path"]) for s in sources]
    _check_all(cfg, named, layout.local_rank, log=_warn if layout.is_main else None)
    return sources


def check_sources(cfg: Config, log=None) -> None:
    """Every configured local data set, checked before any process group or model exists: it is there,
    fits ``model.vocab_size``, has a validation split when ``train.eval_interval`` > 0, shares one
    tokenizer with the other sources, and every shard training will read (and its index) is on disk at
    the size its manifest records. Errors name the setting and the fix (``ConfigError``; ``ShardError``
    for shard files). The builtin corpus (built at the start) and generated data are left out.

    The shard check is one ``stat`` per file, nothing read (seconds for thousands of shards), made by the
    first process of each node only (``LOCAL_RANK`` 0): the files are the node's mount, and the other
    processes of a node would ask its metadata server the same questions again, 8 x the load at 512 ranks.
    When that process refuses, the launcher stops the node's others. ``log``: where a warning goes
    under ``data.on_error=skip`` (default: logger ``goat_dist.data``, as the reader's, on global rank 0)."""
    named = _named(cfg)
    if named:
        log = log or (_warn if os.environ.get("RANK", "0") == "0" else None)
        # the launcher's local rank (distributed.node_local_rank: LOCAL_RANK may name the device instead)
        local_rank = os.environ.get("GOAT_NODE_LOCAL_RANK", os.environ.get("LOCAL_RANK", "0"))
        _check_all(cfg, named, int(local_rank), log=log)


def _named(cfg: Config) -> list[tuple[str, str]]:
    """(setting, path) of each configured data set; none for the builtin corpus or generated data."""
    d = cfg.data
    if d.synthetic or (not d.sources and d.source == "builtin"):
        return []
    if d.sources:
        return [(f"data.sources[{i}].path={s['path']}", str(s["path"])) for i, s in enumerate(d.sources)]
    return [(f"data.source={d.source}", str(d.source))]


def _warn(text: str) -> None:
    logging.getLogger("goat_dist.data").warning("%s", text)


def _check_all(cfg: Config, named: list[tuple[str, str]], local_rank: int, log) -> None:
    every = cfg.train.eval_interval
    manifests = [
        (setting, check_source(setting, path, cfg.model.vocab_size, eval_interval=every))
        for setting, path in named
    ]
    tokenizers = {m.get("tokenizer_sha256") for _, m in manifests if m and m.get("tokenizer_sha256")}
    if len(tokenizers) > 1:
        listing = "; ".join(f"{s}: {m.get('tokenizer_sha256')}" for s, m in manifests if m)
        raise ConfigError(
            "the data sources were tokenized with different tokenizers (tokenizer_sha256 of their "
            f"manifests: {listing}); one model reads one vocabulary: prepare every source with the same "
            "tokenizer.json (`goat-dist data prepare --tokenizer FILE`), or train on the sources that "
            "share one"
        )
    if local_rank != 0:
        return
    splits = ("train", "val") if every > 0 else ("train",)
    for (setting, path), (_, manifest) in zip(named, manifests):
        if manifest is not None:
            check_shard_files(setting, path, manifest, splits, cfg.data.on_error, log)


_CHECKED: set = set()  # (data set, its manifest's stat, splits, on_error) this process has passed


def check_shard_files(
    setting: str, path: str, manifest: dict, splits: tuple[str, ...], on_error: str = "raise", log=None
) -> None:
    """The shards of ``splits`` (and their indexes) on disk at the sizes ``manifest`` lists, one ``stat``
    each, nothing read: a missing or truncated shard is found at the start, not when training reaches it.
    Raises ShardError naming the files and the fix; under ``data.on_error=skip`` (the damaged samples are
    masked as training reaches them) it warns through ``log`` and returns."""
    where = Path(path).expanduser()
    stat = (where / MANIFEST_NAME).stat()
    key = (str(where.resolve()), stat.st_mtime_ns, stat.st_size, splits, on_error)
    if key in _CHECKED:
        return
    problems = shard_file_problems(where, manifest, splits)
    listed = f"{setting}: {len(problems)} file(s) of the data set differ from {where / MANIFEST_NAME}"
    if problems and on_error != "skip":
        raise ShardError(
            f"{listed}: {summarize_problems(problems)}. Training would stop when it reached them. Fix: "
            "restore the files, or rebuild the data set (`goat-dist data prepare`; `goat-dist data inspect "
            "DIR` reads every shard), or set data.on_error=skip to train with their samples masked"
        )
    _CHECKED.add(key)
    if problems and log is not None:
        log(f"warning: {listed}: {summarize_problems(problems)}; data.on_error=skip masks their samples")


def check_source(setting: str, path: str, vocab_size: int, *, eval_interval: int = 0) -> dict | None:
    """A local data set at ``path`` exists and fits ``model.vocab_size`` (and, when ``train.eval_interval``
    > 0 evaluates on it, has a validation split), else a ConfigError naming ``setting`` and the fix.
    Returns its manifest (None for a URL source: the loader reads and checks its manifest)."""
    if is_url(path):
        return None
    where = Path(path).expanduser()
    if not (where / MANIFEST_NAME).is_file():
        raise ConfigError(
            f"{setting}: no data set there ({where / MANIFEST_NAME} not found); point it at a directory "
            "written by `goat-dist data prepare`, or use data.source=builtin"
        )
    try:
        manifest = read_manifest(where)
    except ValueError as e:
        raise ConfigError(f"{setting}: {e}; rebuild it with `goat-dist data prepare`") from None
    vocab = manifest["vocab_size"]
    if vocab > vocab_size:
        raise ConfigError(
            f"{setting} was tokenized with vocab_size {vocab}, larger than model.vocab_size={vocab_size}; "
            f"set model.vocab_size={vocab}, or leave it out (the data set's vocabulary is then used)"
        )
    if eval_interval > 0 and not manifest["splits"].get("val"):
        raise ConfigError(
            f"{setting}: the data set has no validation shards ({where / MANIFEST_NAME} lists "
            f"{_split_counts(manifest)}), but train.eval_interval={eval_interval} evaluates on its val "
            "split; set "
            "train.eval_interval=0, or prepare the data with a val split (`goat-dist data prepare "
            "--val-docs N` or `--val-fraction F`)"
        )
    return manifest


def _split_counts(manifest: dict) -> str:
    return ", ".join(f"{len(v)} {k} shard(s)" for k, v in manifest["splits"].items()) or "no splits"


def pinned(layout: Layout) -> bool:
    """Batches in page-locked host memory on CUDA: the trainer's ``non_blocking`` copy to the device is
    then truly asynchronous (from pageable memory it is a synchronous staging copy)."""
    return layout.device.type == "cuda"


def train_loader(cfg: Config, layout: Layout, sources: list[dict], start_sample: int = 0):
    """This rank's micro-batches from global sample ``start_sample`` on (exact resume); with
    ``data.bos_framing`` every window is a BOS and ``seq_len - 1`` corpus tokens (``framing``)."""
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
        cache_max_gb=d.cache_max_gb,
        remote_cache_dir=d.remote_cache_dir,
        window_order=d.window_order,
        bos_framing=d.bos_framing,
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
        cache_max_gb=d.cache_max_gb,
        remote_cache_dir=d.remote_cache_dir,
        bos_framing=d.bos_framing,  # validation windows framed as training's
        pin_memory=pinned(layout),
    )
