"""Batch-size ramp-up (``train.batch_rampup = [start, increment, ramp_tokens]``), as Megatron's
``--rampup-batch-size``: the global batch starts at ``start`` sequences and grows by ``increment`` in
equal slices of the first ``ramp_tokens`` tokens until it reaches ``train.global_batch_size``.

The size of a step's batch is a function of the samples consumed before it, never of the step number,
the layout or the data-parallel size: a resume, or a resume on another layout, takes the same samples
in the same batches. Plain numbers in and out, so the config (which turns ``train.max_tokens`` into
steps) and the trainer share one definition.
"""

from __future__ import annotations

__all__ = ["batch_at", "ramp_sizes", "sizes_to_come", "steps_for_tokens"]


def _levels(start: int, increment: int, final: int) -> int:
    return (final - start) // increment


def batch_at(consumed_samples: int, final: int, rampup, seq_len: int) -> int:
    """The global batch (sequences) of the step that begins after ``consumed_samples``."""
    if not rampup:
        return final
    start, increment, ramp_tokens = rampup
    levels = _levels(start, increment, final)
    per_level = ramp_tokens / seq_len / levels  # samples spent at each size below the final one
    level = int(consumed_samples // per_level)
    return min(final, start + level * increment)


def ramp_sizes(final: int, rampup) -> list[int]:
    """Every global batch size a run takes, the final one included."""
    if not rampup:
        return [final]
    start, increment, _ = rampup
    return list(range(start, final, increment)) + [final]


def sizes_to_come(consumed_samples: int, final: int, rampup, seq_len: int) -> list[int]:
    """The global batch sizes of the steps after ``consumed_samples`` (a resume's), the final one included:
    those the layout must still divide."""
    now = batch_at(consumed_samples, final, rampup, seq_len)
    return [size for size in ramp_sizes(final, rampup) if size >= now]


def steps_for_tokens(tokens: int, final: int, rampup, seq_len: int) -> int:
    """The optimizer steps it takes to consume at least ``tokens`` tokens (whole steps)."""
    samples, steps = 0, 0
    goal = -(-tokens // seq_len)
    while samples < goal:
        size = batch_at(samples, final, rampup, seq_len)
        if size == final:
            return steps + -(-(goal - samples) // final)
        start, increment, ramp_tokens = rampup
        per_level = ramp_tokens / seq_len / _levels(start, increment, final)
        level_end = min(goal, int((samples // per_level + 1) * per_level))  # first sample of the next size
        level_end = max(level_end, samples + 1)
        n = -(-(level_end - samples) // size)
        samples += n * size
        steps += n
    return steps
