"""Steps with nothing to learn from: a global batch in which no label carries loss.

Why: under ``data.on_error=skip`` what cannot be read of a corrupt shard reaches the model as fill tokens
labelled IGNORE_INDEX. A step whose whole global batch (every data-parallel rank, every micro-batch) is
such data has loss 0 and gradient 0, yet an optimizer step would still apply weight decay and advance the
LR schedule: training on nothing. Its update is dropped like a non-finite one
(``engine.steps.update_dropped``: no optimizer and no LR-schedule step), counted
(``RunState.unreadable_skipped``, logged as ``unreadable_skipped``), and a run of more than
``train.max_nonfinite_in_row`` such steps stops with an error naming the step and its data.

Each rank counts its labels that carry loss on the host, from the loader's batch, comparing them only in
a micro-batch that holds unreadable samples (``skipped`` > 0); the count travels in the step's one
collective (``control.agree``): no extra device sync and no extra collective.
"""

from __future__ import annotations

from ..data.loader import IGNORE_INDEX
from .nonfinite import NonFiniteError, describe_sample


class UnreadableDataError(NonFiniteError):
    """Too many steps in a row had no readable label. A ``NonFiniteError``: both mean a run whose updates
    keep being dropped, and both are the user's to fix (exit 2)."""


def valid_labels(batch: dict) -> int:
    """Labels of one loader micro-batch that carry loss; only a batch with unreadable samples is compared
    (elsewhere every label counts: an ordinary batch is never mistaken for an empty one)."""
    labels = batch["labels"]
    if not int(batch.get("skipped", 0)):
        return labels.numel()
    return int((labels != IGNORE_INDEX).sum())


def describe_step(dataset, first_micro: int, global_batch: int) -> str:
    """The step's global samples and where the first one comes from: the same text on every rank."""
    try:
        first = dataset.global_samples(first_micro)[0] - dataset.dp_rank
        where = describe_sample(dataset, first)
    except (AttributeError, IndexError, ValueError):  # a generated source has no shards to name
        return f"micro-batch {first_micro} of {type(dataset).__name__}"
    return f"global samples {first}-{first + global_batch - 1}, the first {where}"


def count_step(state, control, train_cfg, dataset, first_micro: int, is_main: bool) -> None:
    """Called for every finite step: a step with readable labels ends a run of unreadable ones; an
    unreadable step is counted and warned about (main rank), and more than ``train.max_nonfinite_in_row``
    in a row raise. Every rank decides alike: ``control`` and ``state`` are the same on all of them."""
    if not control.unreadable:
        state.unreadable_in_row = 0
        return
    step, limit = state.step + 1, train_cfg.max_nonfinite_in_row
    state.unreadable_in_row += 1
    where = describe_step(dataset, first_micro, train_cfg.global_batch_size)
    if state.unreadable_in_row > limit:
        raise UnreadableDataError(
            f"step {step}: no readable label in the global batch ({where}); {state.unreadable_in_row} such "
            f"steps in a row (limit train.max_nonfinite_in_row={limit}): the data is unreadable "
            "(data.on_error=skip masks what it cannot read of a corrupt shard; the goat_dist.data warning "
            "names the shard); check the data set with `goat-dist data inspect`"
        )
    state.unreadable_skipped += 1
    if is_main:
        print(
            f"step {step}: warning: unreadable data, no label of the global batch carries loss "
            f"({control.skipped} samples with unreadable data, data.on_error=skip; {where}); update dropped, "
            f"no optimizer or LR-schedule step ({state.unreadable_in_row} in a row, "
            f"{state.unreadable_skipped} in this run)",
            flush=True,
        )
