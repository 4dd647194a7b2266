"""Evaluation reports: run a task over a loaded model (``session.Session``) into a JSON-ready dict, and
write it as JSON plus its picture, atomically: ``<out>/passkey.json``; perplexity per data set and split
(``data_check.ppl_stem``), the lengths of earlier runs of the same checkpoint on the same data kept."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..atomic import atomic_write_text
from .session import Session, builtin_data


def ppl_report(
    session: Session,
    data: str,
    split: str,
    lengths: list[int],
    tokens: int,
    batch_tokens: int,
    allow_other_tokenizer: bool = False,
):
    """Perplexity of ``data`` at each length, after ``data_check.check_data`` (the data set's tokenizer
    and vocabulary against the model's)."""
    from ..data.sources import load_manifest
    from .data_check import check_data
    from .perplexity import PROTOCOL, perplexity_at

    path = builtin_data(session.loaded, session.layout.is_main) if data == "builtin" else data
    checked = check_data(session.loaded, path, load_manifest(path), allow_other_tokenizer)
    results = []
    for length in lengths:
        results.append(
            perplexity_at(
                session.model,
                path,
                split,
                length,
                tokens,
                batch_tokens,
                session.device,
                session.autocast,
                session.loaded.cfg.seq_len,
                bos_framing=trained_framed(session.loaded),
            )
        )
    return {
        "task": "ppl",
        **session.describe(),
        "data": path,
        "split": split,
        **checked,
        "token_budget": tokens,
        "protocol": PROTOCOL,
        "results": results,
    }


def trained_framed(loaded) -> bool:
    """Whether the run trained on BOS-framed windows (``data.bos_framing``): evaluation frames its windows
    the same way. An export directory keeps no data settings: unframed."""
    return bool(((loaded.run_config or {}).get("data") or {}).get("bos_framing", False))


# what must match for an earlier file's lengths to join a new report's: the same measurement otherwise
SAME_MEASUREMENT = ("checkpoint", "step", "split", "data_manifest_sha256", "token_budget", "tokenizer_check")


def merge_earlier(report: dict, path: Path) -> tuple[dict, str | None]:
    """``report`` with the lengths ``path`` holds from an earlier run of the same measurement
    (``SAME_MEASUREMENT``) that this one did not repeat; and a note when ``path`` held another
    measurement of this data set (another step, token budget) that the new report replaces."""
    try:
        earlier = json.loads(path.read_text())
    except (OSError, ValueError):
        return report, None
    if any(earlier.get(k) != report.get(k) for k in SAME_MEASUREMENT):
        was = ", ".join(f"{k} {earlier.get(k)}" for k in ("step", "token_budget"))
        return report, f"replaced {path} (it held {was})"
    new = {r["length"] for r in report["results"]}
    kept = [r for r in earlier.get("results", []) if r.get("length") not in new]
    results = sorted([*report["results"], *kept], key=lambda r: r["length"])
    return {**report, "results": results}, None


def write_ppl(report: dict, out: Path, label: str | None = None) -> tuple[Path, Path, str | None]:
    """(json, png, note): one data set's results in ``<out>/<ppl_stem>.json`` and its picture, merged with
    the lengths an earlier run of the same measurement left there (``merge_earlier``)."""
    from .data_check import ppl_stem
    from .plots import ppl_figure, write_png

    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{ppl_stem(report)}.json"
    report, note = merge_earlier(report, path)
    atomic_write_text(path, json.dumps(report, indent=1))
    label = label or report["position"]
    title = f"{label}: perplexity vs length (trained at {report['train_seq_len']})"
    png = write_png(
        ppl_figure({label: report["results"]}, report["train_seq_len"], title), path.with_suffix(".png")
    )
    return path, png, note


def passkey_report(session: Session, lengths, depths, samples: int, seed: int, batch_tokens: int) -> dict:
    from .passkey import retrieval_accuracy

    cells = [
        retrieval_accuracy(session.model, n, d, samples, seed, batch_tokens, session.device, session.autocast)
        for n in lengths
        for d in depths
    ]
    rows = [cells[i * len(depths) : (i + 1) * len(depths)] for i in range(len(lengths))]
    grid = [[c["accuracy"] for c in row] for row in rows]
    digits = [[c["digit_accuracy"] for c in row] for row in rows]
    trained = ((session.loaded.run_config or {}).get("data") or {}).get("synthetic") == "passkey"
    return {
        "task": "passkey",
        **session.describe(),
        "trained_on_passkey": trained,
        "lengths": lengths,
        "depths": depths,
        "samples_per_cell": samples,
        "seed": seed,
        "accuracy": grid,
        "digit_accuracy": digits,
        "cells": cells,
    }


def keep_earlier(path: Path, report: dict, *also: Path) -> str | None:
    """An earlier report at ``path`` of another checkpoint (``checkpoint`` or ``step`` differ) is kept, not
    replaced: renamed to ``<stem>.step<N><suffix>``, the files ``also`` (its picture) alike; the note says
    where. The same checkpoint measured again replaces its report."""
    try:
        earlier = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(earlier, dict) or all(earlier.get(k) == report.get(k) for k in ("checkpoint", "step")):
        return None
    tag, n = f"step{earlier.get('step')}", 1
    while any(p.with_name(f"{p.stem}.{tag}{p.suffix}").exists() for p in (path, *also)):
        n += 1  # that step's report is kept already (another checkpoint path): a new name, never over it
        tag = f"step{earlier.get('step')}-{n}"
    for p in (path, *also):
        if p.exists():
            os.replace(p, p.with_name(f"{p.stem}.{tag}{p.suffix}"))
    kept = path.with_name(f"{path.stem}.{tag}{path.suffix}")
    return f"kept the earlier report (step {earlier.get('step')}) as {kept}"


def write_passkey(report: dict, out: Path) -> tuple[Path, Path, str | None]:
    """(json, png, note): the report in ``<out>/passkey.json`` and its picture; an earlier one of another
    checkpoint is kept beside them (``keep_earlier``)."""
    from .plots import passkey_figure, write_png

    out.mkdir(parents=True, exist_ok=True)
    note = keep_earlier(out / "passkey.json", report, out / "passkey.png")
    atomic_write_text(out / "passkey.json", json.dumps(report, indent=1))
    title = f"{report['position']}: passkey retrieval ({report['samples_per_cell']} samples per cell)"
    fig = passkey_figure(
        report["lengths"],
        report["depths"],
        report["accuracy"],
        report["train_seq_len"],
        title,
        digit_accuracy=report.get("digit_accuracy"),
    )
    return out / "passkey.json", write_png(fig, out / "passkey.png"), note
