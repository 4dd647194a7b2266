"""The training loop. Everything else (logging, parallelism, data) is set up around it."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from megatron.core import parallel_state

from .. import distributed
from ..checkpoint import CheckpointManager, extension
from ..config import Config, save_config
from ..model import GPT
from . import data_contract, nonfinite, unreadable
from .batches import data_sources, train_loader, val_loader
from .callbacks import Callback, ConsoleLogger, JsonlLogger, TensorBoardLogger
from .control import StepControl, agree, batch_fingerprint
from .deadline import Deadline
from .faults import fault_due, fault_hook, kill_after
from .memory import training_state_bytes
from .parallelize import parallelize
from .precision import autocast_context, resolve_precision
from .signals import HANG_FRACTION, StopSignals
from .state import RunState


def seed_everything(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def gradient_accumulation(cfg: Config, dp: int) -> int:
    t = cfg.train
    distributed.check_batch(t.global_batch_size, t.micro_batch_size, dp)
    return t.global_batch_size // (t.micro_batch_size * dp)


class Trainer:
    def __init__(self, cfg: Config, callbacks: list[Callback] | None = None):
        self.cfg = cfg
        p = cfg.parallel
        self.layout = distributed.init(p.tp, p.cp, timeout_minutes=p.timeout_minutes, run_dir=cfg.run_dir)
        cfg.train.precision = resolve_precision(cfg.train.precision, self.layout.device)
        m = cfg.model
        distributed.check_layout(
            self.layout.world,
            cfg.parallel.tp,
            m.num_heads,
            m.num_kv_heads or m.num_heads,
            m.seq_len,
            cfg.parallel.sp,
            cp=cfg.parallel.cp,
        )
        self.grad_accum = gradient_accumulation(cfg, self.layout.dp)
        self.run_dir = cfg.run_dir
        self.state = RunState()
        log = print if self.layout.is_main else (lambda *a, **k: None)
        self.checkpoints = CheckpointManager(self.run_dir, cfg.checkpoint.keep_last, self.layout.is_main)
        # where the run starts decides GOAT's L_train before the model exists: its own checkpoint
        # (train.resume), else train.init_from (a new run from another run's weights), else nothing
        self._start = self.checkpoints.choose_resume(cfg.train.resume)
        self.init_source = None
        if self._start is None and cfg.train.init_from:
            self.init_source = extension.agree_on_source(cfg.train.init_from)
        extension.resolve_train_len(cfg, self._start or self.init_source, log)
        seed_everything(cfg.train.seed)  # same seed on every rank: identical initial weights
        self.model = GPT(
            m,
            sequence_parallel=cfg.parallel.sp,
            activation_checkpointing=cfg.train.activation_checkpointing,
        )
        self.engine = parallelize(self.model, cfg, self.grad_accum)
        self.autocast = autocast_context(cfg, self.layout.device)
        self.sources = data_sources(cfg, self.layout, log=log)
        self.val_batches = val_loader(cfg, self.layout, self.sources) if cfg.train.eval_interval else None
        self.callbacks = callbacks if callbacks is not None else self._default_callbacks()
        self.contract = data_contract.data_contract(cfg, self.sources)
        self.resumed_from = self._resume()
        self.signals = StopSignals(hang_after_s=HANG_FRACTION * 60 * cfg.parallel.timeout_minutes)
        self.deadline = Deadline.from_config(cfg)  # Slurm's job end, train.stop_at or time_limit_minutes
        self._nonfinite_in_row = 0

    def _resume(self) -> Path | None:
        """Continue from a checkpoint per ``train.resume``: auto (the run dir's latest), never, or a path.

        Rank 0 decides and every rank checks it sees that checkpoint (``CheckpointManager.choose_resume``);
        checkpoints newer than the starting point leave this run's lineage (``CheckpointManager.begin``).
        Without one, ``train.init_from`` gives a new run (step 0) another run's weights."""
        path = self._start
        if path is None:
            self.checkpoints.begin(None, 0)
            if self.init_source is not None:
                info = extension.init_weights(
                    self.engine,
                    self.engine.module,
                    self.init_source,
                    self.cfg.train.init_optimizer,
                )
                if self.layout.is_main:
                    carried = "weights and Adam state" if info["optimizer"] else "weights (Adam starts empty)"
                    print(
                        f"initialized from {info['path']} (step {info['step']}): {carried}; a new run from "
                        f"step 0, GOAT train_len {self.cfg.model.goat.train_len}"
                    )
            return None
        saved = self.checkpoints.load(self.engine, path, self.layout_record())
        self.checkpoints.begin(path, saved["step"])
        self.state.load_state_dict(saved["run_state"])
        kept = data_contract.keep_window_order(saved.get("data_contract"), self.cfg, self.contract)
        if kept and self.layout.is_main:
            print("data.window_order=numpy: the order this run's data stream began with (kept by the resume)")
        restart = data_contract.check(
            saved.get("data_contract"), self.contract, self.cfg.train.data_resume, str(path)
        )
        if restart:
            self.state.stream_start = self.state.consumed_samples
        if self.layout.is_main:
            print(f"resumed from {path} (step {self.state.step}, {self.state.consumed_tokens:,} tokens)")
            if restart:
                changed = "; ".join(data_contract.differences(saved["data_contract"], self.contract))
                print(f"data stream restarted at its sample 0 (train.data_resume=restart): {changed}")
        return path

    def layout_record(self) -> dict:
        """What a bitwise resume depends on; on any other layout the checkpoint's state is re-split."""
        lay = self.layout
        return {
            "world": lay.world,
            "tp": lay.tp,
            "dp": lay.dp,
            "cp": lay.cp,  # informative: world, tp and dp fix it
            "zero_stage": self.cfg.parallel.zero_stage,
            "precision": "bf16" if self.cfg.train.precision == "bf16" else "fp32",  # DeepSpeed's mode
            "param_groups": [g.get("name") for g in self.engine.optimizer.param_groups],
        }

    def save_checkpoint(self, final: bool = False) -> Path:
        """Collective. With ``checkpoint.async`` the state is staged in host memory and written in the
        background (published later by ``_finish_pending``); ``final`` (a stop or the end of the run) waits
        until it is published. A pending save is published before the next one starts."""
        self._finish_pending(wait=True)
        bad = nonfinite.first_nonfinite_weight(self.engine.module)
        flag = torch.tensor([0 if bad is None else 1])
        dist.all_reduce(flag)
        if flag.item():
            raise nonfinite.NonFiniteError(
                f"step {self.state.step}: refusing to save a checkpoint from non-finite weights "
                f"({bad or 'on another rank'}); the previous checkpoint stays the latest"
            )
        trainer_state = {
            "step": self.state.step,
            "init_from": None if self.init_source is None else str(self.init_source),
            "run_state": self.state.state_dict(),
            "data_contract": self.contract,
            **self.layout_record(),
        }
        config_text = yaml.safe_dump(self.cfg.to_dict(), sort_keys=False)
        self._saved_step = self.state.step
        if self.cfg.checkpoint.async_save:
            path = self.checkpoints.save_async(self.engine, trainer_state, config_text, fault_hook=fault_hook)
            self._last_save_time = time.monotonic()
            if final:
                self._finish_pending(wait=True)
            return path
        path = self.checkpoints.save(self.engine, trainer_state, config_text, fault_hook=fault_hook)
        self._last_save_time = time.monotonic()
        self._last_save_s = trainer_state["last_save_s"]
        self._emit("on_checkpoint", {"path": str(path), "save_s": trainer_state["last_save_s"]})
        return path

    def _finish_pending(self, wait: bool) -> None:
        """Collective while an asynchronous save is pending (at every step boundary until it is published):
        publish it once every rank's writes are done, or, with ``wait``, wait for them now."""
        pending = self.checkpoints.pending
        if pending is None:
            return
        path = self.checkpoints.wait() if wait else self.checkpoints.poll()
        if path is not None:
            self._last_save_s = self.checkpoints.last_save_s  # the deadline's estimate: staging to publish
            info = {"path": str(path), "save_s": self.checkpoints.last_save_s, "pause_s": pending.paused_s}
            self._emit("on_checkpoint", info)

    def _minutes_due(self) -> bool:
        """This rank's clock says a time-interval checkpoint is due (rank 0's answer is the one used)."""
        minutes = self.cfg.checkpoint.interval_minutes
        return bool(minutes) and (time.monotonic() - self._last_save_time) / 60 >= minutes

    def _deadline_near(self) -> bool:
        return self.deadline is not None and self.deadline.due(self._last_step_s, self._last_save_s)

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
            from ..observe.run_info import code_version

            config_text = yaml.safe_dump(self.cfg.to_dict(), sort_keys=False)
            cbs.append(TensorBoardLogger(self.run_dir / "tensorboard", config_text, code_version()))
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
            "cp": lay.cp,
            "dp": lay.dp,
            "zero_stage": cfg.parallel.zero_stage,
            "micro_batch": cfg.train.micro_batch_size,
            "global_batch": cfg.train.global_batch_size,
            "grad_accum": self.grad_accum,
            "params_per_rank": [int(c) for c in counts],
            "device": str(lay.device),
            "position": cfg.model.position,
            "init_from": None if self.init_source is None else str(self.init_source),
            "attention_backend": self.model.blocks[0].attn.backend,
        }
        from ..observe.flops import flops_per_token
        from ..observe.run_info import code_version
        from ..observe.step_metrics import device_peak

        peak, peak_source = device_peak(cfg, lay.device) if lay.is_main else (None, "")
        record.update(
            code_version=code_version(),
            flops_per_token=flops_per_token(cfg.model)["total"],
            peak_tflops_per_device=peak / 1e12 if peak else None,
            peak_source=peak_source,
        )
        lines = [
            f"goat-dist run dir: {self.run_dir}",
            f"layout: world {lay.world} = TP {lay.tp} x CP {lay.cp} x DP {lay.dp} | SP {cfg.parallel.sp} | "
            f"ZeRO {cfg.parallel.zero_stage} | micro {cfg.train.micro_batch_size} x accum {self.grad_accum} "
            f"x DP {lay.dp} = global {cfg.train.global_batch_size} seqs of {cfg.model.seq_len}",
            f"model: {cfg.model.position} attention ({record['attention_backend']}), "
            f"params per rank {record['params_per_rank']}",
            f"MFU basis: {record['flops_per_token'] / 1e9:.3f} GFLOP per token (observe/flops.py), peak "
            + (f"{peak / 1e12:.2f} TFLOP/s per device" if peak else "unknown")
            + f" ({peak_source})",
        ]
        if self.deadline is not None:
            lines.append(f"{self.deadline.describe()}: saves and exits 75 before it")
        return {"record": record, "lines": lines}

    def _batch(self, it) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        b = next(it)
        move = lambda t: t.to(self.layout.device, non_blocking=True)  # no host sync per micro-batch
        return move(b["tokens"]), move(b["position_ids"]), move(b["labels"]), b

    def train_step(self, it) -> StepControl:
        """One optimizer step (``grad_accum`` micro-batches) and the step's one collective.

        The update is applied, dropped (non-finite under ``train.on_nonfinite=skip``, or no readable label
        in the global batch: ``unreadable``) or refused with an error (``raise``, or too many dropped in a
        row) depending on what every rank saw; the returned control says which, and holds the DP-mean loss."""
        losses, fingerprint, skipped, valid = [], 0, 0, 0
        first_micro = self._micro_seen  # the loader's index of this step's first micro-batch
        for micro in range(self.grad_accum):
            tokens, positions, labels, raw = self._batch(it)
            self._micro_seen += 1
            fingerprint += batch_fingerprint(raw["tokens"])
            skipped += int(raw.get("skipped", 0))
            valid += unreadable.valid_labels(raw)  # host-side, from the loader's batch
            with self.autocast():
                loss = self._forward(tokens, positions, labels, micro)
            self.engine.backward(loss)
            losses.append(loss.detach().float())
            if micro < self.grad_accum - 1:
                self.engine.step()  # not a boundary: DeepSpeed only counts the micro-batch
        losses_t = torch.stack(losses)
        bad_loss = torch.isfinite(losses_t).logical_not()
        control = agree(
            loss_sum=torch.nan_to_num(losses_t, nan=0.0, posinf=0.0, neginf=0.0).sum(),
            micro_batches=self.grad_accum,
            nonfinite_loss=bad_loss.sum(),
            nonfinite_grad=nonfinite.local_grads_nonfinite(self.engine),
            fingerprint=fingerprint,
            skipped=skipped,
            valid_labels=valid,
            signal=self.signals.received is not None,
            save_due=self._minutes_due(),
            deadline=self._deadline_near(),
            tp=self.layout.tp,
            dp=self.layout.dp,
            cp=self.layout.cp,
        )
        if control.nonfinite:
            self._on_nonfinite(control, [first_micro + k for k in bad_loss.nonzero().flatten().tolist()])
        else:
            self._nonfinite_in_row = 0
            dataset, main = self._train_loader.dataset, self.layout.is_main
            unreadable.count_step(self.state, control, self.cfg.train, dataset, first_micro, main)
        if control.dropped:
            with nonfinite.update_dropped(self.engine):
                self.engine.step()
        else:
            if self.state.step == self._first_step + 1:
                # Gradients and optimizer state coexist here (the peak): measure once, in the second step
                # (the first creates the optimizer state).
                self._emit("on_memory", self.measure_memory())
            self.engine.step()
        if fault_due("nonfinite_weights", self.state.step + 1):
            with torch.no_grad():
                next(self.engine.module.parameters()).view(-1)[0] = float("nan")
        return control

    def _forward(self, tokens, positions, labels, micro: int) -> torch.Tensor:
        loss = self.engine(tokens, positions, labels)
        step, rank = self.state.step + 1, self.layout.dp_rank
        if fault_due("nonfinite", step, micro, rank):
            loss = loss * float("nan")  # test hook: a NaN in this micro-batch's forward
        if fault_due("nonfinite_grad", step, micro, rank):  # test hook: finite loss, NaN gradient
            weight = next(self.engine.module.parameters())
            loss = loss + (weight.sum() * 0).sqrt()  # value 0, gradient 0 * inf
        return loss

    def _on_nonfinite(self, control: StepControl, bad_micro: list[int]) -> None:
        """Raise (naming step, data and parameter), or count the dropped update."""
        step = self.state.step + 1
        self._nonfinite_in_row += 1
        mode, limit = self.cfg.train.on_nonfinite, self.cfg.train.max_nonfinite_in_row
        if mode == "raise" or self._nonfinite_in_row > limit:
            dataset = self._train_loader.dataset
            samples = dataset.global_samples(bad_micro[0]) if bad_micro else []
            reason = (
                ""
                if mode == "raise"
                else f"{self._nonfinite_in_row} non-finite steps in a row (limit {limit})"
            )
            nonfinite.raise_nonfinite(self.engine, step, control, samples, dataset, reason)
        self.state.nonfinite_skipped += 1
        if self.layout.is_main:
            print(
                f"step {step}: non-finite {'loss' if control.nonfinite_loss else 'gradient'}, update dropped "
                f"(train.on_nonfinite=skip; {self._nonfinite_in_row} in a row, "
                f"{self.state.nonfinite_skipped} in this run)"
            )

    def measure_memory(self) -> dict:
        """Per-rank bytes of parameters, gradients and optimizer state, gathered on every rank."""
        local = training_state_bytes(self.engine.module, self.engine.optimizer)
        keys = sorted(local)
        gathered = [torch.zeros(len(keys), dtype=torch.long) for _ in range(self.layout.world)]
        dist.all_gather(gathered, torch.tensor([local[k] for k in keys]))
        return {k: [int(g[i]) for g in gathered] for i, k in enumerate(keys)}

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over ``train.eval_batches``; with ``log.attention_stats`` the first batch's
        forward pass also measures attention per layer (``self.attention_stats``, observe.attention_stats)."""
        from ..observe.attention_stats import AttentionProbe

        self.engine.eval()
        it = iter(self.val_batches)
        total = torch.zeros((), device=self.layout.device)
        n = self.cfg.train.eval_batches
        # the probe re-runs attention over whole rows: not under context parallelism
        stats = self.cfg.log.attention_stats and self.layout.cp == 1
        probe = AttentionProbe(self.engine.module) if stats else None
        for i in range(n):
            tokens, positions, labels, _ = self._batch(it)
            with self.autocast(), probe if (probe and i == 0) else contextlib.nullcontext():
                total += self.engine(tokens, positions, labels).float()
        # CP ranks' losses average to their rows' mean (model.gpt): reduce over DP x CP
        dist.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        self.attention_stats = probe.result() if probe else None  # collective over TP
        self.engine.train()
        return total.item() / (n * self.layout.replicas)

    def fit(self) -> RunState:
        cfg, state = self.cfg, self.state
        self._emit("on_train_start", self.start_info())
        it = self.start_loop()
        self.signals.install()
        try:
            self._loop(it)
        finally:
            self.signals.uninstall()
        # the end-of-run save depends on what this run saved, not on what the disk holds
        if cfg.checkpoint.save_at_end and state.stop_requested is None and self._saved_step != state.step:
            if state.step > self._first_step:
                self.save_checkpoint(final=True)
        self._finish_pending(wait=True)  # an asynchronous save still in flight is published before exit
        self._emit("on_train_end")
        return state

    def start_loop(self):
        """The iterator of this rank's training micro-batches, from where the run state says."""
        start = self.state.consumed_samples - self.state.stream_start
        self._train_loader = train_loader(self.cfg, self.layout, self.sources, start_sample=start)
        self._micro_seen = 0
        self._last_save_time = time.monotonic()
        # the deadline budgets for the last save this run dir recorded (an earlier attempt's), else estimates
        self._last_step_s, self._last_save_s = 0.0, self.checkpoints.previous_save_s()
        self._first_step = self.state.step
        self._saved_step = None
        return iter(self._train_loader)

    def _loop(self, it) -> None:
        import math

        from ..observe.prior_snapshot import prior_snapshot
        from ..observe.step_metrics import StepMetrics

        cfg, state = self.cfg, self.state
        tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_len
        # weights are replicated (and ZeRO-3-partitioned) over DP x CP: the norm counts each replica once
        replicas = dataclasses.replace(self.layout, dp=self.layout.replicas, dp_rank=self.layout.replica_rank)
        observed = StepMetrics(cfg, self.engine.module, replicas, self._train_loader.dataset)
        window_start, window_steps = time.perf_counter(), 0
        while state.step < cfg.train.max_steps:
            self.signals.step_started()  # the hang watchdog: stacks of this rank if the step never ends
            t0 = time.perf_counter()
            lr = self.engine.get_lr()[0]  # the rate this step uses
            control = self.train_step(it)
            state.step += 1
            state.consumed_samples += cfg.train.global_batch_size
            state.consumed_tokens += tokens_per_step
            state.data_skipped += control.skipped
            self._last_step_s = time.perf_counter() - t0
            state.elapsed_s += self._last_step_s
            window_steps += 1
            last = state.step == cfg.train.max_steps
            if state.step % cfg.log.interval == 0 or last or state.step == 1 or control.dropped:
                seconds = time.perf_counter() - window_start
                tokens_per_s = tokens_per_step * window_steps / seconds
                state.metrics = {
                    "data_fingerprint": control.fingerprint,
                    "data_skipped": state.data_skipped,
                    "nonfinite_skipped": state.nonfinite_skipped,
                    "unreadable_skipped": state.unreadable_skipped,
                    # NaN: a non-finite loss, or no loss at all (no readable label)
                    "loss": float("nan") if control.nonfinite_loss or control.unreadable else control.loss,
                    "lr": lr,
                    "grad_norm": float(self.engine.get_global_grad_norm() or 0.0),
                    "tokens_per_s": tokens_per_s,
                    # params norm, MFU, memory, epoch: one all-gather, at log steps only
                    **observed.collect(state, seconds / window_steps, tokens_per_s),
                }
                self._emit("on_log", state.metrics)
                window_start, window_steps = time.perf_counter(), 0
            # evaluation, pictures and saves are not training time: the throughput window skips them
            paused = time.perf_counter()
            if cfg.train.eval_interval and (state.step % cfg.train.eval_interval == 0 or last):
                val_loss = self.evaluate()
                ppl = math.exp(min(val_loss, 700))
                extra = getattr(self, "attention_stats", None) or {}
                self._emit("on_eval", {"val_loss": val_loss, "val_ppl": ppl, **extra})
            log = cfg.log
            if log.tensorboard and log.prior_interval and state.step % log.prior_interval == 0:
                t_prior = time.perf_counter()
                snapshot = prior_snapshot(self.engine.module, log.prior_layers, log.prior_heads, state.step)
                if snapshot is not None and self.layout.is_main:
                    from ..observe.figures import prior_images

                    images = prior_images(snapshot)
                    self._emit("on_prior", {"images": images, "seconds": time.perf_counter() - t_prior})
            window_start += time.perf_counter() - paused
            reason = "signal" if control.signal else "deadline" if control.deadline else None
            if reason == "signal":
                reason = self.signals.received or "signal on another rank"
            interval = cfg.checkpoint.interval and state.step % cfg.checkpoint.interval == 0
            paused = time.perf_counter()
            self._finish_pending(wait=False)  # an asynchronous save whose writes are done is published
            if reason or interval or control.save_due:
                self.save_checkpoint(final=bool(reason))  # a stop waits until its checkpoint is published
            window_start += time.perf_counter() - paused
            kill_after(state.step)
            if reason:
                state.stop_requested = reason
                return
