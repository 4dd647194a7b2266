"""The training loop. Everything else (logging, parallelism, data) is set up around it."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from megatron.core import parallel_state

from .. import distributed
from ..checkpoint import CheckpointManager, tag_for
from ..config import Config, save_config
from ..distributed import LayoutError
from ..model import GPT
from .batches import data_sources, train_loader, val_loader
from .callbacks import Callback, ConsoleLogger, JsonlLogger, TensorBoardLogger
from .memory import training_state_bytes
from .parallelize import parallelize
from .signals import StopSignals
from .state import RunState


def seed_everything(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def batch_fingerprint(tokens: torch.Tensor) -> torch.Tensor:
    """An integer digest of the set of sequences in a batch (order inside each sequence counts, the
    placement on ranks and micro-batches does not): summed over a global batch, equal digests per step
    mean the same data. metrics.jsonl ``data_fingerprint`` is how exact resume of the data is checked."""
    t = tokens.cpu().long()
    per_sample = (t * torch.arange(1, t.shape[1] + 1)).sum(dim=1)
    return ((per_sample * 2654435761) % 2_147_483_647).sum().view(1)


def gradient_accumulation(cfg: Config, dp: int) -> int:
    t = cfg.train
    per_step = t.micro_batch_size * dp
    if t.global_batch_size % per_step:
        raise LayoutError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by "
            f"train.micro_batch_size={t.micro_batch_size} x data-parallel size {dp}"
        )
    return t.global_batch_size // per_step


def autocast_context(cfg: Config, device: torch.device):
    precision = cfg.train.precision
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    if precision == "bf16":
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


class Trainer:
    def __init__(self, cfg: Config, callbacks: list[Callback] | None = None):
        self.cfg = cfg
        self.layout = distributed.init(tp=cfg.parallel.tp)
        m = cfg.model
        distributed.check_layout(
            self.layout.world,
            cfg.parallel.tp,
            m.num_heads,
            m.num_kv_heads or m.num_heads,
            m.seq_len,
            cfg.parallel.sp,
        )
        self.grad_accum = gradient_accumulation(cfg, self.layout.dp)
        self.run_dir = cfg.run_dir
        self.state = RunState()
        seed_everything(cfg.train.seed)  # same seed on every rank: identical initial weights
        self.model = GPT(
            m,
            sequence_parallel=cfg.parallel.sp,
            activation_checkpointing=cfg.train.activation_checkpointing,
        )
        self.engine = parallelize(self.model, cfg, self.grad_accum)
        self.autocast = autocast_context(cfg, self.layout.device)
        log = print if self.layout.is_main else (lambda *a, **k: None)
        self.sources = data_sources(cfg, self.layout, log=log)
        self.val_batches = val_loader(cfg, self.layout, self.sources) if cfg.train.eval_interval else None
        self.callbacks = callbacks if callbacks is not None else self._default_callbacks()
        self.checkpoints = CheckpointManager(
            self.run_dir, cfg.checkpoint.keep_last, self.layout.is_main, universal=cfg.checkpoint.universal
        )
        self.resumed_from = self._resume()
        self.signals = StopSignals()
        self._skipped = 0  # samples with unreadable data in the current step (data.on_error=skip)

    def _resume(self) -> Path | None:
        """Continue from a checkpoint per ``train.resume``: auto (the run dir's latest), never, or a path."""
        choice = self.cfg.train.resume
        if choice == "never":
            return None
        path = self.checkpoints.latest() if choice == "auto" else Path(choice)
        if path is None:
            return None
        saved = self.checkpoints.load(self.engine, path, self.layout_record())
        self.state.load_state_dict(saved["run_state"])
        if self.layout.is_main:
            print(f"resumed from {path} (step {self.state.step}, {self.state.consumed_tokens:,} tokens)")
        return path

    def layout_record(self) -> dict:
        lay = self.layout
        return {"world": lay.world, "tp": lay.tp, "dp": lay.dp, "zero_stage": self.cfg.parallel.zero_stage}

    def save_checkpoint(self) -> Path:
        trainer_state = {
            "step": self.state.step,
            "run_state": self.state.state_dict(),
            **self.layout_record(),
        }
        path = self.checkpoints.save(
            self.engine,
            trainer_state,
            yaml.safe_dump(self.cfg.to_dict(), sort_keys=False),
            fault_hook=_fault_hook,
        )
        self._last_save_time = time.monotonic()
        self._emit("on_checkpoint", {"path": str(path), "save_s": trainer_state["last_save_s"]})
        return path

    def _checkpoint_due(self) -> bool:
        c, step = self.cfg.checkpoint, self.state.step
        if c.interval and step % c.interval == 0:
            return True
        if not c.interval_minutes:
            return False
        # Wall clocks differ between ranks: every rank joins the broadcast, rank 0's clock decides.
        due = torch.tensor([int((time.monotonic() - self._last_save_time) / 60 >= c.interval_minutes)])
        dist.broadcast(due, src=0)
        return bool(due.item())

    def _default_callbacks(self) -> list[Callback]:
        if not self.layout.is_main:
            return []
        self.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(self.cfg, self.run_dir / "config.yaml")
        cbs: list[Callback] = [
            ConsoleLogger(self.cfg.train.max_steps),
            JsonlLogger(self.run_dir / "metrics.jsonl"),
        ]
        if self.cfg.log.tensorboard:
            cbs.append(TensorBoardLogger(self.run_dir / "tensorboard"))
        return cbs

    def _emit(self, event: str, *args) -> None:
        for cb in self.callbacks:
            getattr(cb, event)(self.state, *args)

    def start_info(self) -> dict:
        lay, cfg = self.layout, self.cfg
        local = sum(p.numel() for p in self.model.parameters())
        counts = [torch.zeros(1, dtype=torch.long) for _ in range(lay.world)]
        dist.all_gather(counts, torch.tensor([local]))
        record = {
            "world": lay.world,
            "tp": lay.tp,
            "sp": cfg.parallel.sp,
            "dp": lay.dp,
            "zero_stage": cfg.parallel.zero_stage,
            "micro_batch": cfg.train.micro_batch_size,
            "global_batch": cfg.train.global_batch_size,
            "grad_accum": self.grad_accum,
            "params_per_rank": [int(c) for c in counts],
            "device": str(lay.device),
            "position": cfg.model.position,
            "attention_backend": self.model.blocks[0].attn.backend,
        }
        lines = [
            f"goat-dist run dir: {self.run_dir}",
            f"layout: world {lay.world} = TP {lay.tp} x DP {lay.dp} | SP {cfg.parallel.sp} | "
            f"ZeRO {cfg.parallel.zero_stage} | micro {cfg.train.micro_batch_size} x accum {self.grad_accum} "
            f"x DP {lay.dp} = global {cfg.train.global_batch_size} seqs of {cfg.model.seq_len}",
            f"model: {cfg.model.position} attention ({record['attention_backend']}), "
            f"params per rank {record['params_per_rank']}",
        ]
        return {"record": record, "lines": lines}

    def _batch(self, it) -> tuple[torch.Tensor, ...]:
        b = next(it)
        self._skipped += int(b.get("skipped", 0))
        dev = self.layout.device
        return b["tokens"].to(dev), b["position_ids"].to(dev), b["labels"].to(dev)

    def train_step(self, it) -> float:
        """One optimizer step (``grad_accum`` micro-batches); returns the DP-mean loss."""
        total = torch.zeros((), device=self.layout.device)
        fingerprint = torch.zeros(1, dtype=torch.long)
        self._skipped = 0
        for micro in range(self.grad_accum):
            tokens, positions, labels = self._batch(it)
            fingerprint += batch_fingerprint(tokens)
            with self.autocast():
                loss = self.engine(tokens, positions, labels)
            self.engine.backward(loss)
            if self.state.step == self._first_step + 1 and micro == self.grad_accum - 1:
                # Gradients and optimizer state coexist here (the peak): measure once, in the second step
                # (the first creates the optimizer state).
                self._emit("on_memory", self.measure_memory())
            self.engine.step()
            total += loss.detach().float()
        total /= self.grad_accum
        dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
        counts = torch.cat([fingerprint, torch.tensor([self._skipped])])
        dist.all_reduce(counts, group=parallel_state.get_data_parallel_group())
        self.state.metrics["data_fingerprint"] = int(counts[0])
        self.state.data_skipped += int(counts[1])
        return total.item() / self.layout.dp

    def measure_memory(self) -> dict:
        """Per-rank bytes of parameters, gradients and optimizer state, gathered on every rank."""
        local = training_state_bytes(self.engine.module, self.engine.optimizer)
        keys = sorted(local)
        gathered = [torch.zeros(len(keys), dtype=torch.long) for _ in range(self.layout.world)]
        dist.all_gather(gathered, torch.tensor([local[k] for k in keys]))
        return {k: [int(g[i]) for g in gathered] for i, k in enumerate(keys)}

    @torch.no_grad()
    def evaluate(self) -> float:
        self.engine.eval()
        it = iter(self.val_batches)
        total = torch.zeros((), device=self.layout.device)
        n = self.cfg.train.eval_batches
        for _ in range(n):
            tokens, positions, labels = self._batch(it)
            with self.autocast():
                total += self.engine(tokens, positions, labels).float()
        dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
        self.engine.train()
        return total.item() / (n * self.layout.dp)

    def fit(self) -> RunState:
        cfg, state = self.cfg, self.state
        self._emit("on_train_start", self.start_info())
        it = iter(train_loader(cfg, self.layout, self.sources, start_sample=state.consumed_samples))
        tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_len
        window_start, window_steps = time.perf_counter(), 0
        self._last_save_time = time.monotonic()
        self._first_step = state.step
        self.signals.install()
        try:
            self._loop(it, tokens_per_step, window_start, window_steps)
        finally:
            self.signals.uninstall()
        saved_last = self.checkpoints.latest()
        if cfg.checkpoint.save_at_end and (saved_last is None or saved_last.name != tag_for(state.step)):
            if state.stop_requested is None and state.step > self._first_step:
                self.save_checkpoint()
        self._emit("on_train_end")
        return state

    def _loop(self, it, tokens_per_step, window_start, window_steps) -> None:
        cfg, state = self.cfg, self.state
        while state.step < cfg.train.max_steps:
            t0 = time.perf_counter()
            lr = self.engine.get_lr()[0]  # the rate this step uses
            loss = self.train_step(it)
            state.step += 1
            state.consumed_samples += cfg.train.global_batch_size
            state.consumed_tokens += tokens_per_step
            state.elapsed_s += time.perf_counter() - t0
            window_steps += 1
            last = state.step == cfg.train.max_steps
            if state.step % cfg.log.interval == 0 or last or state.step == 1:
                seconds = time.perf_counter() - window_start
                state.metrics = {
                    "data_fingerprint": state.metrics["data_fingerprint"],
                    "data_skipped": state.data_skipped,
                    "loss": loss,
                    "lr": lr,
                    "grad_norm": float(self.engine.get_global_grad_norm() or 0.0),
                    "tokens_per_s": tokens_per_step * window_steps / seconds,
                }
                self._emit("on_log", state.metrics)
                window_start, window_steps = time.perf_counter(), 0
            if cfg.train.eval_interval and (state.step % cfg.train.eval_interval == 0 or last):
                self._emit("on_eval", {"val_loss": self.evaluate()})
                window_start = time.perf_counter()
            reason = self.signals.agreed()
            if reason or self._checkpoint_due():
                self.save_checkpoint()
                window_start = time.perf_counter()
            if reason:
                state.stop_requested = reason
                return


def _fault_hook(point: str, step_dir: Path) -> None:
    """Test hook: ``GOAT_FAULT=before_publish:<step>`` kills the process after the shards of that step are
    written and before the checkpoint is published (a crash mid-save)."""
    spec = os.environ.get("GOAT_FAULT", "")
    if spec == f"{point}:{int(step_dir.name.split('_')[1])}":
        os.kill(os.getpid(), signal.SIGKILL)


def run(cfg: Config) -> RunState:
    """Entry point of ``goat-dist train``: train, then tear the process groups down cleanly."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    try:
        state = Trainer(cfg).fit()
    except BaseException:
        distributed.teardown(barrier=False)
        raise
    distributed.teardown()
    return state
