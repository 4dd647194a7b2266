"""Where DeepSpeed keeps each parameter's fp32 master copy and Adam moments, per optimizer layout.

Why: the universal checkpoint must read and write the fp32 masters and Adam's moments, not the weights the
forward pass uses, and DeepSpeed keeps them in a different place for every precision x ZeRO stage:

===================  ===============================  ==============================================
layout               engine.optimizer                 fp32 master / Adam state
===================  ===============================  ==============================================
fp32, ZeRO-0         the torch optimizer itself       the parameter itself; state keyed by it
bf16, ZeRO-0         FP16_UnfusedOptimizer            per-parameter fp32 clones (``fp32_groups``);
                                                      state keyed by the clones, not the parameters
ZeRO-1/2 (any)       DeepSpeedZeroOptimizer           flat fp32 partition per group; a parameter's
                                                      piece is ``_hp_mapping`` (may be none on a rank)
bf16, ZeRO-0/1 with   BF16_Optimizer                   flat fp32 partition per group (ZeRO-0: the whole
fp32 accumulation                                     group on every rank); ``_hp_mapping`` as ZeRO-1/2
ZeRO-3 (any)         DeepSpeedZeroOptimizer_Stage3    flat fp32 partition per sub-group; every
                                                      parameter has a (padded) piece on every rank
===================  ===============================  ==============================================

Any other optimizer wrapper is an error naming it (no silent fallback to the model's weights), raised as
the caller's error class (the checkpoint code passes its ``CheckpointError``). Each layout answers three
questions: the whole fp32 value and moments of a parameter (collective over DP where they are
partitioned), which flat range of a parameter this rank holds and where to write it, and how to bring the
forward weights and Adam's step counter in line after a load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .zero3 import partition_span

MOMENTS = ("exp_avg", "exp_avg_sq")
KEYS = ("", *MOMENTS)  # "" is the fp32 value


@dataclass
class Owned:
    """Elements ``[start, start + numel)`` of a parameter's flattened (TP-local) tensor that this rank
    holds, and the 1-D tensors to write them into, per key ("" = fp32 master, or a moment)."""

    start: int
    numel: int
    dest: dict[str, torch.Tensor]


def _adam_state(opt: torch.optim.Optimizer, key_tensor: torch.Tensor) -> dict:
    """Adam's state for ``key_tensor``, created (zeros, step 0) if the optimizer has not stepped yet."""
    state = opt.state[key_tensor]
    if "exp_avg" not in state:
        fused = any(g.get("fused") for g in opt.param_groups)  # fused AdamW keeps its step on the device
        state.update(
            step=torch.zeros((), dtype=torch.float32, device=key_tensor.device if fused else "cpu"),
            exp_avg=torch.zeros_like(key_tensor, memory_format=torch.preserve_format),
            exp_avg_sq=torch.zeros_like(key_tensor, memory_format=torch.preserve_format),
        )
    return state


class MasterLayout:
    name = ""
    replicated = False  # every data-parallel rank holds the whole TP slice (no ZeRO partitioning)

    def __init__(self, engine, error: type[Exception] = RuntimeError):
        self.engine, self.error = engine, error
        self.opt = engine.optimizer
        self.base = getattr(engine.optimizer, "optimizer", engine.optimizer)

    def full(self, p) -> dict[str, torch.Tensor]:
        """The fp32 value and moments of ``p``'s TP-local tensor, whole. Collective over DP if partitioned."""
        raise NotImplementedError

    def owned(self, p) -> list[Owned]:
        """The ranges of ``p`` this rank holds, with the tensors a load writes them into."""
        raise NotImplementedError

    def pieces(self, p) -> list[Owned]:
        """The ranges of ``p`` this rank holds, as live views to save (no state is changed)."""
        return self.owned(p)

    def adam_step(self) -> float | None:
        """Adam's step counter on this rank (every group steps together), or None before the first step."""
        steps = [float(torch.as_tensor(s["step"])) for s in self.base.state.values() if "step" in s]
        return max(steps) if steps else None

    def prepare(self) -> None:
        """Before reading or writing: Adam's state exists and DeepSpeed's views of it are current."""

    def finish_load(self, step: int) -> None:
        """After every owned range was written: forward weights follow, Adam's step counter continues."""
        for state in self.base.state.values():
            if "step" in state:
                state["step"] = torch.full_like(torch.as_tensor(state["step"]), float(step))


