"""The data contract: what must stay the same for ``consumed_samples`` to mean the same data on resume.

A checkpoint records it; a resume compares. The sample stream is a pure function of the sources (their
manifests and mixture weights), the tokenizer, ``seq_len``, the seed, the shuffle buffer, the window
order and document masking (see ``data/loader.py``). The layout (TP/DP/ZeRO), micro-batch size and worker
count are not part of it: the loader gives the same global stream for any of them.

``train.data_resume=check`` (default) refuses a resume whose contract differs, naming each key
old -> new. ``train.data_resume=restart`` accepts it and starts the new stream at its sample 0: the
run keeps its step, token count, weights and optimizer, records the new contract, and the loader
reads sample ``consumed_samples - stream_start`` of the new stream (``stream_start`` = the consumed
samples at the restart; logged, and kept in the run state for later resumes).
"""

from __future__ import annotations

import hashlib
import json

from ..config import Config
from .schedule import DEFAULT_WINDOW_ORDER

LEGACY_WINDOW_ORDER = "numpy"  # the order of a contract that does not name one


class DataContractError(ValueError):
    """A resume would read different data than the checkpoint consumed; the message lists the keys."""


def digest(obj) -> str:
    """sha256 of a JSON value in canonical form (sorted keys): a manifest's identity, wherever it lies."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def data_contract(cfg: Config, sources: list[dict]) -> dict:
    """The contract of this run's training stream (reads each source's manifest, not its shards)."""
    from .sources import load_manifest

    entries, tokenizers = [], set()
    for src in sources:
        manifest = load_manifest(src["path"])
        tokenizers.add(manifest.get("tokenizer_sha256"))
        entries.append({"path": src["path"], "weight": float(src["weight"]), "manifest": digest(manifest)})
    d = cfg.data
    return {
        "sources": entries,
        "tokenizer_sha256": sorted(t for t in tokenizers if t) or None,
        "seq_len": cfg.model.seq_len,
        "seed": cfg.train.seed,
        "shuffle_buffer": d.shuffle_buffer,
        "window_order": d.window_order,
        "document_masking": d.document_masking,
        "bos_framing": d.bos_framing,
    }


def differences(old: dict, new: dict) -> list[str]:
    """``key: old -> new`` for every key that changes the data stream.

    A source's path alone may change (data moved to another file system): its manifest digest and
    weight decide. Sources are compared in order (the order is part of the mixture)."""
    out = []
    for key in ("tokenizer_sha256", "seq_len", "seed", "shuffle_buffer", "document_masking"):
        if old.get(key) != new.get(key):
            out.append(f"{key}: {old.get(key)!r} -> {new.get(key)!r}")
    if old.get("bos_framing", False) != new.get("bos_framing", False):  # absent: a stream from before the key
        out.append(
            f"data.bos_framing: {old.get('bos_framing', False)!r} -> {new.get('bos_framing', False)!r}"
        )
    before = old.get("window_order", LEGACY_WINDOW_ORDER)
    after = new.get("window_order", LEGACY_WINDOW_ORDER)
    if before != after:
        out.append(f"data.window_order: {before!r} -> {after!r}")
    old_src, new_src = old.get("sources", []), new.get("sources", [])
    if len(old_src) != len(new_src):
        out.append(
            f"sources: {[s['path'] for s in old_src]} -> {[s['path'] for s in new_src]} (number of sources)"
        )
        return out
    for i, (a, b) in enumerate(zip(old_src, new_src)):
        if a["manifest"] != b["manifest"]:
            out.append(
                f"sources[{i}] manifest: {a['path']} ({a['manifest'][:12]}) -> {b['path']} "
                f"({b['manifest'][:12]})"
            )
        if a["weight"] != b["weight"]:
            out.append(f"sources[{i}].weight: {a['weight']} -> {b['weight']}")
    return out


def kept_window_order(saved: dict | None, cfg: Config) -> str | None:
    """The order a resumed stream continues in when that is not the configured one, else None: the order
    its contract records ("keyed" for streams begun before "epoch" became the default), or "numpy" when
    the contract names none (streams begun before ``data.window_order`` existed, or before contracts did).

    Why: the default changed under running jobs; a resume must stay exact without the user knowing the
    setting, and must not be refused as a data change. A config that asks for another order than the
    default is taken at its word (``check`` then names the change). The run's config takes the order
    before it is saved (``trainer/resolve.py``), so its contract and config.yaml record it."""
    recorded = (saved or {}).get("window_order", LEGACY_WINDOW_ORDER)
    if cfg.data.window_order != DEFAULT_WINDOW_ORDER or recorded == DEFAULT_WINDOW_ORDER:
        return None
    return recorded


def check(old: dict | None, new: dict, mode: str, checkpoint: str) -> bool:
    """Whether the data stream restarts. Raises ``DataContractError`` on a change under ``check``.

    A checkpoint without a recorded contract (written before contracts existed) is accepted as is."""
    if old is None:
        return False
    changed = differences(old, new)
    if not changed:
        return False
    if mode == "restart":
        return True
    raise DataContractError(
        f"resume from {checkpoint} refused: the data stream changed since it was saved ("
        + "; ".join(changed)
        + "). Resuming would silently repeat or skip data. Restore the old data settings, or set "
        "train.data_resume=restart to start the new stream from its first sample."
    )
