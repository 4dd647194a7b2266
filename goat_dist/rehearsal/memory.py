"""One rank's peak memory in one training step, traced without allocating, next to the planner's terms.

``trace_memory(cfg, rank, world)`` builds global ``rank``'s model in a fake world of ``world`` processes
(``distributed.init_fake``, as ``plan.dry_run`` does: TP, CP and DP groups), turns every tensor into a
CPU fake tensor (``FakeTensorMode``: shapes and dtypes, no storage) and runs one training step under
torch's ``MemTracker``, which adds up every storage as it is created and freed and names what it is for.
It takes seconds and no memory at any size; callers cut large models to a few layers
(``model.num_layers``). Traced as the trainer holds it:

* the weights in the engine's dtypes: bf16 in bf16 mode (GOAT's prior fp32 at ZeRO 0-2), else fp32; the
  precision is ``plan.planner.planned_config``'s (what ``auto`` means on a GPU);
* the trainer's optimizer (``optim.build_optimizer``: its groups, torch AdamW) stepping fp32 masters laid
  out as DeepSpeed lays them out: a clone per parameter at ZeRO-0 (none in fp32: AdamW steps the weights),
  one flat partition per group at ZeRO 1-3, its share over DP x CP (``plan.memory``'s partition sizes:
  the trace does not run DeepSpeed); AdamW's state exists before the step, as after every first step;
* when a step accumulates several micro-batches, the earlier ones' gradients, present from the start
  (mid-accumulation is where the planner puts the peak); then one micro-batch of
  ``train.micro_batch_size`` x ``model.seq_len`` tokens: forward under bf16 autocast, loss, backward,
  activation checkpointing, sequence and context parallelism as configured, eagerly (``model.compile``
  off); then the masters' gradients as DeepSpeed's step makes them and the optimizer step.

What the trace cannot see (each row of ``compare_with_plan`` says so where it matters):

* DeepSpeed's own buffers (reduce buckets: ``state_bytes``' ``buffers``); ZeRO-2/3 partition gradients
  (and ZeRO-3 parameters) during the backward, which the trace holds whole: those terms are the traced
  per-parameter bytes divided as ZeRO divides them (``_zero_state``) and the peaks are corrected by the
  difference;
* CUDA's allocator (512-byte rounding, fragmentation), context, NCCL and kernel workspaces (the plan's
  ``reserved``, not compared);
* the log step's parameter norm (``transient_bytes``' ``params_norm``): it runs after the step;
* values: a host read gets 0 (``_NoValues``), and packed documents (``data.document_masking``), whose
  boundaries are data, are traced as whole rows;
* autocast runs as CPU autocast does, except for the one difference from CUDA's that this model meets
  (``_cuda_autocast_norms``: CUDA's runs the norms in fp32); attention runs torch's SDPA (what ``auto``
  resolves to without CUDA). Without a mask its CPU flash kernel keeps no L x L tensor,
  as the GPU's flash kernels do; where SDPA takes a mask (ALiBi's bias) it falls back to its math path,
  which keeps L x L probabilities. Such tensors kept by the attention are reported (``quadratic_bytes``)
  and, where the plan assumes a flash kernel (any backend but ``sdpa`` and ``eager``), left out of the
  activations and the peak.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.utils._python_dispatch import TorchDispatchMode

from .. import distributed
from ..config import Config
from ..config.sections import Section
from ..engine.sizes import PRIOR_FP32_STAGES, persistence_threshold
from ..optim import build_optimizer, is_prior
from ..plan.memory import (
    _bf16_optimizer,
    _ceil_div,
    _cp,
    _flat_partition,
    _fp32_accumulation,
    _grad_accumulation,
    partition_overlap,
    state_bytes,
)
from ..plan.planner import memory_at, planned_config
from .standin import patch

__all__ = ["CATEGORIES", "TOLERANCE", "compare_with_plan", "trace_memory"]

CATEGORIES = ("params", "grads", "optimizer", "activations", "temporaries")  # of the peak, summing to it
PHASES = ("forward", "backward", "step")
TOLERANCE = 0.10  # a term further from the plan than this gets a note saying why
STATE = (_MemRefType.PARAM, _MemRefType.BUFFER, _MemRefType.GRAD, _MemRefType.OPT, _MemRefType.OTH)
FLASH_PLANNED = ("auto", "flash", "flash4")  # backends the plan counts without an L x L tensor


class _PhaseTracker(MemTracker):
    """``MemTracker`` that also keeps the peak snapshot of each phase of the step (``phase``), not only
    the overall one: the step's own peak shows what the optimizer adds, which the loss's peak hides."""

    def __init__(self):
        super().__init__()
        self.phase = "start"
        self.phase_peaks: dict[str, dict] = {}

    def _update_peak_stats(self, peak_state) -> None:  # torch 2.13's MemTracker: after every op
        super()._update_peak_stats(peak_state)
        if _total(self._curr_mem_snap) > _total(self.phase_peaks.get(self.phase, {})):
            self.phase_peaks[self.phase] = {dev: dict(snap) for dev, snap in self._curr_mem_snap.items()}


class _QuadraticWatch(TorchDispatchMode):
    """Storages of L x L tensors (score or mask matrices) the attention core creates, kept weakly: those
    still alive after the forward are kept for the backward. Under context parallelism the rows and keys
    are multiples of a chunk (``seq_len / 2cp``: a rank's two chunks, each one's key prefix)."""

    def __init__(self, seq_len: int, cp: int = 1):
        super().__init__()
        self.chunk = seq_len // (2 * cp) if cp > 1 else seq_len
        self.storages: weakref.WeakSet = weakref.WeakSet()
        self.op: str | None = None

    def _square(self, t) -> bool:
        return (
            isinstance(t, torch.Tensor)
            and t.dim() >= 2
            and all(n and n % self.chunk == 0 for n in t.shape[-2:])
        )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if self._square(t):
                self.storages.add(t.untyped_storage())
                self.op = self.op or str(func)
        return out

    def kept_bytes(self) -> int:
        return sum(s.nbytes() for s in self.storages)


class _NoValues(TorchDispatchMode):
    """Fake tensors have no values: a read on the host (``.item()``, ``int(t)``, a tensor's truth) gets 0
    (False), counted in ``reads``. The step's only one: learned positions check their range on a CPU
    tensor (``model.gpt``); packed documents, whose boundaries are data, are not traced at all."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
            return False if args[0].dtype == torch.bool else 0
        return func(*args, **(kwargs or {}))


def _watched(watch: _QuadraticWatch, core_call, module, fn, *args):
    with watch:
        return core_call(module, fn, *args)


def _total(snapshot: dict) -> int:
    return sum(dev.get("Total", 0) for dev in snapshot.values())


def _bytes(snapshot: dict, *kinds) -> int:
    return sum(dev.get(k, 0) for dev in snapshot.values() for k in kinds)


@contextlib.contextmanager
def _cpu_device():
    """megatron allocates buffers on ``torch.cuda.current_device()``: the CPU here, where the fake tensors
    live (also on a machine with CUDA, where a CUDA fake tensor meeting a CPU one would raise)."""
    original = torch.cuda.current_device
    patch(torch.cuda, "current_device", lambda: "cpu")  # for the block
    try:
        yield
    finally:
        patch(torch.cuda, "current_device", original)


def _float(x):
    return x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


@contextlib.contextmanager
def _cuda_autocast_norms():
    """CUDA's autocast runs ``rms_norm`` and ``layer_norm`` in fp32 (its fp32 op list) and CPU's leaves them
    in their input's dtype; the only ops of this model the two treat differently. While tracing, both
    norms get fp32 inputs under autocast, as on CUDA: the next linear keeps (and sequence parallelism
    gathers) the fp32 output a GPU run holds."""
    originals = {name: getattr(F, name) for name in ("rms_norm", "layer_norm")}

    def in_fp32(fn):
        @functools.wraps(fn)
        def norm(*args, **kwargs):
            if torch.is_autocast_enabled("cpu"):
                args = tuple(_float(a) for a in args)
                kwargs = {k: _float(v) for k, v in kwargs.items()}
            return fn(*args, **kwargs)

        return norm

    for name, fn in originals.items():
        setattr(F, name, in_fp32(fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(F, name, fn)


def _planned(cfg: Config) -> Config:
    """``planned_config(cfg)`` (precision and GOAT's lanes as a GPU run resolves them) of a writable copy:
    a run's resolved config is read-only (``config.sections.freeze``) and may be what is passed here."""

    def thawed(section):
        inner = {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}
        return dataclasses.replace(
            section, **{k: thawed(v) for k, v in inner.items() if isinstance(v, Section)}
        )

    return planned_config(thawed(cfg))


def _working_dtype(cfg: Config, name: str) -> torch.dtype:
    """The dtype the engine keeps a weight in: bf16 mode casts all but GOAT's prior (at ZeRO 0-2)."""
    if cfg.train.precision != "bf16":
        return torch.float32
    if is_prior(name) and cfg.parallel.zero_stage in PRIOR_FP32_STAGES:
        return torch.float32
    return torch.bfloat16


def _to_fake(model: nn.Module, cfg: Config) -> None:
    """Replace the meta parameters and buffers by CPU fake tensors (inside ``FakeTensorMode``), the
    parameters in the engine's dtypes, keeping megatron's attributes on them."""
    names = {id(p): n for n, p in model.named_parameters()}
    for module in model.modules():
        for key, p in list(module._parameters.items()):
            if p is not None:
                dtype = _working_dtype(cfg, names[id(p)])
                fake = nn.Parameter(torch.empty(p.shape, dtype=dtype), requires_grad=p.requires_grad)
                fake.__dict__.update(p.__dict__)
                module._parameters[key] = fake
        for key, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[key] = torch.empty(b.shape, dtype=b.dtype)


def _use_masters(cfg: Config, optimizer: torch.optim.Optimizer, replicas: int) -> list[torch.Tensor]:
    """Point each optimizer group at the fp32 masters DeepSpeed gives it (as DeepSpeed does); returns
    the new tensors: a clone per parameter at ZeRO-0 (none in fp32), the group flattened, padded and
    split over the ``replicas`` (DP x CP) at ZeRO 1-2, every parameter's own share in one flat buffer at
    ZeRO-3. ``BF16_Optimizer`` (bf16 accumulating in fp32 at ZeRO-0/1) flattens every group as ZeRO-1
    does, over a partition group of one rank at ZeRO-0."""
    stage, bf16 = cfg.parallel.zero_stage, cfg.train.precision == "bf16"
    whole = _bf16_optimizer(cfg, replicas) and stage == 0  # BF16_Optimizer's one-rank partition
    masters = []
    for group in optimizer.param_groups:
        params = group["params"]
        if whole:
            own = [torch.empty(_flat_partition(sum(p.numel() for p in params), 1), dtype=torch.float32)]
        elif stage == 0:
            own = [torch.empty(p.shape, dtype=torch.float32) for p in params] if bf16 else params
        elif stage in (1, 2):
            own = [
                torch.empty(_flat_partition(sum(p.numel() for p in params), replicas), dtype=torch.float32)
            ]
        else:
            own = [torch.empty(sum(_ceil_div(p.numel(), replicas) for p in params), dtype=torch.float32)]
        group["master_of"] = params  # the model's parameters, for ZeRO's division below
        group["prior"] = group.get("name", "").startswith("prior")
        group["params"] = own
        masters += [m for m in own if not any(m is p for p in params)]
    return masters


def _create_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """One step on zero gradients: AdamW's moments and step counters exist, as after any first step."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for p in params:
        p.grad = None


def _master_grads(cfg: Config, optimizer: torch.optim.Optimizer, replicas: int) -> None:
    """The masters' gradients as DeepSpeed's step makes them: at ZeRO 1-2 it flattens the partition's
    gradients into a new tensor (in their dtype) and casts that to fp32 (a second tensor in bf16, the
    same one in fp32); in bf16 it casts every gradient to fp32 at ZeRO-0 and the flat partition at ZeRO-3.
    Where it copies nothing (fp32 at ZeRO 0 and 3, a partition accumulated in fp32) the gradient is an
    alias of the master: the state counts those bytes already."""
    stage, bf16 = cfg.parallel.zero_stage, cfg.train.precision == "bf16"
    copies = not _fp32_accumulation(cfg, replicas) and (bf16 or stage in (1, 2))
    for group in optimizer.param_groups:
        dtype = group["master_of"][0].dtype  # the gradients' (one dtype a group)
        for master in group["params"]:
            if master.grad is not None:  # fp32 ZeRO-0: the weight itself, with its gradient
                continue
            if not copies:
                master.grad = master.detach()
            elif stage in (1, 2):
                master.grad = torch.empty(master.shape, dtype=dtype).to(torch.float32)
            else:
                master.grad = torch.empty(master.shape, dtype=torch.float32)


def _zero_state(cfg: Config, optimizer: torch.optim.Optimizer, replicas: int, index: int) -> dict:
    """ZeRO-2/3's gradients (and ZeRO-3's parameters), which the trace holds whole, as ZeRO divides the
    traced per-parameter figures over the ``replicas`` (DP x CP; this rank is number ``index``). ZeRO-2:
    the whole gradients of the parameters touching this rank's partition of each group
    (``plan.memory.partition_overlap``), or, accumulated in fp32, the flat fp32 partition itself. ZeRO-3:
    each parameter's share (the small ones, up to the persistence threshold, also whole; in bf16 the
    prior's fp32 mirror) and its gradient's (fp32 when accumulated in fp32). Empty below ZeRO-2, where the
    traced figures are the engine's."""
    stage, dp = cfg.parallel.zero_stage, replicas
    groups = [g["master_of"] for g in optimizer.param_groups]
    fp32 = _fp32_accumulation(cfg, dp)
    if stage == 2:
        if fp32:
            return {"grads": 4 * sum(_flat_partition(sum(p.numel() for p in ps), dp) for ps in groups)}
        held = [partition_overlap([p.numel() for p in ps], dp)[index] for ps in groups]
        return {"grads": sum(n * ps[0].element_size() for n, ps in zip(held, groups))}  # one dtype a group
    if stage == 3:
        keep = persistence_threshold(cfg.model.hidden_size)
        params = grads = 0
        for p in (p for ps in groups for p in ps):
            part = _ceil_div(p.numel(), dp)
            params += p.element_size() * (part + (p.numel() if p.numel() <= keep else 0))
            grads += (4 if fp32 else p.element_size()) * part
        if cfg.train.precision == "bf16":  # the prior's fp32 mirror (engine/zero3.py)
            params += 4 * sum(p.numel() for g in optimizer.param_groups if g["prior"] for p in g["master_of"])
        return {"params": params, "grads": grads}
    return {}


def _fp32_sums(cfg: Config, optimizer: torch.optim.Optimizer, replicas: int) -> int:
    """``BF16_Optimizer``'s whole fp32 gradient buffer (each group flat, padded as its weights), alive from
    the first backward through the step next to the bf16 ``.grad`` the trace holds; 0 for other engines."""
    if not _bf16_optimizer(cfg, replicas):
        return 0
    parts = replicas if cfg.parallel.zero_stage == 1 else 1
    flat = [
        _flat_partition(sum(p.numel() for p in g["master_of"]), parts) * parts for g in optimizer.param_groups
    ]
    return 4 * sum(flat)


def trace_memory(cfg: Config, rank: int, world: int) -> dict:
    """Global ``rank``'s bytes in one training step of ``cfg`` on ``world`` ranks, traced on CPU fake
    tensors (nothing is allocated), as the module docstring says.

    Returns, in bytes:

    * the peak by category at its moment, summing to ``total``: ``params``, ``grads``, ``optimizer``
      (fp32 masters and AdamW's state), ``activations`` (what the forward made for the backward to keep),
      ``temporaries`` (the rest: the loss's copies of the logits, gradients of activations, the step's
      gradients); ``peak_phase``: ``forward``, ``backward`` or ``step``; ``phase_peaks``: each phase's;
    * the planner's terms: ``state`` (``params``, ``grads``, ``optimizer``, ``total``, each at its
      largest), ``saved_activations`` (alive at the end of the forward: what the backward keeps, the
      batch, megatron's buffers), ``transient`` (``with_activations``: the forward/backward peak above
      the state and the saved activations; ``step``: the step's peak above the state; ``total``: the
      peak above both);
    * ``quadratic_bytes`` (L x L tensors the attention kept, 0 if none; left out of
      ``saved_activations`` where the plan assumes a flash kernel) and ``quadratic_op``;
      ``zero_counted``: the state terms counted from ZeRO's division, not traced; ``host_reads``: the
      values the step read on the host (answered 0);
    * the layout: ``rank``, ``world``, ``tp``, ``dp``, ``cp``, ``tp_rank``, ``dp_rank``,
      ``replica_rank`` (ZeRO's partition index), ``zero_stage``, ``precision`` (as planned),
      ``micro_batch``, ``grad_accum``, ``num_layers``; ``seconds`` the trace took.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..model import GPT
    from ..parallel import model_parallel

    if torch.distributed.is_initialized():
        raise RuntimeError("trace_memory builds a fake world: it needs a process without torch.distributed")
    started = time.perf_counter()
    cfg = _planned(cfg)
    micro, seq = cfg.train.micro_batch_size, cfg.model.seq_len
    bf16 = cfg.train.precision == "bf16"
    layout = distributed.init_fake(rank, world, cfg.parallel.tp, _cp(cfg))
    replicas = layout.replicas  # ZeRO partitions over DP x CP
    accumulation = _grad_accumulation(cfg, replicas)
    watch = _QuadraticWatch(seq, layout.cp)
    tracker = _PhaseTracker()
    reads = _NoValues()
    try:
        with _cpu_device(), _cuda_autocast_norms():
            with torch.device("meta"):
                model = GPT(cfg.model, layout, sequence_parallel=cfg.parallel.sp, documents=False)
            model_parallel.apply(model, activation_checkpointing=cfg.train.activation_checkpointing)
            for block in model.blocks:
                attn = block.get_submodule("attn")
                patch(attn, "core_call", functools.partial(_watched, watch, attn.core_call))
            with FakeTensorMode():
                _to_fake(model, cfg)
                optimizer, _ = build_optimizer(model, cfg.train)
                masters = _use_masters(cfg, optimizer, replicas)
                _create_adam_state(optimizer)
                if accumulation > 1:  # the earlier micro-batches' gradients, waiting for the boundary
                    for p in model.parameters():
                        p.grad = torch.zeros_like(p)
                tracker.track_external(model, optimizer, *masters)  # the masters count as "other"
                with tracker, reads:
                    start = tracker.get_tracker_snapshot()
                    tracker.phase = "forward"
                    tokens = torch.zeros(micro, seq, dtype=torch.long)
                    positions = torch.arange(seq).expand(micro, seq)
                    labels = torch.zeros(micro, seq, dtype=torch.long)
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                        loss = model(tokens, positions, labels)
                    forward = tracker.get_tracker_snapshot()
                    quadratic = watch.kept_bytes()
                    tracker.phase = "backward"
                    loss.backward()
                    del loss, tokens, positions, labels
                    backward = tracker.get_tracker_snapshot()
                    tracker.phase = "step"
                    _master_grads(cfg, optimizer, replicas)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                zero = _zero_state(cfg, optimizer, replicas, layout.replica_rank)
                fp32_sums = _fp32_sums(cfg, optimizer, replicas)
    finally:
        distributed.teardown_fake()

    state = {
        "params": _bytes(start, _MemRefType.PARAM, _MemRefType.BUFFER),
        "grads": _bytes(backward, _MemRefType.GRAD),
        "optimizer": _bytes(start, _MemRefType.OPT, _MemRefType.OTH),  # moments, steps; the masters
    }
    if fp32_sums:  # not traced (DeepSpeed's, not the model's): added to the gradients and every peak
        zero["grads"] = state["grads"] + fp32_sums
    # the ZeRO-2/3 partitions the trace held whole: counted as ZeRO divides them, peaks corrected
    held_whole = sum(state[k] - v for k, v in zero.items())
    state.update(zero)
    state["total"] = sum(state.values())
    # L x L tensors of SDPA's CPU math path that the plan's flash kernel would not make: left out of the
    # forward's and backward's peaks (alive there: until their layer's backward) and the activations
    excluded = quadratic if cfg.model.attention_backend in FLASH_PLANNED else 0
    phase_peaks = {p: _total(tracker.phase_peaks.get(p, start)) - held_whole for p in PHASES}
    for phase in ("forward", "backward"):
        phase_peaks[phase] -= excluded
    peak_phase = max(PHASES, key=lambda p: phase_peaks[p])
    peak = tracker.phase_peaks.get(peak_phase, start)
    total = phase_peaks[peak_phase]
    at_peak = {
        "params": _bytes(peak, _MemRefType.PARAM, _MemRefType.BUFFER),
        "grads": _bytes(peak, _MemRefType.GRAD),
        # during the step, MemTracker counts AdamW's temporaries as optimizer state: those are temporaries
        "optimizer": min(_bytes(peak, _MemRefType.OPT, _MemRefType.OTH), state["optimizer"]),
        "activations": _bytes(peak, _MemRefType.ACT),
    }
    for key, value in zero.items():
        at_peak[key] = value
    saved = _bytes(forward, _MemRefType.ACT) - _bytes(start, _MemRefType.ACT) - excluded
    outlived = _bytes(backward, _MemRefType.ACT)  # what the backward left: megatron's SP buffer
    # MemTracker calls everything the forward makes an activation: the kept ones are, the loss's copies
    # of the logits are temporaries (as are the step's gradients, made outside any module)
    if peak_phase == "step":
        at_peak["activations"] = min(at_peak["activations"], outlived)
    else:
        at_peak["activations"] = min(at_peak["activations"] - excluded, saved)
    at_peak["temporaries"] = total - sum(at_peak.values())
    loss_peak = max(phase_peaks["forward"], phase_peaks["backward"])
    loss_phase = "forward" if loss_peak == phase_peaks["forward"] else "backward"
    state_then = _bytes(tracker.phase_peaks.get(loss_phase, start), *STATE) - held_whole
    transient = {
        "with_activations": loss_peak - min(state_then, state["total"]) - saved,
        "step": phase_peaks["step"] - state["total"] - outlived,
        "total": total - state["total"] - saved,
    }
    return {
        **at_peak,
        "total": total,
        "peak_phase": peak_phase,
        "phase_peaks": phase_peaks,
        "state": state,
        "saved_activations": saved,
        "transient": transient,
        "quadratic_bytes": quadratic,
        "quadratic_op": watch.op,
        "zero_counted": sorted(zero),
        "host_reads": reads.reads,
        "rank": rank,
        "world": world,
        "tp": layout.tp,
        "dp": layout.dp,
        "tp_rank": layout.tp_rank,
        "dp_rank": layout.dp_rank,
        "cp": layout.cp,
        "replica_rank": layout.replica_rank,
        "zero_stage": cfg.parallel.zero_stage,
        "precision": cfg.train.precision,
        "micro_batch": micro,
        "grad_accum": accumulation,
        "num_layers": cfg.model.num_layers,
        "seconds": time.perf_counter() - started,
    }


def _row(term: str, planned: int, traced: int, note: str = "", explained: str = "") -> dict:
    """One term: ``ratio`` traced / planned (None when nothing is planned); past ``TOLERANCE`` the note
    gives ``explained``, the known reason, or says that there is none."""
    ratio = traced / planned if planned else None
    within = None if ratio is None else abs(ratio - 1) <= TOLERANCE
    if within is False:
        note = _join([note, explained or "not explained: a planner term to check"])
    return {
        "term": term,
        "planned": planned,
        "traced": traced,
        "ratio": ratio,
        "within": within,
        "note": note,
    }


def _join(notes: list[str]) -> str:
    return "; ".join(n for n in notes if n)


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**20 else f"{n:,} B"


def compare_with_plan(cfg: Config, world: int, traced: dict) -> list[dict]:
    """The planner's per-rank terms for ``cfg`` on ``world`` ranks next to ``traced`` (``trace_memory``'s
    result for the same config and world): one row per term, each a dict of ``term``, ``planned`` and
    ``traced`` bytes, ``ratio`` (traced / planned; None when nothing is planned), ``within`` (the ratio
    within ``TOLERANCE`` of 1) and ``note`` (what the row holds, what the trace cannot see, and why the
    two differ where they do).

    Terms, in order: ``params``, ``grads``, ``optimizer`` and their sum ``state`` (the planner's
    ``state_bytes`` at the traced replica, without DeepSpeed's buffers, which do not run here),
    ``activations`` (``activation_bytes``), the ``transient`` (``transient_bytes``) by when it peaks,
    ``transient:activations`` (the loss, a recomputed layer) and ``transient:step`` (the masters'
    gradients), then whole, and ``total`` (state + activations + transient: the plan's total without the
    reserve and the buffers, against the traced peak). Planned terms the trace cannot see (DeepSpeed's
    buffers and gathers, the log step's parameter norm) are named in the notes with their bytes."""
    cfg = _planned(cfg)
    replicas = world // cfg.parallel.tp  # DP x CP: what ZeRO partitions over
    mem = memory_at(cfg, replicas, traced["micro_batch"])
    state = state_bytes(cfg, replicas, rank=traced["replica_rank"])
    act, tr = mem["activations"], mem["transient"]
    got = traced["state"]
    divided = "held whole by the trace: ZeRO's division of the traced per-parameter bytes"
    rows = [
        _row(key, state[key], got[key], divided if key in traced["zero_counted"] else "")
        for key in ("params", "grads", "optimizer")
    ]
    unseen = f"; not traced: DeepSpeed's buffers, {_gib(state['buffers'])}" if state["buffers"] else ""
    planned_state = state["total"] - state["buffers"]
    rows.append(_row("state", planned_state, got["total"], "params + grads + optimizer" + unseen))

    notes = [f"of which megatron's SP all-gather buffer {_gib(act['sp_buffer'])}" if act["sp_buffer"] else ""]
    why = ""
    if traced["quadratic_bytes"]:
        flash = cfg.model.attention_backend in FLASH_PLANNED
        notes.append(
            f"SDPA's CPU math path kept {_gib(traced['quadratic_bytes'])} of L x L tensors "
            f"({traced['quadratic_op']}), "
            + ("left out with the peak: the plan's flash kernel makes none" if flash else "kept")
        )
        why = (
            "an explicit bias through SDPA: the plan counts it in fp32 per layer, the math path on the CPU "
            "keeps bf16 probabilities (CUDA's memory-efficient kernel the bf16 mask)"
        )
    rows.append(_row("activations", act["total"], traced["saved_activations"], _join(notes), why))

    transient = traced["transient"]
    loss = tr["logits"] + tr["tied_input"]
    note = "the loss's copies of the logits (a tied head's fp32 input) or a recomputed layer, the larger"
    rows.append(
        _row("transient:activations", max(loss, tr["recompute"]), transient["with_activations"], note)
    )
    rows.append(_row("transient:step", tr["fp32_grads"], transient["step"], "the masters' gradients"))
    untraced = {
        "zero3_gather": "ZeRO-3's gathered layer",
        "allreduce": "the boundary all-reduce's flat copy (ZeRO-0, BF16_Optimizer)",
        "params_norm": "the log step's parameter norm (after the step)",
    }
    unseen = _join([f"{what} {_gib(tr[key])}" for key, what in untraced.items() if tr[key]])
    reasons = [
        "the plan sums peaks that do not coincide (conservative, docs/planner.md): the traced peak holds "
        "the loss's; the step's and the parameter norm's come after the activations are freed"
    ]
    if tr["logits"] and tr["recompute"]:
        reasons.append("the recomputed layer comes after the logits are freed")
    if traced["grad_accum"] == 1:
        reasons.append("with one micro-batch a step, the gradients are made while the activations are freed")
    note = f"not traced: {unseen}" if unseen else ""
    rows.append(_row("transient", tr["total"], transient["total"], note, _join(reasons)))

    planned_total = planned_state + act["total"] + tr["total"]
    note = "state + activations + transient (no reserve, no DeepSpeed buffers) against the traced peak"
    rows.append(_row("total", planned_total, traced["total"], note, "as the transient row says"))
    return rows
