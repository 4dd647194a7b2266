"""Layout-independent model + optimizer state: what lets a run resume on another TP / DP / ZeRO layout
and what ``goat-dist ckpt export`` reads.

Inside each checkpoint, ``universal/tp<R>.safetensors`` (written by the data-parallel rank 0 of every
tensor-parallel rank R) holds, per parameter, this TP rank's slice gathered over data parallelism: the
fp32 value and Adam's ``exp_avg`` / ``exp_avg_sq``. ``universal/meta.json`` records how each parameter
is split across TP ranks (megatron's ``partition_dim`` / ``partition_stride``), so a loader can merge the
slices and re-split them for any TP size.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from deepspeed.utils import (
    safe_get_full_fp32_param,
    safe_get_full_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_optimizer_state,
)
from megatron.core import parallel_state
from safetensors import safe_open
from safetensors.torch import save_file

from ..atomic import atomic_write_text

MOMENTS = ("exp_avg", "exp_avg_sq")


def _managed_by_deepspeed(p) -> bool:
    return hasattr(p, "ds_id") or hasattr(p, "_hp_mapping")


def _base_optimizer(engine):
    opt = engine.optimizer
    return getattr(opt, "optimizer", opt)


def relink_optimizer_state(engine) -> None:
    """Point DeepSpeed's per-parameter optimizer-state views at the current Adam state.

    ZeRO-1/2 link them lazily during the first step, after stepping only the first parameter group, so
    later groups (norms, GOAT priors) stay linked to empty state; linking again fixes every group."""
    opt = engine.optimizer
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state") and hasattr(opt, "_hp_optimizer_states_linked"):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()


def _ensure_optimizer_state(engine) -> None:
    """Adam creates its state on the first step; a freshly built engine about to receive a checkpoint's
    moments has none yet. Create it (zeros) for the flat fp32 partitions DeepSpeed steps."""
    opt = engine.optimizer
    base = _base_optimizer(engine)
    flats = []
    for attr in (
        "fp32_partitioned_groups_flat",
        "single_partition_of_fp32_groups",
        "fp32_groups_flat_partition",
    ):
        flats = list(getattr(opt, attr, None) or [])
        if flats:
            break
    for flat in flats:
        state = base.state[flat]
        if "exp_avg" not in state:
            state.update(
                step=torch.tensor(0.0), exp_avg=torch.zeros_like(flat), exp_avg_sq=torch.zeros_like(flat)
            )


def _full_dp_states(engine, p) -> dict[str, torch.Tensor]:
    """This TP rank's fp32 value and Adam moments of ``p``, whole over DP. Collective over DP under ZeRO."""
    if _managed_by_deepspeed(p):
        out = {"": safe_get_full_fp32_param(p)}
        out.update({m: safe_get_full_optimizer_state(p, m) for m in MOMENTS})
    else:  # ZeRO-0 in fp32: the parameter is its own master copy, the torch optimizer holds the moments
        state = _base_optimizer(engine).state.get(p, {})
        out = {"": p.detach()}
        out.update({m: state.get(m, torch.zeros_like(p)) for m in MOMENTS})
    return {k: v.detach().float().cpu().contiguous() for k, v in out.items()}


def split_meta(p) -> dict:
    return {
        "tp_split": bool(getattr(p, "tensor_model_parallel", False)),
        "dim": int(getattr(p, "partition_dim", 0)),
        "stride": int(getattr(p, "partition_stride", 1)),
    }


