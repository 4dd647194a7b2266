"""The training precision, resolved once: what ``train.precision`` means on this device, and the autocast
context the forward runs in (DeepSpeed's own bf16 mode is configured from the same resolved value in
``parallelize.deepspeed_config``)."""

from __future__ import annotations

import contextlib

import torch

from ..config import Config


def resolve_precision(precision: str, device: torch.device) -> str:
    """``train.precision=auto``: DeepSpeed's bf16 mode on CUDA (fp32 masters, the fp32 GOAT prior: the
    tested bf16 path), fp32 on CPU. Resolved once, before anything reads it, so that the engine, autocast,
    the checkpoint's layout record and the saved config all see the same concrete precision."""
    if precision != "auto":
        return precision
    return "bf16" if device.type == "cuda" else "fp32"


def autocast_context(cfg: Config, device: torch.device):
    precision = resolve_precision(cfg.train.precision, device)
    if precision == "bf16":
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext
