"""Everything that describes where a run is: one object, saved with checkpoints, read by callbacks."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RunState:
    step: int = 0  # optimizer steps completed
    consumed_samples: int = 0  # sequences consumed, all data-parallel ranks together
    consumed_tokens: int = 0
    data_skipped: int = 0  # samples with unreadable data (data.on_error=skip), all ranks
    elapsed_s: float = 0.0  # training wall time so far (this and earlier attempts)
    stop_requested: str | None = None  # set by a signal or a callback; honoured at the step boundary
    metrics: dict[str, float] = field(default_factory=dict)  # the last logged step's metrics

    def state_dict(self) -> dict:
        d = asdict(self)
        d.pop("metrics")
        d.pop("stop_requested")
        return d

    def load_state_dict(self, d: dict) -> None:
        for key, value in d.items():
            setattr(self, key, value)
