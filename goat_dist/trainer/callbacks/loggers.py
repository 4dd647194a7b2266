"""The loggers: progress lines, metrics.jsonl and TensorBoard (output events only, main rank only).

metrics.jsonl and TensorBoard write the same values at the same steps; ``observe.tags`` maps one's keys
to the other's tags.
"""

from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ...observe import tags
from ...observe.step_metrics import mfu_text
from .base import Callback

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

LOGGER_ORDER = 50  # after the trainer's jobs, whose output they write


def _fmt_time(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class ConsoleLogger(Callback):
    """One line per log step: step, loss, lr, grad norm, throughput, elapsed / remaining time. The last
    line says how the run ended; after a stop, which checkpoint holds it and how to continue."""

    order = LOGGER_ORDER

    def __init__(self, max_steps: int, stream=sys.stdout):
        self.max_steps, self.stream = max_steps, stream
        self.checkpoint: tuple[int, str] | None = None  # (step, path) of the last one written
        self.mfu_unknown = False  # said once; no MFU on the lines after

    def _print(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def on_train_start(self, state, info):
        for line in info.get("lines", []):
            self._print(line)

    def on_log(self, state, metrics):
        done = max(state.step, 1)
        eta = state.elapsed_s / done * (self.max_steps - state.step)
        if metrics.get("mfu_unreliable") and not self.mfu_unknown:
            self.mfu_unknown = True
            self._print(
                "MFU unknown: training ran faster than the measured peak of this CPU (observe/peak.py), so "
                "it is left out from here on; log.peak_tflops sets the peak"
            )
        mfu = "" if self.mfu_unknown else mfu_text(metrics)
        self._print(
            f"step {state.step:>6}/{self.max_steps} | loss {metrics['loss']:.4f} | lr {metrics['lr']:.2e} | "
            f"grad {metrics['grad_norm']:.3f} | {metrics['tokens_per_s'] / 1e3:.1f}k tok/s"
            + mfu
            + f" | {_fmt_time(state.elapsed_s)} elapsed, {_fmt_time(eta)} left"
        )

    def on_checkpoint(self, state, info):
        self.checkpoint = (state.step, info["path"])
        self._print(f"checkpoint step {state.step} -> {info['path']} ({info['save_s']:.1f} s)")

    def on_memory(self, state, memory):
        """One line whatever the world: min / mean / max over ranks; every rank only on request."""
        t = memory["bytes"]["total"]
        line = (
            f"memory (params + grads + optimizer state), MiB: min {t['min'] / 2**20:.1f}, "
            f"mean {t['mean'] / 2**20:.1f}, max {t['max'] / 2**20:.1f} (rank {t['max_rank']})"
        )
        if "bytes_per_rank" in memory:
            line += "; per rank: " + ", ".join(f"{b / 2**20:.1f}" for b in memory["bytes_per_rank"]["total"])
        self._print(line)

    def on_eval(self, state, metrics):
        line = f"eval  {state.step:>6}/{self.max_steps} | val_loss {metrics['val_loss']:.4f}"
        if "val_ppl" in metrics:
            line += f" | val_ppl {metrics['val_ppl']:.2f}"
        if metrics.get("attn_sink_mass"):
            sink = ", ".join(f"{v:.2f}" for v in metrics["attn_sink_mass"])
            line += f" | attention on token 0 per layer: {sink}"
        self._print(line)

    def on_train_end(self, state):
        if state.stop_requested:
            self._print(self.stop_line(state))
            return
        self._print(
            f"done: {state.step} steps, {state.consumed_tokens:,} tokens, {_fmt_time(state.elapsed_s)}"
        )

    def stop_line(self, state) -> str:
        """``stopped at step N (reason): checkpoint PATH; run the same command to continue``: a stop
        always saves its step, and ``train.resume=auto`` (the default) or a pin this run began at continues
        from the latest (``checkpoint/lineage.py``); only ``train.resume=never`` needs changing."""
        if self.checkpoint is None:
            saved = "no checkpoint written"
        elif self.checkpoint[0] == state.step:
            saved = f"checkpoint {self.checkpoint[1]}"
        else:
            saved = f"latest checkpoint {self.checkpoint[1]} (step {self.checkpoint[0]})"
        cfg = getattr(self.trainer, "cfg", None)
        resume = "auto" if cfg is None else str(cfg.train.resume)
        how = "run the same command with train.resume=auto" if resume == "never" else "run the same command"
        return f"stopped at step {state.step} ({state.stop_requested}): {saved}; {how} to continue"


class JsonlLogger(Callback):
    """Appends one JSON object per logged step (and per eval) to ``metrics.jsonl``."""

    order = LOGGER_ORDER

    def __init__(self, path: Path):
        self.path = Path(path)

    def _write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def on_train_start(self, state, info):
        self._write({"event": "start", "time": time.time(), "step": state.step, **info.get("record", {})})

    def on_log(self, state, metrics):
        self._write({"step": state.step, **metrics, "consumed_tokens": state.consumed_tokens})

    def on_eval(self, state, metrics):
        self._write({"step": state.step, **metrics})

    def on_checkpoint(self, state, info):
        self._write({"event": "checkpoint", "step": state.step, **info})

    def on_memory(self, state, memory):
        self._write({"event": "memory", "step": state.step, **memory})

    def on_prior(self, state, pictures):
        self._write(
            {
                "event": "prior",
                "step": state.step,
                "seconds": pictures["seconds"],
                "images": sorted(pictures["images"]),
            }
        )


class TensorBoardLogger(Callback):
    """``<run_dir>/tensorboard/``: scalars under the tags of ``observe.tags`` (train/, perf/, mem/, data/,
    val/, attn/), the GOAT prior's pictures (prior/), and the resolved config and code version as text.

    The event file is opened at the start of training with ``purge_step`` at the first step this run
    logs (the run state's step + 1): after a resume from an older checkpoint, TensorBoard hides what an
    earlier attempt wrote from that step on, so no step shows twice."""

    order = LOGGER_ORDER

    def __init__(self, log_dir: Path, config_text: str = "", code_version: str = ""):
        self.log_dir = Path(log_dir)
        self._writer: SummaryWriter | None = None
        self.config_text, self.code_version = config_text, code_version

    @property
    def writer(self) -> SummaryWriter:
        """The SummaryWriter (opened without a purge if an event comes before ``on_train_start``)."""
        return self._writer if self._writer is not None else self._open(None)

    def _open(self, purge_step: int | None) -> SummaryWriter:
        from torch.utils.tensorboard import SummaryWriter

        if self._writer is not None:
            self._writer.close()
        self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge_step)
        return self._writer

    def _scalars(self, metrics: dict, table: dict, step: int) -> None:
        for tag, value in tags.scalars(metrics, table):
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def on_train_start(self, state, info):
        # the resumed step itself stays: the checkpoint holds what was logged up to it
        self._open(purge_step=state.step + 1)
        if self.config_text:  # indented: TensorBoard renders text as markdown, this keeps YAML verbatim
            self.writer.add_text("run/config", textwrap.indent(self.config_text, "    "), state.step)
        if self.code_version:
            self.writer.add_text("run/code_version", self.code_version, state.step)
        self.writer.flush()

    def on_log(self, state, metrics):
        self._scalars(metrics, tags.TRAIN_TAGS, state.step)

    def on_eval(self, state, metrics):
        self._scalars(metrics, tags.EVAL_TAGS, state.step)

    def on_prior(self, state, pictures):
        for tag, image in pictures["images"].items():
            self.writer.add_image(tag, image, state.step, dataformats="HWC")
        self._scalars({"prior_s": pictures["seconds"]}, tags.PRIOR_TAGS, state.step)

    def on_train_end(self, state):
        if self._writer is not None:
            self._writer.close()
