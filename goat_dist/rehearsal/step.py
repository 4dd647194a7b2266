"""One rank's training step, built and run as the trainer builds and runs it, on the meta device.

The rank is built as ``Trainer.__init__`` builds it: the config resolved for a CUDA run
(``trainer.resolve``), the same seed, ``model.GPT`` for the rank's layout, sequence parallelism, context
parallelism, activation checkpointing and the TP gradient sum applied (``parallelize.prepare``), the
trainer's optimizer. The step is the trainer's own ``Trainer.train_step``: every micro-batch of the step
moved to the device, forward, loss, backward, then the step's control agreement and the update.

What differs, and why:

* The model is built under a meta default device (no weights are drawn) and then moved to the device, as
  DeepSpeed moves it to the GPU; a tensor the code creates later without a device lands on the CPU and
  meets a meta tensor, as it would meet a CUDA one.
* DeepSpeed does not run on meta tensors (it builds flat CPU-side buffers and reads values), so
  ``RehearsedEngine`` stands in for the engine facade: bf16 mode's cast (GOAT's prior kept fp32 at ZeRO
  0-2), the micro-batches' backward, and the engine's data-parallel collectives made on the real replica
  group with DeepSpeed's rules for the configured stage (buckets, communication dtype, partitions):
  ``dp_collectives``. The optimizer step is torch's AdamW on the meta parameters.
* ``model.compile`` is not applied: inductor cannot compile for the meta device. The compiled blocks run
  the same ops.
* The step's one host read (the control agreement) is answered with a quiet step (``control.quiet_vector``).
"""

from __future__ import annotations

import contextlib
import math

import torch

from .. import collectives
from ..config import Config
from ..engine import sizes
from ..plan.memory import _bf16_optimizer
from ..trainer.control import is_control_vector, quiet_vector
from .world import RECORDER

META = torch.device("meta")


def rehearsal_config(cfg: Config, layers: int | None) -> Config:
    """``cfg`` resolved as a CUDA run resolves it (precision, GOAT's train length and key lanes), cut to
    ``layers`` identical blocks when given, with compilation off (see the module docstring)."""
    import copy

    from ..trainer.resolve import resolve_run_config

    out = copy.deepcopy(cfg)
    if layers is not None:
        if layers < 1:
            raise ValueError(f"--layers must be at least 1, got {layers}")
        out.model.num_layers = min(layers, out.model.num_layers)
    out.model.compile = False
    out.train.activation_checkpointing = cfg.train.activation_checkpointing
    resolved, _ = resolve_run_config(out, torch.device("cuda"), None, None, log=lambda *a, **k: None)
    return resolved


