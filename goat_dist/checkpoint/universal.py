"""Layout-independent model + optimizer state: what lets a run resume on another TP / DP / ZeRO layout or
precision, and what ``goat-dist ckpt export`` reads.

Inside each checkpoint, ``universal/tp<R>.safetensors`` (written by the data-parallel rank 0 of every
tensor-parallel rank R) holds, per parameter, this TP rank's slice gathered over data parallelism: the
fp32 master value and Adam's ``exp_avg`` / ``exp_avg_sq``, read from wherever DeepSpeed keeps them
(``masters.py``: never the bf16 forward weights). ``universal/meta.json`` records how each parameter is
split across TP ranks (megatron's ``partition_dim`` / ``partition_stride``), so a loader can re-split the
slices for any TP size.

Loading is sliced (``slices.py``): each rank reads only the flat ranges of its own (new-layout) tensors
that its optimizer partition holds, so the extra host memory of a resume is about the rank's share of the
checkpoint, not the whole merged model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors import safe_open
from safetensors.torch import save_file

from ..atomic import atomic_write_text
from .masters import KEYS, MOMENTS, layout_of
from .slices import UniversalReader, tensor_key

__all__ = ["MOMENTS", "load", "merge", "read_full", "save", "split", "split_meta"]


def split_meta(p) -> dict:
    return {
        "tp_split": bool(getattr(p, "tensor_model_parallel", False)),
        "dim": int(getattr(p, "partition_dim", 0)),
        "stride": int(getattr(p, "partition_stride", 1)),
    }


def _to_host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().cpu().contiguous()


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(path))


def save(engine, model, step_dir: Path, step: int, to_host=_to_host, write=_write) -> None:
    """Collective: every rank calls it. ``to_host`` (a gathered tensor -> its fp32 host copy) and ``write``
    (path, tensors) are where an asynchronous save stages and defers the file (``staging.py``)."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    writer = parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0  # one per TP rank
    masters = layout_of(engine)
    masters.prepare()
    tensors, meta = {}, {}
    for name, p in model.named_parameters():
        states = masters.full(p)  # collective over DP under ZeRO
        meta[name] = split_meta(p)
        if writer:
            for key, value in states.items():
                tensors[tensor_key(name, key)] = to_host(value)
    out = Path(step_dir) / "universal"
    if writer:
        out.mkdir(parents=True, exist_ok=True)
        write(out / f"tp{tp_rank:02d}.safetensors", tensors)
    if dist.get_rank() == 0:
        tp = parallel_state.get_tensor_model_parallel_world_size()
        record = {"tp": tp, "step": step, "optimizer": masters.name, "params": meta}
        atomic_write_text(out / "meta.json", json.dumps(record, indent=1))


def load(
    engine,
    model,
    step_dir: Path,
    step: int,
    keys: tuple[str, ...] = KEYS,
    adam_step: int | None = None,
    schedule: bool = True,
) -> None:
    """Collective: set every rank's fp32 masters, Adam moments and forward weights from a checkpoint of any
    layout, reading only the ranges this rank holds.

    A new run from another run's weights (``train.init_from``) reads ``keys`` ("" alone: weights only,
    Adam starts empty), sets Adam's step counter to ``adam_step`` and keeps its own LR schedule
    (``schedule=False``)."""
    reader = UniversalReader(
        step_dir,
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_rank(),
    )
    masters = layout_of(engine)
    masters.prepare()
    with torch.no_grad():
        for name, p in model.named_parameters():
            reader.split_of(name)  # a parameter the checkpoint lacks is an error naming it
            _check_shape(reader, name, p, step_dir)
            for owned in masters.owned(p):
                for key in keys:
                    piece = reader.read_flat(name, key, owned.start, owned.numel)
                    owned.dest[key].copy_(piece)
                    if not key and "lp" in owned.dest:
                        owned.dest["lp"].copy_(piece)
                    del piece
    masters.finish_load(step if adam_step is None else adam_step)
    if schedule:
        _set_schedule(engine.lr_scheduler, step)


def _check_shape(reader: UniversalReader, name: str, p, step_dir: Path) -> None:
    """The saved tensor, split for this layout, must have the parameter's (TP-local) shape: another
    model.* section (or a learned position table of another model.seq_len) is an error naming it."""
    from .errors import CheckpointError

    want = list(getattr(p, "ds_shape", None) or p.shape)  # ZeRO-3: the shape before partitioning
    got = reader.local_shape(name)
    if got != want:
        raise CheckpointError(
            f"{step_dir}: parameter {name} has shape {got} there (this TP rank's slice) but {want} in this "
            "model; the model sections differ"
        )


# ---- merging and re-splitting (whole tensors: export, tests) -------------------------------------------
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
    """Every parameter whole (TP merged), per key ("" = value, or a moment): ({name: {key: tensor}}, meta).
    For one-process tools (export); a training rank reads its slices through ``slices.UniversalReader``."""
    udir = Path(step_dir) / "universal"
    meta = json.loads((udir / "meta.json").read_text())
    files = [safe_open(str(udir / f"tp{r:02d}.safetensors"), framework="pt") for r in range(meta["tp"])]
    out = {}
    for name, m in meta["params"].items():
        out[name] = {key: merge([f.get_tensor(tensor_key(name, key)) for f in files], m) for key in keys}
    return out, meta


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
