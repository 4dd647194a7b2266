"""The checkpoint's model + optimizer state, written once, each rank its own share; read on any layout.

Format 2 (this release). Inside each checkpoint, ``universal/rank<R>.safetensors`` is written by global
rank R and holds only what R holds: for each parameter, the flat range of its TP-local tensor that R's
optimizer partition owns, for the fp32 master and Adam's ``exp_avg`` / ``exp_avg_sq`` (read from wherever
DeepSpeed keeps them, ``engine.masters``: never the bf16 forward weights). No rank gathers anything: under
ZeRO-1/2/3 the partitions are disjoint over data x context parallelism; without ZeRO every replica holds
the whole TP slice, so each writes an even 1/(dp x cp) of every parameter's flat range. The TP slices of
parameters that TP does not split (norms, the GOAT prior) are written by every TP rank (each its own, so
a same-layout resume restores every rank's exact values; they are a small part of the state).

``universal/meta.json`` (rank 0, after gathering the small piece lists) records how each parameter is
split across TP ranks (megatron's ``partition_dim`` / ``partition_stride``) and its TP-local shape, which
file holds which flat range of which (parameter, TP rank), and the optimizer counters a bitwise resume
needs: Adam's step, the LR schedule's step and DeepSpeed's step counters (a dropped non-finite step moves
the trainer's step but none of these). The RNG states are ``rng_rank<R>.pt`` beside (``manager.py``).
No loss-scaler state exists: the precisions are fp32 and bf16, neither scales the loss.

Why not ``torch.distributed.checkpoint`` (DCP): DCP describes a shard as a rectangle of a global tensor
(offsets and sizes per dimension), while a DeepSpeed ZeRO partition is a flat range of a TP-local tensor:
it starts and ends inside rows, and under a strided TP split (fused QKV, SwiGLU's two halves) a TP slice is
itself several blocks of the global tensor. Declaring each (parameter, TP rank) as its own 1-D tensor
would map, but then resharding across TP is ours anyway, and DCP's ``.metadata`` is a pickle, read back
with ``pickle.load``: loading a checkpoint would execute whatever it holds. Safetensors files plus one JSON
index keep loading free of code execution and map each flat range to one slice read.

Loading (``slices.py``) is sliced: each rank reads only the flat ranges of its own (new-layout) tensors
that its optimizer partition holds; on the layout that saved it, that is exactly its own file. Format 1
(``universal/tp<R>.safetensors``, one file per TP rank with whole TP-local tensors, beside DeepSpeed's own
shards) is read the same way, as one piece per tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from .. import collectives
from ..atomic import atomic_write_text
from ..engine.masters import KEYS, MOMENTS
from ..engine.masters import layout_of as engine_layout_of
from ..engine.steps import set_step_counters, step_counters
from ..engine.zero3 import full_shape
from . import tensor_file
from .errors import CheckpointError
from .slices import UniversalReader, tensor_key

__all__ = [
    "FORMAT",
    "MOMENTS",
    "ModelMismatch",
    "load",
    "merge",
    "mismatches",
    "read_full",
    "require_state",
    "save",
    "split",
    "split_meta",
]

FORMAT = 2


def layout_of(engine):
    """The engine's master layout (``goat_dist.engine.masters``); one it cannot read is a CheckpointError."""
    return engine_layout_of(engine, CheckpointError)


def require_state(step_dir: Path, purpose: str) -> None:
    """A CheckpointError unless ``step_dir`` has a universal state: a checkpoint without one is format 0
    (DeepSpeed's own shards only, saved with ``checkpoint.universal=false`` by an earlier release)."""
    if not (Path(step_dir) / "universal" / "meta.json").is_file():
        raise CheckpointError(
            f"checkpoint {step_dir} has no universal/ state: it is a format-0 checkpoint (DeepSpeed's own "
            "shards only, saved with checkpoint.universal=false by an earlier goat-dist). This release reads "
            f"formats 1 and 2 and cannot {purpose}. Resume it once with the release that wrote it and "
            "checkpoint.universal=true, save, then continue with this one"
        )


def split_meta(p) -> dict:
    return {
        "tp_split": bool(getattr(p, "tensor_model_parallel", False)),
        "dim": int(getattr(p, "partition_dim", 0)),
        "stride": int(getattr(p, "partition_stride", 1)),
    }


