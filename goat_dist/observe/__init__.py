"""What a person watching a run needs to see: throughput and MFU, memory, the GOAT prior as pictures and
how attention uses its sink, all computed here and written by the trainer's callbacks.

Modules, one job each: ``flops`` (FLOPs per token), ``peak`` (peak FLOP/s per device), ``run_info``
(code version), ``step_metrics`` (what is logged at log intervals, with its one collective), ``tags``
(metrics.jsonl key -> TensorBoard tag), ``prior_snapshot`` (the prior's curves and matrix, gathered over
TP), ``figures`` (matplotlib pictures of them), ``attention_stats`` (sink diagnostics on a batch).

May import: torch, matplotlib (pictures, lazily), ``goat_dist.atomic``, ``goat_dist.collectives``,
``goat_dist.config``, ``goat_dist.shapes``, ``goat_dist.precision``, ``goat_dist.goat`` (the prior it
pictures) and ``goat_dist.engine`` (ZeRO-3 gathers); never the trainer, whose callbacks call this package.
"""