def loader_batch(cfg: Config, seed: int = 0) -> dict:
    """One micro-batch as the loader collates it (``data.loader.PackedBatches._batch``): tokens, labels
    and positions as int64 views of one host storage, plus the count of unreadable samples. Under
    ``data.document_masking`` the positions restart at document starts (documents of a few lengths)."""
    L, B = cfg.model.seq_len, cfg.train.micro_batch_size
    g = torch.Generator().manual_seed(seed)
    storage = torch.empty(3 * B * L + 1, dtype=torch.int64)
    out = storage[:-1].view(3, B, L)
    out[0] = torch.randint(0, cfg.model.vocab_size, (B, L), generator=g)
    out[1, :, :-1] = out[0, :, 1:]
    out[1, :, -1] = 0
    positions = torch.arange(L)
    if cfg.data.document_masking:  # documents of a third, a fifth, a seventh of the row, and so on
        lengths = [max(1, L // d) for d in (3, 5, 7)]
        starts, at = [], 0
        while at < L:
            starts.append(at)
            at += lengths[len(starts) % len(lengths)]
        first = torch.tensor(starts)[torch.searchsorted(torch.tensor(starts), positions, right=True) - 1]
        positions = positions - first
    out[2] = positions
    storage[-1] = 0
    return {"tokens": out[0], "labels": out[1], "position_ids": out[2], "skipped": storage[-1]}


class _Dataset:
    """What the trainer asks of its loader's dataset on the step path."""

    def global_samples(self, k: int) -> list[int]:
        return []


class _Loader:
    dataset = _Dataset()


def dp_collectives(cfg: Config, layout, params: list[torch.nn.Parameter], micro: int, when: str) -> None:
    """The data-parallel collectives DeepSpeed's engine makes for this rank's ``params``, by the configured
    ZeRO stage (``docs/parallelism.md``), issued on the layout's replica group (DP x CP) so the recorder
    sees them as the engine would make them. ``when``: ``forward`` and ``backward`` of micro-batch
    ``micro`` (ZeRO-3's gathers, ZeRO-2/3's per-micro-batch reductions) or ``boundary`` / ``update``
    (after the last backward / after the optimizer step)."""
    n = layout.replicas
    if n == 1:
        return
    stage = cfg.parallel.zero_stage
    bf16 = cfg.train.precision == "bf16"
    comm = torch.float32 if (not bf16 or cfg.parallel.grad_reduce_dtype == "fp32") else torch.bfloat16
    weights = torch.bfloat16 if bf16 else torch.float32
    group = layout.replica_group
    numels = [p.numel() for p in params]
    bucket = sizes.bucket_elements(cfg.model.hidden_size)

    def buckets(limit: int) -> list[int]:
        out, current = [], 0
        for k in numels:
            if current and current + k > limit:
                out.append(current)
                current = 0
            current += k
        return out + ([current] if current else [])

    def reduce_scatter(total: int, dtype) -> None:
        part = math.ceil(total / n)
        whole = torch.empty(part * n, dtype=dtype, device=META)
        collectives.reduce_scatter_tensor(torch.empty(part, dtype=dtype, device=META), whole, group=group)

    def all_gather(total: int, dtype) -> None:
        part = math.ceil(total / n)
        shard = torch.empty(part, dtype=dtype, device=META)
        out = torch.empty(part * n, dtype=dtype, device=META)
        collectives.all_gather_into_tensor(out, shard, group=group)

    # BF16_Optimizer (bf16 accumulating in fp32 at ZeRO-0/1): its fp32 sums all-reduced at the boundary as
    # ZeRO-0's gradients are, and at ZeRO-1 the updated weights all-gathered from the partitions
    bf16_optimizer = _bf16_optimizer(cfg, n)
    if (stage == 0 or bf16_optimizer) and when == "boundary":
        for size in buckets(sizes.ZERO0_ALLREDUCE_ELEMENTS):
            collectives.all_reduce(torch.empty(size, dtype=comm, device=META), group=group)
    elif stage == 1 and when == "boundary":
        for size in buckets(bucket):
            reduce_scatter(size, comm)
    elif stage == 2 and when == "backward":
        for size in buckets(bucket):
            reduce_scatter(size, comm)
    elif stage == 3 and when in ("forward", "backward"):
        for size in buckets(sizes.prefetch_elements(cfg.model.hidden_size)):
            all_gather(size, weights)
        if when == "backward":
            for size in buckets(bucket):
                reduce_scatter(size, comm)
    if bf16_optimizer and stage == 1 and when == "update":  # one all-gather of each flat group
        all_gather(sum(numels), weights)
    elif stage in (1, 2) and when == "update":
        for size in buckets(bucket):
            all_gather(size, weights)
    if when == "boundary" and cfg.train.grad_clip:
        # the gradient norm: each rank's sum of squares over its partition, summed over the replicas
        collectives.all_reduce(torch.empty(1, dtype=torch.float32, device=META), group=group)


class RehearsedEngine:
    """The engine facade (``engine.Engine``) as the trainer's step uses it, on the meta device."""

    def __init__(self, model, optimizer, cfg: Config, layout):
        self.module, self.optimizer, self.cfg, self.layout = model, optimizer, cfg, layout
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.micro = 0
        self.grad_accum = 1

    def __call__(self, tokens, positions, labels):
        with RECORDER.phase_of("engine"):
            dp_collectives(self.cfg, self.layout, self.params, self.micro, "forward")
        with RECORDER.phase_of("forward"):
            return self.module(tokens, positions, labels)

    def backward(self, loss: torch.Tensor, last: bool = True) -> None:
        with RECORDER.phase_of("backward"):
            loss.backward()
        with RECORDER.phase_of("engine"):
            dp_collectives(self.cfg, self.layout, self.params, self.micro, "backward")
            if last:
                dp_collectives(self.cfg, self.layout, self.params, self.micro, "boundary")
        self.micro += 1

    def grads_nonfinite(self) -> torch.Tensor:
        grads = [p.grad for p in self.params if p.grad is not None]
        flags = [torch.isfinite(g).all().logical_not() for g in grads]
        return torch.stack(flags).any() if flags else torch.zeros((), device=META)

    def step(self, drop: bool = False) -> None:
        """The update, whatever ``drop`` says: the rehearsal's host read answers a quiet step, but the
        update is what the rehearsal is for."""
        with RECORDER.phase_of("engine"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            dp_collectives(self.cfg, self.layout, self.params, self.micro, "update")
        self.micro = 0

    def set_micro_batches(self, micro_batches: int) -> None:
        self.grad_accum = micro_batches


def engine_cast(model, cfg: Config) -> None:
    """What the engine does to the model's dtypes in bf16 mode: bf16 weights, GOAT's prior kept fp32 at
    ZeRO 0-2 (``engine.patches.keep_fp32_through_cast``); at ZeRO-3 everything bf16 (the prior reads an
    fp32 mirror, ``engine.zero3``: not rehearsed)."""
    from ..parallel.parallelize import prior_params

    if cfg.train.precision != "bf16":
        return
    keep = (
        {id(p) for p in prior_params(model)} if cfg.parallel.zero_stage in sizes.PRIOR_FP32_STAGES else set()
    )
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point() and id(p) not in keep:
                p.data = p.data.to(torch.bfloat16)


def build_rank(cfg: Config, layout):
    """(model, engine) of this rank, as the trainer builds them (see the module docstring)."""
    from ..model import GPT
    from ..optim import build_optimizer
    from ..parallel.parallelize import prepare
    from ..trainer.trainer import seed_everything

    seed_everything(cfg.train.seed)
    with torch.device("meta"):
        model = GPT(cfg.model, layout, sequence_parallel=cfg.parallel.sp, documents=cfg.data.document_masking)
    model.to(layout.device)  # as the engine moves it to the GPU
    prepare(model, cfg, compile=False)
    optimizer, _ = build_optimizer(model, cfg.train)
    engine_cast(model, cfg)
    return model, RehearsedEngine(model, optimizer, cfg, layout)


def trainer_for(cfg: Config, layout, engine, grad_accum: int):
    """A ``Trainer`` with what ``train_step`` reads, and nothing it does not (no run directory, data or
    callbacks): the step is the trainer's own code."""
    from ..trainer.state import LoopState, RunState
    from ..trainer.trainer import Trainer

    class _Signals:
        received = None

    trainer = Trainer.__new__(Trainer)
    trainer.cfg, trainer.layout, trainer.engine, trainer.grad_accum = cfg, layout, engine, grad_accum
    trainer.state, trainer.loop, trainer.callbacks = RunState(), LoopState(), []
    trainer.loop.start(_Loader(), 0)
    trainer.signals = _Signals()  # type: ignore[assignment]  # all train_step reads of StopSignals
    trainer.autocast = contextlib.nullcontext  # bf16 weights already; torch.autocast has no meta device
    return trainer


def control_answer(t: torch.Tensor):
    """The host read's stand-in value: a quiet step for the control vector, zeros elsewhere."""
    if is_control_vector(t):
        return quiet_vector()
    return torch.zeros(t.shape, dtype=t.dtype).tolist()


def run_step(trainer, grad_accum: int) -> None:
    """One optimizer step of ``grad_accum`` micro-batches through ``Trainer.train_step``."""
    batches = iter([loader_batch(trainer.cfg, seed=k) for k in range(grad_accum)])
    with RECORDER.phase_of("step"):
        trainer.train_step(batches)
