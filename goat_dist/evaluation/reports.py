"""Evaluation reports: run a task over a loaded model (``session.Session``) into a JSON-ready dict, and
write it as ``<out>/<task>.json`` plus its picture."""

from __future__ import annotations

import json
from pathlib import Path

from .session import Session, builtin_data


def ppl_report(session: Session, data: str, split: str, lengths: list[int], tokens: int, batch_tokens: int):
    from .perplexity import PROTOCOL, perplexity_at

    path = builtin_data(session.loaded, session.layout.is_main) if data == "builtin" else data
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
            )
        )
    return {
        "task": "ppl",
        **session.describe(),
        "data": path,
        "split": split,
        "token_budget": tokens,
        "protocol": PROTOCOL,
        "results": results,
    }


def write_ppl(report: dict, out: Path, label: str | None = None) -> tuple[Path, Path]:
    from .plots import ppl_figure, write_png

    out.mkdir(parents=True, exist_ok=True)
    (out / "ppl.json").write_text(json.dumps(report, indent=1))
    label = label or report["position"]
    title = f"{label}: perplexity vs length (trained at {report['train_seq_len']})"
    png = write_png(ppl_figure({label: report["results"]}, report["train_seq_len"], title), out / "ppl.png")
    return out / "ppl.json", png


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


def write_passkey(report: dict, out: Path) -> tuple[Path, Path]:
    from .plots import passkey_figure, write_png

    out.mkdir(parents=True, exist_ok=True)
    (out / "passkey.json").write_text(json.dumps(report, indent=1))
    title = f"{report['position']}: passkey retrieval ({report['samples_per_cell']} samples per cell)"
    fig = passkey_figure(
        report["lengths"],
        report["depths"],
        report["accuracy"],
        report["train_seq_len"],
        title,
        digit_accuracy=report.get("digit_accuracy"),
    )
    return out / "passkey.json", write_png(fig, out / "passkey.png")
