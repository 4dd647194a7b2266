"""The training loop. Everything else (logging, parallelism, data) is set up around it.

The loop trains the engine (``goat_dist.engine.Engine``: the model behind DeepSpeed, whose details stay in
that package) and tells its callbacks (``callbacks/``) what happens; checkpoints, evaluation, pictures,
throughput and memory are callbacks of their own, as are the loggers and the user's ``train.callbacks``.
Callbacks see the trainer through ``callbacks.api.TrainerAPI``, never its attributes, and their state is
saved with each checkpoint (``checkpoint_record``) and restored on resume. A callback asks for a save or a
stop with ``request_save`` / ``request_stop``: the request travels in the step's one collective
(``control.agree``), so every rank honours it at the same step boundary."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from .. import distributed
from ..checkpoint import CheckpointManager, extension, lineage
from ..config import Config, save_run_config
from ..data import contract as data_contract
from ..data.batches import data_sources, train_loader, val_loader
from ..engine.construct import partition_as_built
from ..model import GPT
from ..parallel.parallelize import parallelize
from ..parallel.timeouts import Timeouts
from ..precision import autocast_context
from ..rampup import batch_at
from . import nonfinite, unreadable
from .callbacks import (
    Callback,
    Checkpointing,
    ConsoleLogger,
    Evaluation,
    JsonlLogger,
    MemoryUse,
    PriorPictures,
    Profiler,
    TensorBoardLogger,
    Throughput,
    TrainerAPI,
    load_callbacks,
    start_info,
)
from .control import StepControl, agree, batch_fingerprint
from .deadline import Deadline
from .resolve import resolve_run_config, saved_consumed_samples
from .signals import HANG_FRACTION, StopSignals
from .state import LoopState, RunState


def seed_everything(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def gradient_accumulation(cfg: Config, dp: int, consumed_samples: int = 0) -> int:
    """Micro-batches per step at the full global batch; the ramp-up's batch sizes still to come after
    ``consumed_samples`` (a resume's: ``resolve.saved_consumed_samples``) are checked too."""
    t = cfg.train
    distributed.check_batch(t.global_batch_size, t.micro_batch_size, dp)
    distributed.check_rampup(
        t.global_batch_size, t.micro_batch_size, dp, t.batch_rampup, cfg.model.seq_len, consumed_samples
    )
    return t.global_batch_size // (t.micro_batch_size * dp)


class Trainer:
    def __init__(self, cfg: Config, callbacks: list[Callback] | None = None):
        """``callbacks``: the output callbacks (default: the loggers, on the main rank); the trainer's own
        jobs and ``train.callbacks`` are added to them on every rank."""
        plugins = load_callbacks(cfg.train.callbacks)  # first: a bad entry fails before any work
        self.cfg = cfg
        p = cfg.parallel
        # the start-up collective timeout until this process's first step ends, then the steady one
        self.timeouts = Timeouts.from_config(p)
        self.layout = distributed.init(p.tp, p.cp, timeout_minutes=self.timeouts.minutes, run_dir=cfg.run_dir)
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
        self.run_dir = cfg.run_dir
        self.state = RunState()
        log = print if self.layout.is_main else (lambda *a, **k: None)
        # a save's progress reaches the callbacks as events (``on_checkpoint_<name>``): one event bus
        self.checkpoints = CheckpointManager(
            self.run_dir,
            cfg.checkpoint.keep_last,
            self.layout.is_main,
            events=lambda name, *args: self.emit(f"on_checkpoint_{name}", *args),
        )
        # where the run starts decides GOAT's L_train before the model exists: its own checkpoint
        # (train.resume), else train.init_from (a new run from another run's weights), else nothing
        self._start = self.checkpoints.choose_resume(cfg.train.resume)
        # a resume past part of a batch ramp-up: only its sizes still to come must divide
        self.grad_accum = gradient_accumulation(cfg, self.layout.dp, saved_consumed_samples(self._start))
        self.init_source = None
        if self._start is None and cfg.train.init_from:
            self.init_source = extension.agree_on_source(cfg.train.init_from)
        # every derived value fixed now, the config read-only from here on (trainer/resolve.py)
        self.cfg, kept = resolve_run_config(cfg, self.layout.device, self._start, self.init_source, log)
        if kept:
            log(f"data.window_order={kept}: the order this run's data stream began with (kept by the resume)")
        seed_everything(cfg.train.seed)  # same seed on every rank: identical initial weights
        self.model = GPT(
            m,
            self.layout,
            sequence_parallel=cfg.parallel.sp,
            built=partition_as_built(cfg, self.grad_accum, self.layout),  # ZeRO-3: partitioned as built
            documents=cfg.data.document_masking,  # else no host sync to look for documents
        )
        # SP, CP, activation checkpointing, compilation, the TP gradient sum, then the engine
        self.engine = parallelize(self.model, cfg, self.grad_accum)
        self.timeouts.begin()  # the groups made since the start (DeepSpeed's) get the start-up timeout too
        self.autocast = autocast_context(cfg, self.layout.device)
        self.sources = data_sources(cfg, self.layout, log=log)
        self.val_batches = val_loader(cfg, self.layout, self.sources) if cfg.train.eval_interval else None
        self.contract = data_contract.data_contract(cfg, self.sources)
        self.saved_callbacks: dict = {}  # the callbacks' states in the checkpoint resumed from
        self.resumed_from = self._resume()
        # config.yaml (written with the loggers) is the resolved, read-only config the run runs with
        given = callbacks if callbacks is not None else self._default_loggers()
        self.signals = StopSignals(hang_after_s=HANG_FRACTION * 60 * self.timeouts.minutes)
        self.loop = LoopState(first_step=self.state.step)
        self.deadline = Deadline.from_config(cfg)  # Slurm's job end, train.stop_at or time_limit_minutes
        self.checkpointing = Checkpointing(
            cfg, self.checkpoints, self.engine, self.checkpoint_record, self.deadline
        )
        jobs = [Throughput(cfg), Evaluation(cfg, self.val_batches), PriorPictures(cfg), self.checkpointing]
        if cfg.log.profile_steps:
            jobs.insert(0, Profiler(cfg))
        self.callbacks: list = [*jobs, MemoryUse(), *given, *plugins]
        self.api = TrainerAPI(self)  # what callbacks see of the trainer
        self._restored: set[int] = set()  # the callbacks that had their chance at a saved state
        self._attach()

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
                    contract=self.contract,
                )
                if self.layout.is_main:
                    carried = "weights and Adam state" if info["optimizer"] else "weights (Adam starts empty)"
                    print(
                        f"initialized from {info['path']} (step {info['step']}): {carried}; a new run from "
                        f"step 0, GOAT train_len {self.cfg.model.goat.train_len}"
                    )
            return None
        saved = self.checkpoints.load(self.engine, path, self.layout_record(), contract=self.contract)
        self.checkpoints.begin(path, saved["step"], saved.get(lineage.ORIGIN))
        self.state.load_state_dict(saved["run_state"])
        self.saved_callbacks = saved.get("callbacks") or {}  # none before callbacks had state: fresh
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
            "param_groups": self.engine.param_group_names(),
        }

    def checkpoint_record(self) -> dict:
        """What ``trainer_state.json`` holds: the step, the run state, the data contract, the layout and
        the callbacks' states (only when one has state: ``callback_states``)."""
        record = {
            "step": self.state.step,
            "init_from": None if self.init_source is None else str(self.init_source),
            "run_state": self.state.state_dict(),
            "data_contract": self.contract,
            **self.layout_record(),
        }
        states = self.callback_states()
        if states:
            record["callbacks"] = states
        return record

    def _default_loggers(self) -> list[Callback]:
        if not self.layout.is_main:
            return []
        self.run_dir.mkdir(parents=True, exist_ok=True)
        save_run_config(self.cfg, self.run_dir)
        cbs: list[Callback] = [
            ConsoleLogger(self.cfg.train.max_steps),
            JsonlLogger(self.run_dir / "metrics.jsonl"),
        ]
        if self.cfg.log.tensorboard:
            import yaml

            from ..observe.run_info import code_version

            config_text = yaml.safe_dump(self.cfg.to_dict(), sort_keys=False)
            cbs.append(TensorBoardLogger(self.run_dir / "tensorboard", config_text, code_version()))
        return cbs

    # ---- callbacks ----------------------------------------------------------------------------------
    def _attach(self) -> None:
        """Every callback (also those appended to ``self.callbacks`` since) gets the callbacks' API, and,
        the first time, its state from the checkpoint resumed from; they run in ascending ``order``, then
        as given."""
        self.callbacks.sort(key=lambda cb: getattr(cb, "order", Callback.order))
        keys = self._state_keys()
        for cb in self.callbacks:
            if hasattr(cb, "attach"):
                cb.attach(self.api)
            if id(cb) in self._restored:
                continue
            self._restored.add(id(cb))
            load = getattr(cb, "load_state_dict", None)
            if load is not None and keys[id(cb)] in self.saved_callbacks:
                load(self.saved_callbacks[keys[id(cb)]])

    def _state_keys(self) -> dict[int, str]:
        """Each callback's key among a checkpoint's callback states: its ``state_key`` or class name, the
        second of a kind numbered ``#2``, and so on in the callbacks' order."""
        keys: dict[int, str] = {}
        seen: dict[str, int] = {}
        for cb in self.callbacks:
            base = getattr(cb, "state_key", None) or type(cb).__name__
            seen[base] = seen.get(base, 0) + 1
            keys[id(cb)] = base if seen[base] == 1 else f"{base}#{seen[base]}"
        return keys

    def callback_states(self) -> dict:
        """``{key: state}`` of the callbacks whose ``state_dict()`` returns one; a state that JSON cannot
        hold is a TypeError naming its callback (it goes to ``trainer_state.json``)."""
        keys, states = self._state_keys(), {}
        for cb in self.callbacks:
            get = getattr(cb, "state_dict", None)
            state = get() if get is not None else None
            if state is None:
                continue
            try:
                json.dumps(state)
            except (TypeError, ValueError) as e:
                raise TypeError(
                    f"callback {keys[id(cb)]}: state_dict() must hold JSON values only: {e}"
                ) from e
            states[keys[id(cb)]] = state
        return states

    def add_callback(self, callback) -> None:
        self.callbacks.append(callback)
        self._attach()

    def emit(self, event: str, *args) -> None:
        """Send ``event`` (with the run state first) to every callback that defines it."""
        for cb in self.callbacks:
            handler = getattr(cb, event, None)
            if handler is not None:
                handler(self.state, *args)

    def request_save(self) -> None:
        """A checkpoint at the end of the current step (asked by its ``post_backward`` at the latest, else
        at the next step's end), on every rank: the request travels in the step's collective."""
        self.loop.save_requested = True

    def request_stop(self, reason: str) -> None:
        """Save and stop at the end of the current step (as ``request_save``); ``reason`` goes to
        ``last_exit.json``, which carries exit code 75 (``signals.EXIT_CHECKPOINTED``; rank 0 exits with it),
        as for a signal."""
        self.loop.stop_requested = self.loop.stop_requested or reason

    def save_checkpoint(self, final: bool = False) -> Path:
        """Collective: save now (``callbacks.checkpointing``); ``final`` waits until it is published."""
        return self.checkpointing.save(final)

    # ---- the loop ---------------------------------------------------------------------------------
    def fit(self) -> RunState:
        it = self.start_loop()
        self.emit("on_train_start", start_info(self))
        try:
            with self.signals:
                self._loop(it)
            self.emit("on_train_end")  # the end-of-run checkpoint first (Checkpointing), then the loggers
        except BaseException as e:
            self.emit("on_error", e)
            raise
        return self.state

    def start_loop(self):
        """The iterator of this rank's training micro-batches, from where the run state says."""
        start = self.state.consumed_samples - self.state.stream_start
        loader = train_loader(self.cfg, self.layout, self.sources, start_sample=start)
        self.loop.start(loader, self.state.step)
        self._attach()
        return iter(self.loop.loader)

    def _loop(self, it) -> None:
        cfg, state, loop = self.cfg, self.state, self.loop
        while state.step < cfg.train.max_steps:
            self.signals.step_started()  # the hang watchdog: stacks of this rank if the step never ends
            t0 = time.perf_counter()
            batch = self.step_batch()
            self.emit("pre_step")
            control = self.train_step(it)
            if not self.timeouts.steady:
                self._first_step_done()
            state.step += 1
            state.consumed_samples += batch
            state.consumed_tokens += batch * cfg.model.seq_len
            state.data_skipped += control.skipped
            loop.last_step_s = time.perf_counter() - t0
            state.elapsed_s += loop.last_step_s
            self.emit("post_step", control)  # log, evaluation, pictures, checkpoint: the callbacks' work
            if control.stop_reason:  # a signal or a request: its checkpoint is published
                state.stop_requested = control.stop_reason
                self.emit("on_stop", control.stop_reason)
                return

    def _first_step_done(self) -> None:
        """This process's first step has ended on this rank (its control collective and optimizer step):
        every process group and the hang watchdog go from ``parallel.startup_timeout_minutes`` to
        ``parallel.timeout_minutes``, on this rank alone (why that is safe: ``parallel/timeouts.py``)."""
        startup = self.timeouts.describe()
        self.timeouts.first_step_done()
        self.signals.set_hang_after(HANG_FRACTION * 60 * self.timeouts.minutes)
        if self.layout.is_main and self.timeouts.startup_minutes != self.timeouts.steady_minutes:
            print(
                f"first step done: every collective timeout is now {self.timeouts.describe()} (was {startup})"
            )

    def step_batch(self) -> int:
        """The global batch (sequences) of the step about to run: ``train.global_batch_size``, or under
        ``train.batch_rampup`` the ramp's size at the samples consumed so far, with the engine set to
        accumulate the micro-batches it takes."""
        t = self.cfg.train
        size = batch_at(
            self.state.consumed_samples, t.global_batch_size, t.batch_rampup, self.cfg.model.seq_len
        )
        micro_batches = size // (t.micro_batch_size * self.layout.dp)
        if micro_batches != self.grad_accum:
            self.engine.set_micro_batches(micro_batches)
            self.grad_accum = micro_batches
        return size

    def batch(self, it) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        """The next micro-batch of ``it`` on this rank's device (tokens, positions, labels) and as loaded."""
        b = next(it)
        return (*self.to_device(b), b)

    def to_device(self, b: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A loader batch's tokens, positions and labels on this rank's device."""
        move = lambda t: t.to(self.layout.device, non_blocking=True)  # no host sync per micro-batch
        return move(b["tokens"]), move(b["position_ids"]), move(b["labels"])

    def train_step(self, it) -> StepControl:
        """One optimizer step (``grad_accum`` micro-batches) and the step's one collective.

        The update is applied, dropped (non-finite under ``train.on_nonfinite=skip``, or no readable label
        in the global batch: ``unreadable``) or refused with an error (``raise``, or too many dropped in a
        row) depending on what every rank saw; the returned control says which, holds the DP-mean loss and
        the stop or save every rank honours at this step boundary."""
        loop = self.loop
        losses, fingerprint, skipped, valid = [], 0, 0, 0
        first_micro = loop.micro_seen  # the loader's index of this step's first micro-batch
        for micro in range(self.grad_accum):
            tokens, positions, labels, raw = self.batch(it)
            loop.micro_seen += 1
            fingerprint += batch_fingerprint(raw["tokens"])
            skipped += int(raw.get("skipped", 0))
            valid += unreadable.valid_labels(raw)  # host-side, from the loader's batch
            with self.autocast():
                loss = self._forward(tokens, positions, labels, micro)
            self.engine.backward(loss, last=micro == self.grad_accum - 1)
            losses.append(loss.detach().float())
        self.emit("post_backward")  # the last moment for a request this step's collective carries
        losses_t = torch.stack(losses)
        bad_loss = torch.isfinite(losses_t).logical_not()
        control = agree(
            loss_sum=torch.nan_to_num(losses_t, nan=0.0, posinf=0.0, neginf=0.0).sum(),
            micro_batches=self.grad_accum,
            nonfinite_loss=bad_loss.sum(),
            nonfinite_grad=self.engine.grads_nonfinite(),
            fingerprint=fingerprint,
            skipped=skipped,
            valid_labels=valid,
            signal=self.signals.received,
            save=loop.save_requested,
            stop=loop.stop_requested,
            tp=self.layout.tp,
            dp=self.layout.dp,
            cp=self.layout.cp,
        )
        loop.save_requested, loop.stop_requested = False, None  # delivered: every rank has them now
        if control.nonfinite:
            self._on_nonfinite(control, [first_micro + k for k in bad_loss.nonzero().flatten().tolist()])
        else:
            loop.nonfinite_in_row = 0
            dataset, main = loop.loader.dataset, self.layout.is_main
            unreadable.count_step(self.state, control, self.cfg.train, dataset, first_micro, main)
        self.emit("pre_optim_step", control)
        self.engine.step(drop=control.dropped)
        return control

    def _forward(self, tokens, positions, labels, micro: int) -> torch.Tensor:
        loss = self.engine(tokens, positions, labels)
        for cb in self.callbacks:  # a callback may change the loss (``post_forward``)
            hook = getattr(cb, "post_forward", None)
            changed = hook(self.state, micro, loss) if hook is not None else None
            loss = loss if changed is None else changed
        return loss

    def _on_nonfinite(self, control: StepControl, bad_micro: list[int]) -> None:
        """Raise (naming step, data and parameter), or count the dropped update."""
        step, loop = self.state.step + 1, self.loop
        loop.nonfinite_in_row += 1
        mode, limit = self.cfg.train.on_nonfinite, self.cfg.train.max_nonfinite_in_row
        if mode == "raise" or loop.nonfinite_in_row > limit:
            dataset = loop.loader.dataset
            samples = dataset.global_samples(bad_micro[0]) if bad_micro else []
            reason = (
                ""
                if mode == "raise"
                else f"{loop.nonfinite_in_row} non-finite steps in a row (limit {limit})"
            )
            nonfinite.raise_nonfinite(self.engine, step, control, samples, dataset, reason)
        self.state.nonfinite_skipped += 1
        if self.layout.is_main:
            print(
                f"step {step}: non-finite {'loss' if control.nonfinite_loss else 'gradient'}, update dropped "
                f"(train.on_nonfinite=skip; {loop.nonfinite_in_row} in a row, "
                f"{self.state.nonfinite_skipped} in this run)"
            )
