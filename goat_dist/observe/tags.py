"""metrics.jsonl key -> TensorBoard tag, defined once: the TensorBoard logger writes through this table
and the README's tag table is this table, so the two files can never disagree on what a value is.

A tag with ``{i}`` belongs to a list-valued key: one tag per element (per layer for the attention
diagnostics; per rank for memory, present only with ``log.memory_per_rank``: by default memory is its
min / mean / max over ranks and the rank of the max, so the tags per log step do not grow with the
world). Keys not listed here (``data_fingerprint``, ``mfu_raw``) stay in metrics.jsonl only.

TensorBoard groups cards by a tag's first component and sorts groups and cards by name: the group
``loss`` (training and validation loss side by side) sorts before every other (``mem``, ``perf``,
``train``, ``val``), so a dashboard opens on the two curves a user looks at first.
"""

from __future__ import annotations

# written at every log step (log.interval, the first and the last step)
TRAIN_TAGS = {
    "loss": "loss/train",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "params_norm": "train/params_norm",
    "tokens_per_s": "perf/tokens_per_s",
    "tflops_per_device": "perf/tflops_per_device",
    "mfu": "perf/mfu",
    "step_time_s": "perf/step_time_s",
    **{
        f"{key}_{stat}": f"mem/{name}/{stat}"
        for key, name in (
            ("mem_allocated_gib", "allocated_gib"),
            ("mem_peak_gib", "peak_gib"),
            ("host_rss_gib", "host_rss_gib"),
        )
        for stat in ("min", "mean", "max", "max_rank")
    },
    # log.memory_per_rank only
    "mem_allocated_gib": "mem/rank_{i}/allocated_gib",
    "mem_peak_gib": "mem/rank_{i}/peak_gib",
    "host_rss_gib": "mem/rank_{i}/host_rss_gib",
    "consumed_tokens": "train/tokens_seen",
    "epoch": "train/epoch",
    "data_skipped": "train/skipped_samples",
    "nonfinite_skipped": "train/nonfinite_skipped_steps",
    "unreadable_skipped": "train/unreadable_skipped_steps",
}

# written at every evaluation (train.eval_interval and the last step)
EVAL_TAGS = {
    "val_loss": "loss/val",
    "val_ppl": "val/ppl",
    "attn_sink_mass": "val/attn/layer_{i}/sink_mass",
    "attn_entropy": "val/attn/layer_{i}/entropy",
    "attn_local_mass": "val/attn/layer_{i}/local_mass",
}

# written every log.prior_interval steps (GOAT runs)
PRIOR_TAGS = {"prior_s": "perf/prior_s"}


def scalars(metrics: dict, table: dict[str, str]) -> list[tuple[str, float]]:
    """(tag, value) pairs for the numeric values of ``metrics`` that ``table`` names; lists expand."""
    out = []
    for key, tag in table.items():
        value = metrics.get(key)
        if isinstance(value, (list, tuple)):
            out += [(tag.format(i=i), float(v)) for i, v in enumerate(value) if _number(v)]
        elif _number(value):
            out.append((tag, float(value)))
    return out


def _number(value) -> bool:
    """Numbers, NaN included (a NaN loss is news); not booleans."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
