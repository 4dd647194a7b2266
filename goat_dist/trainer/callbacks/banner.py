"""The start of a run as the loggers show it (``on_train_start``): the layout, the model, the MFU basis,
the deadline; metrics.jsonl's ``start`` record holds the same as numbers."""

from __future__ import annotations

import torch

from ... import collectives


def start_info(trainer) -> dict:
    """Collective (the parameter counts of every rank): ``{"record": ..., "lines": ...}``."""
    from ...observe.flops import flops_per_token
    from ...observe.run_info import code_version
    from ...observe.step_metrics import device_peak

    lay, cfg = trainer.layout, trainer.cfg
    local = sum(p.numel() for p in trainer.model.parameters())
    counts = collectives.all_gather(torch.tensor([local]))
    record = {
        "world": lay.world,
        "tp": lay.tp,
        "sp": cfg.parallel.sp,
        "cp": lay.cp,
        "dp": lay.dp,
        "zero_stage": cfg.parallel.zero_stage,
        "micro_batch": cfg.train.micro_batch_size,
        "global_batch": cfg.train.global_batch_size,
        "grad_accum": trainer.grad_accum,
        "params_per_rank": [int(c) for c in counts],
        "device": str(lay.device),
        "position": cfg.model.position,
        "init_from": None if trainer.init_source is None else str(trainer.init_source),
        "attention_backend": trainer.model.blocks[0].attn.backend,
    }
    peak, peak_source = device_peak(cfg, lay.device) if lay.is_main else (None, "")
    record.update(
        code_version=code_version(),
        flops_per_token=flops_per_token(cfg.model)["total"],
        peak_tflops_per_device=peak / 1e12 if peak else None,
        peak_source=peak_source,
    )
    lines = [
        f"goat-dist run dir: {trainer.run_dir}",
        f"layout: world {lay.world} = TP {lay.tp} x CP {lay.cp} x DP {lay.dp} | SP {cfg.parallel.sp} | "
        f"ZeRO {cfg.parallel.zero_stage} | micro {cfg.train.micro_batch_size} x accum {trainer.grad_accum} "
        f"x DP {lay.dp} = global {cfg.train.global_batch_size} seqs of {cfg.model.seq_len}",
        f"model: {cfg.model.position} attention ({record['attention_backend']}), "
        f"params per rank {record['params_per_rank']}",
        f"MFU basis: {record['flops_per_token'] / 1e9:.3f} GFLOP per token (observe/flops.py), peak "
        + (f"{peak / 1e12:.2f} TFLOP/s per device" if peak else "unknown")
        + f" ({peak_source})",
    ]
    deadline = trainer.deadline
    if deadline is not None:
        lines.append(f"{deadline.describe()}: saves and exits 75 before it")
    return {"record": record, "lines": lines}