class PlainAdam(MasterLayout):
    """fp32 without ZeRO: the parameter is its own master."""

    name = "fp32 ZeRO-0 (torch optimizer)"
    replicated = True

    def full(self, p):
        state = self.base.state.get(p, {})
        return {"": p.detach(), **{m: state.get(m, torch.zeros_like(p)) for m in MOMENTS}}

    def owned(self, p):
        state = _adam_state(self.base, p)
        dest = {"": p.data.view(-1), **{m: state[m].view(-1) for m in MOMENTS}}
        return [Owned(0, p.numel(), dest)]


class UnfusedMasters(MasterLayout):
    """bf16 without ZeRO (FP16_UnfusedOptimizer): separate fp32 clones, Adam keyed by the clones."""

    name = "bf16 ZeRO-0 (FP16_UnfusedOptimizer)"
    replicated = True

    def __init__(self, engine, error: type[Exception] = RuntimeError):
        super().__init__(engine, error)
        self.master = {
            id(p): m
            for lp, hp in zip(self.opt.fp16_groups, self.opt.fp32_groups)
            for p, m in zip(lp, hp, strict=True)
        }

    def _master(self, p) -> torch.Tensor:
        try:
            return self.master[id(p)]
        except KeyError:
            raise self.error(
                f"parameter of shape {tuple(p.shape)} has no fp32 master in {self.name}"
            ) from None

    def full(self, p):
        master = self._master(p)
        state = self.base.state.get(master, {})
        return {"": master.detach(), **{m: state.get(m, torch.zeros_like(master)) for m in MOMENTS}}

    def owned(self, p):
        master = self._master(p)
        state = _adam_state(self.base, master)
        dest = {"": master.data.view(-1), **{m: state[m].view(-1) for m in MOMENTS}}
        return [Owned(0, p.numel(), dest)]

    def finish_load(self, step):
        with torch.no_grad():
            for lp, hp in zip(self.opt.fp16_groups, self.opt.fp32_groups):
                for p, master in zip(lp, hp):
                    p.data.copy_(master.data)
        super().finish_load(step)


class Zero12(MasterLayout):
    """ZeRO-1/2: each DP rank holds a flat fp32 partition per group; ``p._hp_mapping`` is this rank's piece
    of ``p`` (None when the piece is empty). The forward weights are whole on every rank: after a load each
    rank copies its partition into them and DeepSpeed all-gathers the rest (``update_lp_params``)."""

    name = "ZeRO-1/2 (DeepSpeedZeroOptimizer)"

    def prepare(self):
        for flat in self.opt.single_partition_of_fp32_groups:
            _adam_state(self.base, flat)
        # ZeRO-1/2 link the per-parameter views of Adam's state lazily, during the first step and after
        # stepping only the first group; link again so that every group's views are current.
        self.opt._hp_optimizer_states_linked = False
        self.opt._lazy_init_hp_params_optimizer_state()

    def full(self, p):
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        return {"": safe_get_full_fp32_param(p), **{m: safe_get_full_optimizer_state(p, m) for m in MOMENTS}}

    def owned(self, p):
        mapping = getattr(p, "_hp_mapping", None)
        if mapping is None:
            return []
        address = mapping.lp_fragment_address
        dest = {"": mapping.hp_fragment.view(-1), **{m: mapping.get_optim_state_fragment(m) for m in MOMENTS}}
        return [Owned(address.start, address.numel, dest)]

    def finish_load(self, step):
        self.opt.update_lp_params()
        super().finish_load(step)


