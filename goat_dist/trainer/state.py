"""Everything that describes where a run is: one object, saved with checkpoints, read by callbacks."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RunState:
    step: int = 0  # optimizer steps completed
    consumed_samples: int = 0  # sequences consumed, all data-parallel ranks together
    consumed_tokens: int = 0
    data_skipped: int = 0  # samples with unreadable data (data.on_error=skip), all ranks
    nonfinite_skipped: int = 0  # steps whose update was dropped for a NaN/Inf (train.on_nonfinite=skip)
    unreadable_skipped: int = 0  # steps whose update was dropped: no readable label in the global batch
    unreadable_in_row: int = 0  # the current run of such steps (saved: the limit counts across a resume)
    stream_start: int = 0  # consumed_samples when the current data stream began (train.data_resume=restart)
    elapsed_s: float = 0.0  # training wall time so far (this and earlier attempts)
    stop_requested: str | None = None  # a stop signal or the deadline; honoured at the step boundary
    metrics: dict[str, float] = field(default_factory=dict)  # the last logged step's metrics

    def state_dict(self) -> dict:
        d = asdict(self)
        d.pop("metrics")
        d.pop("stop_requested")
        return d

    def load_state_dict(self, d: dict) -> None:
        for key, value in d.items():
            setattr(self, key, value)


@dataclass
class LoopState:
    """What one training loop of this process tracks besides the run state (never saved): made once by
    the trainer, (re)started by ``Trainer.start_loop``; callbacks read what they need of it through their
    API (``callbacks.api.TrainerAPI``: ``first_step``, ``last_step_s``, ``data``)."""

    loader: object = None  # this rank's training DataLoader (its dataset maps micro-batches to samples)
    first_step: int = 0  # the run state's step when this loop started
    micro_seen: int = 0  # micro-batches this loop has drawn from the loader
    last_step_s: float = 0.0  # wall time of the last optimizer step
    nonfinite_in_row: int = 0  # dropped non-finite updates in a row
    save_requested: bool = False  # a callback of this rank asked for a save (travels in the next collective)
    stop_requested: str | None = None  # ... or for a stop, and why

    def start(self, loader, step: int) -> None:
        self.loader, self.first_step, self.micro_seen = loader, step, 0
        self.last_step_s, self.nonfinite_in_row = 0.0, 0
        self.save_requested, self.stop_requested = False, None
