"""The one blocking collective of a training step.

Everything the ranks must agree on after the last backward of a step travels in one small float64
vector, summed over the whole world: the loss, the data fingerprint, the skip count and the count of
labels that carry loss, whether any loss or gradient was non-finite, whether a stop signal arrived, and
the callbacks' requests for a save or a stop (``Trainer.request_save`` / ``request_stop``: the
checkpoint policy's clock decisions, a time-interval checkpoint and the deadline, are such requests, made
on rank 0 only so that every rank acts on one clock). One all-reduce per step, on the device (NCCL on
CUDA), and one host sync: reading its result. Values that are only logged are reduced at log intervals
instead.

Why a sum over the world: flags become "any rank" (sum > 0); values that every tensor-parallel peer holds
identically (loss, fingerprint, skip count, valid labels) are summed over all ranks and divided by the TP
size, exactly. A request made on any rank is thus seen by every rank at the same step boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import collectives

# Fingerprints are reduced modulo this prime before they travel (float64 holds the sum exactly); the
# modulus of a sum is the sum of the moduli, so the result does not depend on the layout.
FINGERPRINT_MOD = 2_147_483_647

# the reduced vector: the device values first, then the host values
_VECTOR_ORDER = (
    "loss",
    "nonfinite_loss",
    "nonfinite_grad",
    "fingerprint",
    "skipped",
    "valid_labels",
    "signal",
    "save",
    "stop",
)


@dataclass
class StepControl:
    """What one step's collective decided, identical on every rank."""

    loss: float  # mean loss over the global batch (data-parallel mean of per-rank means)
    fingerprint: int  # digest of the global batch's data (see batch_fingerprint)
    skipped: int  # samples with unreadable data in the global batch
    valid_labels: int  # labels of the global batch that carry loss (not IGNORE_INDEX)
    nonfinite_loss: int  # ranks x micro-batches whose loss was NaN/Inf
    nonfinite_grad: int  # ranks whose local gradients hold a NaN/Inf
    signal: bool  # a stop signal reached some rank
    save: bool  # a callback on some rank asked for a checkpoint at this step boundary
    stop: bool  # a callback on some rank asked to save and stop (the deadline is one such request)
    # why the run stops here (signal first), the same on every rank that saw the cause itself: a signal's
    # name or the request's reason; "... on another rank" where only the flag arrived; None: no stop
    stop_reason: str | None = None

    @property
    def nonfinite(self) -> bool:
        return bool(self.nonfinite_loss or self.nonfinite_grad)

    @property
    def unreadable(self) -> bool:
        """No label of the global batch carries loss (all unreadable data): nothing to learn from."""
        return self.valid_labels == 0

    @property
    def dropped(self) -> bool:
        """The step's update is dropped: non-finite, or nothing to learn from."""
        return self.nonfinite or self.unreadable


def agree(
    loss_sum: torch.Tensor,
    micro_batches: int,
    nonfinite_loss: torch.Tensor,
    nonfinite_grad: torch.Tensor,
    fingerprint: int,
    skipped: int,
    valid_labels: int,
    signal: str | bool | None,
    save: bool,
    stop: str | bool | None,
    tp: int,
    dp: int,
    cp: int = 1,
) -> StepControl:
    """Collective over the whole world; every rank calls it once per step, after the last backward.

    ``loss_sum``, ``nonfinite_loss`` and ``nonfinite_grad`` may live on the device: the vector is built
    there (the host values join it with one asynchronous copy) and reduced there (NCCL on CUDA, gloo on
    CPU), so the step's one host sync is reading the reduced vector. Context parallel: the CP ranks of a
    replica hold the same batch (fingerprint, skip count, valid labels) and losses whose CP mean is the
    rows' mean, like TP peers.

    ``signal``: the stop signal this rank received (its name), if any; ``save``: a save requested on
    this rank; ``stop``: the reason of a stop requested on this rank, if any.
    """
    peers = tp * cp  # ranks of one replica that hold the same batch
    device_part = torch.stack(
        [loss_sum.detach().double(), nonfinite_loss.to(loss_sum.device).double(), nonfinite_grad.double()]
    )
    device_part = device_part.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)  # the flags carry a NaN loss
    host_part = [
        float(fingerprint % FINGERPRINT_MOD),
        float(skipped),
        float(valid_labels),  # host ints: exact in float64 up to 2**53
        float(bool(signal)),
        float(bool(save)),
        float(bool(stop)),
    ]
    host = torch.tensor(host_part, dtype=torch.float64)
    vector = torch.cat([device_part, host.to(device_part.device, non_blocking=True)])
    collectives.all_reduce(vector)
    values = dict(zip(_VECTOR_ORDER, vector.tolist()))
    return StepControl(
        loss=values["loss"] / (peers * dp * micro_batches),
        fingerprint=int(round(values["fingerprint"])) // peers % FINGERPRINT_MOD,
        skipped=int(round(values["skipped"])) // peers,
        valid_labels=int(round(values["valid_labels"])) // peers,
        nonfinite_loss=int(round(values["nonfinite_loss"])),
        nonfinite_grad=int(round(values["nonfinite_grad"])),
        signal=values["signal"] > 0,
        save=values["save"] > 0,
        stop=values["stop"] > 0,
        stop_reason=_stop_reason(values, signal, stop),
    )


def quiet_vector() -> list[float]:
    """The reduced vector of a step with nothing to report: finite, readable, no signal or request. What a
    rehearsal on the meta device (``goat_dist.rehearsal``) answers for the step's host read, which has no
    data there."""
    values = dict.fromkeys(_VECTOR_ORDER, 0.0)
    values["valid_labels"] = float(2**40)  # readable labels, whatever the peers it is divided by
    return [values[k] for k in _VECTOR_ORDER]


def is_control_vector(t: torch.Tensor) -> bool:
    """Whether ``t`` has the shape and dtype of the step's reduced vector."""
    return t.dtype == torch.float64 and tuple(t.shape) == (len(_VECTOR_ORDER),)


def _stop_reason(values: dict, signal, stop) -> str | None:
    """This rank's own cause (a signal's name, a request's reason), else that another rank had one."""
    for key, mine, what in (("signal", signal, "signal"), ("stop", stop, "stop requested")):
        if values[key] > 0:
            return (mine if isinstance(mine, str) else what) if mine else f"{what} on another rank"
    return None


def batch_fingerprint(tokens: torch.Tensor) -> torch.Tensor:
    """An integer digest of the set of sequences in a batch (order inside each sequence counts, the
    placement on ranks and micro-batches does not): summed over a global batch, equal digests per step
    mean the same data. metrics.jsonl ``data_fingerprint`` is how exact resume of the data is checked."""
    t = tokens.long()
    per_sample = (t * torch.arange(1, t.shape[1] + 1)).sum(dim=1)
    return int(((per_sample * 2654435761) % 2_147_483_647).sum())
