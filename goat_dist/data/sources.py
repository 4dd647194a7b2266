"""Where a loader's shards are: source specs, shard locations and the manifest's token counts.

Why: the loader lays out its sample stream from the manifest alone (token counts per shard), so
it can skip whole shards on resume without opening them. Everything it needs about a data set
is collected here, once, before any worker starts.

A source is `{"path": P, "weight": w}` (or just `P`, weight 1). `P` is a local data set directory
(`goat-dist data prepare` output) or a URL prefix that webdataset's `gopen` opens, e.g.
`pipe:aws s3 cp s3://bucket/ds/{} -` or `https://host/ds`: the file `name` is located by
replacing `{}` with it, or else by appending `/name`. The manifest is read the same way.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from data_tools.shard_format import MANIFEST_NAME, locate, parse_manifest, read_manifest
from goat_dist.config import ConfigError
from goat_dist.data.shards import is_url, open_shard


@dataclass(frozen=True)
class SourceSplit:
    """One split of one source: shard locations with their manifest token counts."""

    path: str
    weight: float
    shards: tuple[str, ...]
    n_tokens: tuple[int, ...]
    vocab_size: int
    eos_id: int
    tokenizer_sha256: str | None
    entries: tuple[dict, ...] = ()  # the manifest's shard entries (size, sha256, index), by shard

    @property
    def total_tokens(self) -> int:
        return sum(self.n_tokens)


# how to get a split a data set lacks (errors of a user's are ConfigErrors: exit 2, one message)
FIX_SPLIT = {
    "val": "prepare the data with a val split (`goat-dist data prepare --val-docs N`); a run trains "
    "without one at train.eval_interval=0, and `eval ppl --split train` reads the train split",
    "train": "prepare it again with fewer validation documents (`--val-docs` / `--val-fraction`)",
}


def load_manifest(path: str) -> dict:
    """The manifest of a local directory or a URL prefix."""
    if not is_url(path):
        return read_manifest(Path(path).expanduser())
    url = locate(path, MANIFEST_NAME)
    f = open_shard(url)
    try:
        data = f.read()
    finally:
        f.close()
    return parse_manifest(data, url)


def normalize_sources(sources: Sequence[dict | str | os.PathLike] | str | os.PathLike) -> list[dict]:
    """`[{"path": str, "weight": float}, ...]` from the accepted spellings; checks keys and weights."""
    if isinstance(sources, (str, os.PathLike, dict)):
        sources = [sources]
    out = []
    for i, src in enumerate(sources):
        if isinstance(src, (str, os.PathLike)):
            src = {"path": src}
        if not isinstance(src, dict) or "path" not in src:
            raise ValueError(f"source {i}: expected a path or a dict with 'path' (and 'weight'), got {src!r}")
        unknown = sorted(set(src) - {"path", "weight"})
        if unknown:
            raise ValueError(f"source {i}: unknown keys {unknown}; allowed: path, weight")
        weight = float(src.get("weight", 1.0))
        if not weight > 0:
            raise ValueError(f"source {i} ({src['path']}): weight must be > 0, got {src.get('weight')}")
        out.append({"path": os.fspath(src["path"]), "weight": weight})
    if not out:
        raise ValueError("need at least one data source")
    return out


def resolve_split(source: dict, split: str) -> SourceSplit:
    """Read the source's manifest and list the shards of `split` with their token counts."""
    path = source["path"]
    manifest = load_manifest(path)
    if not manifest["splits"].get(split):
        have = ", ".join(f"{k} ({len(v)} shards)" for k, v in manifest["splits"].items())
        raise ConfigError(
            f"data source {path} has no {split!r} shards (its manifest lists: {have or 'nothing'}); "
            f"{FIX_SPLIT.get(split, 'use a data set that has that split')}"
        )
    entries = manifest["splits"][split]
    counts = []
    for e in entries:
        n = e.get("n_tokens")
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"data source {path}: shard {e['name']} has no valid 'n_tokens' in the manifest")
        counts.append(n)
    return SourceSplit(
        path=path,
        weight=source["weight"],
        shards=tuple(locate(path, e["name"]) for e in entries),
        n_tokens=tuple(counts),
        vocab_size=manifest["vocab_size"],
        eos_id=int(manifest.get("eos_id", 0)),
        tokenizer_sha256=manifest.get("tokenizer_sha256"),
        entries=tuple(entries),
    )


def resolve_sources(sources, split: str) -> list[SourceSplit]:
    """Resolve every source; all must share one tokenizer where their manifests name it."""
    resolved = [resolve_split(s, split) for s in normalize_sources(sources)]
    shas = {s.tokenizer_sha256 for s in resolved if s.tokenizer_sha256}
    if len(shas) > 1:
        listing = ", ".join(f"{s.path}: {s.tokenizer_sha256}" for s in resolved)
        raise ConfigError(
            f"data sources were tokenized with different tokenizers ({listing}); prepare every source "
            "with the same tokenizer.json (`goat-dist data prepare --tokenizer FILE`)"
        )
    return resolved