def file_name(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def _replica() -> tuple[int, int]:
    """(index, count) of this rank among the ranks holding the same TP slice (data x context parallel)."""
    return (
        parallel_state.get_data_parallel_rank(with_context_parallel=True),
        parallel_state.get_data_parallel_world_size(with_context_parallel=True),
    )


def _share(start: int, numel: int, index: int, count: int) -> tuple[int, int]:
    """Replica ``index`` of ``count``'s even part of the flat range ``[start, start + numel)``."""
    lo, hi = numel * index // count, numel * (index + 1) // count
    return start + lo, hi - lo


def own_pieces(engine, model) -> tuple[list[tuple[str, int, int, dict]], dict, object]:
    """What this rank writes: ``[(name, start, numel, {key: 1-D live tensor})]``, the parameters' meta
    (split and TP-local shape) and the master layout. Nothing is copied or communicated."""
    masters = layout_of(engine)
    masters.prepare()
    index, count = _replica() if masters.replicated else (0, 1)
    pieces, params = [], {}
    for name, p in model.named_parameters():
        shape = full_shape(p)  # ZeRO-3: the shape before partitioning
        params[name] = {**split_meta(p), "shape": shape}
        for owned in masters.pieces(p):
            start, numel = _share(owned.start, owned.numel, index, count)
            if numel > 0:
                lo = start - owned.start
                pieces.append((name, start, numel, {k: owned.dest[k][lo : lo + numel] for k in KEYS}))
    return pieces, params, masters


def _entries(pieces, to_host) -> list[tensor_file.Entry]:
    return [
        tensor_file.Entry(tensor_key(name, key), torch.float32, [numel], lambda t=t: to_host(t))
        for name, _, numel, dest in pieces
        for key, t in dest.items()
    ]


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float()


def _record(engine, masters, step: int, params: dict, gathered: list) -> dict:
    files, table = [], {name: [] for name in params}
    for i, part in enumerate(gathered):
        files.append(part["file"])
        for name, start, numel in part["pieces"]:
            table[name].append([part["tp"], start, numel, i])
    scheduler = engine.lr_scheduler
    return {
        "format": FORMAT,
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "step": step,
        "optimizer": masters.name,
        "adam_step": masters.adam_step(),
        "lr_step": None if scheduler is None else int(scheduler.last_epoch),
        "engine": step_counters(engine),
        "params": params,
        "files": files,
        "pieces": table,
    }


def save(engine, model, step_dir: Path, step: int, to_host=_fp32, submit=None) -> dict[str, dict]:
    """Collective: every rank writes its own share to ``universal/rank<R>.safetensors``; rank 0 writes
    ``meta.json``. Returns ``{relative name: {bytes, sha256}}`` of the file this rank wrote (hashed as
    written). An asynchronous save passes ``to_host`` (a host copy in staging buffers, made now) and
    ``submit(path, write)`` (queue the write on the background thread, which records the digest)."""
    rank = dist.get_rank()
    out = Path(step_dir) / "universal"
    out.mkdir(parents=True, exist_ok=True)
    pieces, params, masters = own_pieces(engine, model)
    mine = {
        "file": file_name(rank),
        "tp": parallel_state.get_tensor_model_parallel_rank(),
        "pieces": [(name, start, numel) for name, start, numel, _ in pieces],
    }
    gathered = collectives.gather_object(mine, dst=0)
    if rank == 0:
        record = _record(engine, masters, step, params, gathered)
        atomic_write_text(out / "meta.json", json.dumps(record, separators=(",", ":")))
    path = out / file_name(rank)
    meta = {"format": str(FORMAT), "rank": str(rank), "step": str(step)}
    if submit is None:  # synchronous: one tensor on the host at a time
        return {f"universal/{path.name}": tensor_file.write(path, _entries(pieces, to_host), meta)}
    staged = [
        (name, start, numel, {k: to_host(t) for k, t in dest.items()}) for name, start, numel, dest in pieces
    ]
    submit(path, lambda dest: tensor_file.write(dest, _entries(staged, lambda t: t), meta))
    return {}


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
    mismatched = mismatches(reader, model)
    if mismatched:  # before anything is copied; the same on every rank (same model, same checkpoint)
        raise ModelMismatch(mismatched, step_dir)
    masters = layout_of(engine)
    masters.prepare()
    with torch.no_grad():
        for name, p in model.named_parameters():
            for owned in masters.owned(p):
                for key in keys:
                    piece = reader.read_flat(name, key, owned.start, owned.numel)
                    owned.dest[key].copy_(piece)
                    if not key and "lp" in owned.dest:
                        owned.dest["lp"].copy_(piece)
                    del piece
    meta = reader.meta
    if adam_step is None:  # a resume: the saved counters (older checkpoints: the trainer's step)
        saved = meta.get("adam_step")
        adam_step = step if saved is None else saved
        set_step_counters(engine, meta.get("engine", {}))
    masters.finish_load(adam_step)
    if schedule:
        lr_step = meta.get("lr_step")
        _set_schedule(engine.lr_scheduler, step if lr_step is None else int(lr_step))


class ModelMismatch(CheckpointError):
    """The checkpoint's tensors are not this model's: ``problems`` names each (missing, extra, or another
    shape). The callers that know the run's config rephrase it as the config keys that changed
    (``compat.model_change``)."""

    def __init__(self, problems: list[str], step_dir: Path):
        self.problems = problems
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        super().__init__(f"{step_dir}: its tensors are not this model's ({shown}); the model sections differ")


def mismatches(reader: UniversalReader, model) -> list[str]:
    """What keeps the checkpoint from filling ``model`` exactly: a parameter it lacks, one the model lacks
    (it would be dropped silently), or a saved tensor whose slice for this layout has another shape."""
    problems = []
    saved = set(reader.meta["params"])
    for name, p in model.named_parameters():
        if name not in saved:
            problems.append(f"no parameter {name} in the checkpoint")
            continue
        saved.discard(name)
        want = full_shape(p)  # ZeRO-3: the shape before partitioning
        got = reader.local_shape(name)
        if got != want:
            problems.append(f"{name} has shape {got} there (this TP rank's slice) but {want} here")
    problems += [f"{name} is in the checkpoint but not in this model" for name in sorted(saved)]
    return problems


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
    reader = UniversalReader(step_dir, 1, 0)
    meta = reader.meta
    out = {}
    for name, m in meta["params"].items():
        out[name] = {
            key: merge([reader.saved_local(r, name, key) for r in range(reader.saved_tp)], m) for key in keys
        }
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