class BF16Masters(Zero12):
    """bf16 with fp32 accumulation at ZeRO-0/1 (DeepSpeed's ``BF16_Optimizer``): as ZeRO-1/2, a flat fp32
    partition per group (``fp32_groups_flat_partition``) and each parameter's piece in ``_hp_mapping``. At
    ZeRO-0 its partition group is the rank alone (``patches.bf16_optimizer_without_zero``): every rank holds
    every master, as ``UnfusedMasters`` does."""

    name = "bf16 ZeRO-0/1 with fp32 accumulation (BF16_Optimizer)"

    def __init__(self, engine, error: type[Exception] = RuntimeError):
        super().__init__(engine, error)
        # ZeRO-0: partitioned over a group of its own, not the engine's replicas
        self.replicated = self.opt.dp_process_group is not engine.seq_data_parallel_group

    def prepare(self):
        for flat in self.opt.fp32_groups_flat_partition:
            _adam_state(self.base, flat)
        self.opt._hp_optimizer_states_linked = False
        self.opt._lazy_init_hp_params_optimizer_state()


class Zero3(MasterLayout):
    """ZeRO-3: every parameter is split evenly (padded) over DP; rank r holds flat elements
    ``[r * n, (r + 1) * n)`` of its fp32 master, moments and forward weights (``ds_tensor``)."""

    name = "ZeRO-3 (DeepSpeedZeroOptimizer_Stage3)"

    def prepare(self):
        for flat in self.opt.fp32_partitioned_groups_flat:
            _adam_state(self.base, flat)

    def full(self, p):
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        return {"": safe_get_full_fp32_param(p), **{m: safe_get_full_optimizer_state(p, m) for m in MOMENTS}}

    def _parts(self, p) -> tuple[dict[str, torch.Tensor], int, int]:
        parts = {
            k: self.opt._get_fp32_opt_state_partition(
                p, release_swap_buffers=False, optim_state_key=k or None
            )[0]
            for k in KEYS
        }
        start, numel = partition_span(p, self.opt._get_param_partition_rank(p))
        return parts, start, numel

    def pieces(self, p):
        parts, start, numel = self._parts(p)
        return [Owned(start, numel, {k: t.view(-1)[:numel] for k, t in parts.items()})] if numel else []

    def owned(self, p):
        parts, start, numel = self._parts(p)
        with torch.no_grad():
            for t in (*parts.values(), p.ds_tensor):
                t.view(-1)[numel:].zero_()  # DeepSpeed's padding
        dest = {k: t.view(-1)[:numel] for k, t in parts.items()}
        dest["lp"] = p.ds_tensor.view(-1)[:numel]  # the forward weights' partition, written directly
        return [Owned(start, numel, dest)]


def layout_of(engine, error: type[Exception] = RuntimeError) -> MasterLayout:
    """The master layout of ``engine``'s optimizer (a DeepSpeed engine, or the ``facade.Engine`` holding
    one); an unknown one is an ``error`` naming its type."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from .facade import Engine

    if isinstance(engine, Engine):
        engine = engine.deepspeed
    opt = engine.optimizer
    kinds = (
        (DeepSpeedZeroOptimizer_Stage3, Zero3),
        (DeepSpeedZeroOptimizer, Zero12),
        (BF16_Optimizer, BF16Masters),
        (FP16_UnfusedOptimizer, UnfusedMasters),
    )
    for cls, layout in kinds:
        if type(opt) is cls:
            return layout(engine, error)
    if type(opt).__module__.startswith("torch.optim"):
        return PlainAdam(engine, error)
    known = ", ".join([k.name for _, k in kinds] + [PlainAdam.name])
    raise error(
        f"universal checkpoint: unknown optimizer layout {type(opt).__module__}.{type(opt).__qualname__} "
        f"(known: {known}); its fp32 master weights and Adam moments cannot be located"
    )