def save(engine, model, step_dir: Path, step: int) -> None:
    """Collective: every rank calls it."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    writer = parallel_state.get_data_parallel_rank() == 0
    relink_optimizer_state(engine)
    tensors, meta = {}, {}
    for name, p in model.named_parameters():
        states = _full_dp_states(engine, p)
        meta[name] = split_meta(p)
        if writer:
            for key, value in states.items():
                tensors[f"{name}::{key}" if key else name] = value
    out = Path(step_dir) / "universal"
    if writer:
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / f"tp{tp_rank:02d}.safetensors"))
    if dist.get_rank() == 0:
        tp = parallel_state.get_tensor_model_parallel_world_size()
        atomic_write_text(out / "meta.json", json.dumps({"tp": tp, "step": step, "params": meta}, indent=1))


# ---- merging and re-splitting ------------------------------------------------------------------------
def merge(parts: list[torch.Tensor], meta: dict) -> torch.Tensor:
    if not meta["tp_split"] or len(parts) == 1:
        return parts[0]
    dim, stride = meta["dim"], meta["stride"]
    chunks = [p.chunk(stride, dim=dim) for p in parts]
    return torch.cat([chunks[r][s] for s in range(stride) for r in range(len(parts))], dim=dim)


def split(full: torch.Tensor, meta: dict, tp: int, rank: int) -> torch.Tensor:
    if not meta["tp_split"] or tp == 1:
        return full
    dim, stride = meta["dim"], meta["stride"]
    return torch.cat([c.chunk(tp, dim=dim)[rank] for c in full.chunk(stride, dim=dim)], dim=dim)


def read_full(
    step_dir: Path, keys: tuple[str, ...] = ("",)
) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
    """Every parameter whole (TP merged), per key ("" = value, or a moment): ({name: {key: tensor}}, meta)."""
    udir = Path(step_dir) / "universal"
    meta = json.loads((udir / "meta.json").read_text())
    files = [safe_open(str(udir / f"tp{r:02d}.safetensors"), framework="pt") for r in range(meta["tp"])]
    out = {}
    for name, m in meta["params"].items():
        out[name] = {
            key: merge([f.get_tensor(f"{name}::{key}" if key else name) for f in files], m) for key in keys
        }
    return out, meta


def load(engine, model, step_dir: Path, step: int) -> None:
    """Collective: set every rank's parameters and Adam state from a checkpoint of any layout."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    full, meta = read_full(step_dir, ("", *MOMENTS))
    _ensure_optimizer_state(engine)
    relink_optimizer_state(engine)
    base = _base_optimizer(engine)
    for name, p in model.named_parameters():
        if name not in full:
            raise KeyError(f"{step_dir}: universal state has no parameter {name}")
        local = {k: split(v, meta["params"][name], tp, tp_rank) for k, v in full[name].items()}
        value = local[""]
        if hasattr(p, "ds_id"):
            for key, tensor in local.items():
                _set_zero3_partition(engine.optimizer, p, tensor, key or None)
            _set_low_precision_copy(p, value)
        elif _managed_by_deepspeed(p):
            safe_set_full_fp32_param(p, value)
            for m in MOMENTS:
                safe_set_full_optimizer_state(p, local[m], m)
            _set_low_precision_copy(p, value)
        else:
            with torch.no_grad():
                p.copy_(value)
            base.state[p] = {"step": torch.tensor(float(step)), **{m: local[m].clone() for m in MOMENTS}}
    for state in base.state.values():  # Adam's bias correction continues from the saved step
        if "step" in state:
            state["step"] = torch.full_like(torch.as_tensor(state["step"]), float(step))
    _set_schedule(engine.lr_scheduler, step)


def _set_zero3_partition(opt, p, value: torch.Tensor, key: str | None) -> None:
    """This rank's slice of a ZeRO-3 fp32 value or moment. DeepSpeed's own setter mis-slices parameters
    smaller than the data-parallel size (its partitions are padded); this pads the same way."""
    part, _ = opt._get_fp32_opt_state_partition(p, release_swap_buffers=False, optim_state_key=key)
    start = part.numel() * opt._get_param_partition_rank(p)
    piece = value.flatten()[start : start + part.numel()]
    with torch.no_grad():
        part.zero_()
        part[: piece.numel()].copy_(piece)


def _set_low_precision_copy(p, value: torch.Tensor) -> None:
    """DeepSpeed's setters change the fp32 master only; the weights the forward pass uses follow here."""
    with torch.no_grad():
        if hasattr(p, "ds_id"):  # ZeRO-3: this rank's flat partition of the parameter
            part = p.ds_tensor
            flat = value.flatten()
            start = part.numel() * dist.get_rank(group=parallel_state.get_data_parallel_group())
            piece = flat[start : start + part.numel()]
            part.view(-1)[: piece.numel()].copy_(piece.to(part.dtype))
        else:
            p.copy_(value.to(p.dtype))


def _set_schedule(scheduler, step: int) -> None:
    """Put a LambdaLR where ``step`` optimizer steps would have left it."""
    if scheduler is None:
        return
    scheduler.last_epoch = step
    scheduler._step_count = step + 1
    lrs = [base * fn(step) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs
