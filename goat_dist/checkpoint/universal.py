"""The checkpoint's model + optimizer state, written once, each rank its own share; read on any layout.

Format 3 (this release; format 2 with the index's rules below). Inside each checkpoint,
``universal/rank<R>.safetensors`` is written by global rank R and holds only what R holds: for each parameter,
the flat range of its TP-local tensor that R's optimizer partition owns, for the fp32 master and Adam's
``exp_avg`` / ``exp_avg_sq`` (read from wherever DeepSpeed keeps them, ``engine.masters``: never the bf16
forward weights). No rank gathers anything: under ZeRO-1/2/3 the partitions are disjoint over data x context
parallelism; without ZeRO every replica holds the whole TP slice, so each writes an even 1/(dp x cp) of every
parameter's flat range. The TP slices of parameters that TP does not split (norms, the GOAT prior) are written
by every TP rank (each its own, so a same-layout resume restores every rank's exact values; they are a small
part of the state).

``universal/index.json`` (rank 0, once the ranks agreed on its rules with three small all-reduces: no rank's
piece list is gathered; ``index.py``) records how each parameter is
split across TP ranks (megatron's ``partition_dim`` / ``partition_stride``) and its TP-local shape, how
the saved ranks cut each (parameter, TP rank) into pieces (a rule: ZeRO-3's ``even``, the replicated
layouts' ``share``, ZeRO-1/2's ``flat``; a list only where none fits) and which file holds each piece
(``grid``: a rule too, ``tp_inner``; ``slices.py``), and the optimizer counters a bitwise resume needs:
Adam's step, the LR schedule's step and DeepSpeed's step counters (a dropped non-finite step moves the
trainer's step but none of these). It is O(parameters), the same at any world size: at 30B, 128 KB on
64 or 512 ranks (format 2 listed the files, grid and ZeRO-1/2's pieces: 142 KB under ZeRO-3 and 159 KB
under ZeRO-1 at 512, +27 and +55 bytes a rank). Earlier releases also wrote
``universal/meta.json``, the same with every piece listed (O(parameters x ranks): 4.4 MB at 30B on 512
ranks, written by rank 0 inside every save's pause); none is written now, and a checkpoint that has only
``meta.json`` (format 2 before the index, format 1) is still read through it. Each file carries block
checksums (``tensor_file``), so a rank can check the part of a file it reads; the manifest records each
file's header digest. The RNG states are ``rng_rank<R>.pt`` beside (``manager.py``). No loss-scaler state
exists: the precisions are fp32 and bf16, neither scales the loss.

Why not ``torch.distributed.checkpoint`` (DCP): DCP describes a shard as a rectangle of a global tensor
(offsets and sizes per dimension), while a DeepSpeed ZeRO partition is a flat range of a TP-local tensor:
it starts and ends inside rows, and under a strided TP split (fused QKV, SwiGLU's two halves) a TP slice is
itself several blocks of the global tensor. Declaring each (parameter, TP rank) as its own 1-D tensor
would map, but then resharding across TP is ours anyway, and DCP's ``.metadata`` is a pickle, read back
with ``pickle.load``: loading a checkpoint would execute whatever it holds. Safetensors files plus one JSON
index keep loading free of code execution and map each flat range to one slice read.

Loading (``slices.py``) is sliced: each rank reads only the flat ranges of its own (new-layout) tensors
that its optimizer partition holds, each file it needs opened once; on the layout that saved it, that is
exactly its own file. Format 1 (``universal/tp<R>.safetensors``, one file per TP rank with whole TP-local
tensors, beside DeepSpeed's own shards) and format 2 without ``index.json`` are read the same way.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from .. import collectives
from ..engine.masters import KEYS, MOMENTS, Zero3
from ..engine.zero3 import full_shape
from . import tensor_file
from .digests import any_rank, gather, raise_everywhere, reduce
from .errors import CheckpointError
from .exchange import Exchange
from .index import FORMAT, INDEX, file_name, write_index, write_rules
from .index import agree as agree_rules
from .index import share as _share
from .slices import META, UniversalReader, tensor_key

__all__ = [
    "FORMAT",
    "MOMENTS",
    "ModelMismatch",
    "exchange_into",
    "load",
    "merge",
    "mismatches",
    "read_full",
    "read_into",
    "require_state",
    "save",
    "split",
    "split_meta",
    "write_index",
    "write_share",
]


def layout_of(engine):
    """The master layout of ``engine`` (a ``goat_dist.engine.Engine``); one it cannot read is a
    CheckpointError."""
    return engine.masters(CheckpointError)


def require_state(step_dir: Path, purpose: str, manifest: dict | None = None) -> None:
    """A CheckpointError unless ``step_dir`` has a universal state: a checkpoint without one is format 0
    (DeepSpeed's own shards only, saved with ``checkpoint.universal=false`` by an earlier release). With
    its ``manifest``, asked of the manifest (no file is stat'ed)."""
    if manifest is not None:
        has = any(f"universal/{name}" in manifest["files"] for name in (META, INDEX))
    else:
        has = any((Path(step_dir) / "universal" / name).is_file() for name in (INDEX, META))
    if not has:
        raise CheckpointError(
            f"checkpoint {step_dir} has no universal/ state: it is a format-0 checkpoint (DeepSpeed's own "
            "shards only, saved with checkpoint.universal=false by an earlier goat-dist). This release reads "
            f"formats 1 to 3 and cannot {purpose}. Resume it once with the release that wrote it and "
            "checkpoint.universal=true, save, then continue with this one"
        )


def split_meta(p) -> dict:
    return {
        "tp_split": bool(getattr(p, "tensor_model_parallel", False)),
        "dim": int(getattr(p, "partition_dim", 0)),
        "stride": int(getattr(p, "partition_stride", 1)),
    }


def _replica(model) -> tuple[int, int]:
    """(index, count) of this rank among the ranks holding the same TP slice (data x context parallel),
    from the model's ``layout``."""
    layout = model.layout
    return layout.replica_rank, layout.replicas


def own_pieces(engine, model) -> tuple[list[tuple[str, int, int, dict]], dict, object]:
    """What this rank writes: ``[(name, start, numel, {key: 1-D live tensor})]``, the parameters' meta
    (split and TP-local shape) and the master layout; the replicas' shares by the model's ``layout``.
    Nothing is copied or communicated."""
    masters = layout_of(engine)
    masters.prepare()
    index, count = _replica(model) if masters.replicated else (0, 1)
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


ROW_BLOCK_MIN = 48  # elements: the least an aligned checksum block of a row-parallel tensor holds
ROW_PARTS = 8  # ... and a row has at most this many: the largest TP a column read is exact for


def row_block(row: int) -> int:
    """Elements per checksum block of a row-parallel tensor whose rows are ``row`` long: ``row / parts``
    for the most parts (a power of two, <= ``ROW_PARTS``) that leaves blocks of ``ROW_BLOCK_MIN``
    elements, so that the column ranges a TP of up to ``parts`` takes from a row are whole blocks
    (``tensor_file``'s aligned blocks; ``slices.py``); the checksums cost 4 bytes a block (<= 2 % of the
    data on the smallest rows, 0.04 % on the 30B config's fc2)."""
    parts = ROW_PARTS
    while parts > 1 and (row % parts or row // parts < ROW_BLOCK_MIN):
        parts //= 2
    return row // parts


def checksum_blocks(params: dict) -> dict[str, int]:
    """{name: elements per aligned checksum block} of the parameters whose pieces another TP reads as
    column ranges (split along dim 1 of a 2-D TP-local tensor, ``shape``: the row-parallel weights)."""
    return {
        name: row_block(m["shape"][1])
        for name, m in params.items()
        if m["tp_split"] and m["dim"] == 1 and len(m["shape"]) == 2
    }


def _entries(pieces, to_host, blocks: dict[str, int] | None = None) -> list[tensor_file.Entry]:
    blocks = blocks or {}
    return [
        tensor_file.Entry(
            tensor_key(name, key),
            torch.float32,
            [numel],
            lambda t=t: to_host(t),
            block=blocks.get(name, 0),
            phase=start % blocks[name] if name in blocks else 0,
        )
        for name, start, numel, dest in pieces
        for key, t in dest.items()
    ]


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float()


def counters(engine, masters, step: int) -> dict:
    """What a bitwise resume restores besides the tensors: the steps of Adam, the LR schedule, DeepSpeed."""
    scheduler = engine.scheduler
    return {
        "step": step,
        "optimizer": masters.name,
        "adam_step": masters.adam_step(),
        "lr_step": None if scheduler is None else int(scheduler.last_epoch),
        "engine": engine.step_counters(),
    }


def write_share(path: Path, pieces, rank: int, step: int, to_host=_fp32, params: dict | None = None) -> dict:
    """Write one rank's pieces (``own_pieces``) to ``path``, one tensor on the host at a time, with block
    checksums (aligned to the rows of the row-parallel ones among ``params``, the parameters' meta:
    ``checksum_blocks``); returns its digests (``tensor_file.write``)."""
    meta = {"format": str(FORMAT), "rank": str(rank), "step": str(step)}
    blocks = checksum_blocks(params) if params else None
    return tensor_file.write(path, _entries(pieces, to_host, blocks), meta, checksums=True)


def save(engine, model, step_dir: Path, step: int, to_host=_fp32, submit=None) -> dict[str, dict]:
    """Collective: every rank writes its own share to ``universal/rank<R>.safetensors`` (its TP rank and
    replica index from the model's ``layout``); rank 0 writes ``index.json``. Returns
    ``{relative name: {bytes, sha256, header_sha256}}`` of the file this rank wrote (hashed as written). An
    asynchronous save passes ``to_host`` (a host copy in staging buffers, made now) and
    ``submit(path, write)`` (queue the write on the background thread, which records the digest)."""
    rank = dist.get_rank()
    out = Path(step_dir) / "universal"
    out.mkdir(parents=True, exist_ok=True)
    pieces, params, masters = own_pieces(engine, model)
    layout = model.layout
    held = [(name, start, numel) for name, start, numel, _ in pieces]
    replica, replicas = _replica(model)
    placed = rank == replica * layout.tp + layout.tp_rank and dist.get_world_size() == layout.tp * replicas
    rules = agree_rules(params, held, replica, replicas, placed, reduce)  # no rank's list gathered
    if rules is None:  # a layout the rules do not give: rank 0 gathers the lists (index.py)
        mine = {"file": file_name(rank), "tp": layout.tp_rank, "replica": replica, "pieces": held}
        gathered = collectives.gather_object(mine, dst=0)
        if rank == 0:
            write_index(out, params, gathered, layout.tp, counters(engine, masters, step))
    elif rank == 0:
        write_rules(out, params, rules, layout.tp, replicas, counters(engine, masters, step))
    path = out / file_name(rank)
    if submit is None:  # synchronous: one tensor on the host at a time
        return {f"universal/{path.name}": write_share(path, pieces, rank, step, to_host, params)}
    staged = [
        (name, start, numel, {k: to_host(t) for k, t in dest.items()}) for name, start, numel, dest in pieces
    ]
    submit(path, lambda dest: write_share(dest, staged, rank, step, lambda t: t, params))
    return {}


def load(
    engine,
    model,
    step_dir: Path,
    step: int,
    keys: tuple[str, ...] = KEYS,
    adam_step: int | None = None,
    schedule: bool = True,
    manifest: dict | None = None,
) -> None:
    """Collective: set every rank's fp32 masters, Adam moments and forward weights from a checkpoint of any
    layout, reading only the ranges this rank holds (of its TP slice, by the model's ``layout``), each file
    it needs opened once and checked as read against ``manifest`` (the checkpoint's, read by the caller;
    ``slices.py``). A problem on any rank (a corrupt file, another model) is raised on every rank before
    any rank goes on to a collective.

    A new run from another run's weights (``train.init_from``) reads ``keys`` ("" alone: weights only,
    Adam starts empty), sets Adam's step counter to ``adam_step`` and keeps its own LR schedule
    (``schedule=False``)."""
    masters = layout_of(engine)
    masters.prepare()
    layout = model.layout
    reader, problem, mismatched, owned = None, "", [], []
    files: tuple[int, int | None] = (0, None)
    try:
        reader = UniversalReader(step_dir, layout.tp, layout.tp_rank, manifest)
        mismatched = mismatches(reader, model)
        if not mismatched:
            owned = [(name, o) for name, p in model.named_parameters() for o in masters.owned(p)]
            files = _files_to_open(reader, owned, layout, masters.replicated)
    except CheckpointError as e:
        problem = str(e)
    by_file = _agree(
        step_dir, problem, mismatched, files, reader is not None and _stage_change(reader, masters)
    )
    try:
        if by_file:
            assert reader is not None  # else _agree raised the reader's problem
            exchange_into(
                reader, owned, keys, layout.replica_rank, layout.replicas, _swapper(layout.replica_group)
            )
        else:
            read_into(reader, owned, keys)
    except CheckpointError as e:
        problem = str(e)
    finally:
        reader.close()
    raise_everywhere(problem)
    meta = reader.meta
    if adam_step is None:  # a resume: the saved counters (older checkpoints: the trainer's step)
        saved = meta.get("adam_step")
        adam_step = step if saved is None else saved
        engine.set_step_counters(meta.get("engine", {}))
    masters.finish_load(adam_step)
    if schedule:
        lr_step = meta.get("lr_step")
        _set_schedule(engine.scheduler, step if lr_step is None else int(lr_step))


def read_into(reader: UniversalReader, owned, keys: tuple[str, ...] = KEYS) -> None:
    """Copy each ``(name, Owned)`` range of ``owned`` from the checkpoint into its destinations, one range
    on the host at a time (no collective: a simulated rank runs it as a real one does)."""
    with torch.no_grad():
        for name, o in owned:
            for key in keys:
                piece = reader.read_flat(name, key, o.start, o.numel)
                o.dest[key].copy_(piece)
                if not key and "lp" in o.dest:
                    o.dest["lp"].copy_(piece)
                del piece


def _files_to_open(reader: UniversalReader, owned, layout, replicated: bool) -> tuple[int, int | None]:
    """(files a direct read of ``owned`` opens, files a read by file opens: None where it cannot be
    read so: another TP size, an index without a grid, a replicated layout, which needs every file of
    its TP rank anyway, or no all-to-all to route the elements)."""
    direct = reader.files_for([(name, o.start, o.numel) for name, o in owned])
    if replicated or not reader.can_exchange():
        return direct, None
    return direct, len(Exchange(reader, layout.replica_rank, layout.replicas).assignment())


def _stage_change(reader: UniversalReader, masters) -> bool:
    """Whether the checkpoint's partitions and this engine's are of the two kinds a ZeRO-stage change
    crosses: per parameter (ZeRO-3, and the replicated layouts' even shares) and flat (ZeRO-1/2's groups,
    listed in the index)."""
    if reader.format < 2 or masters.replicated:
        return False
    flat_saved = any(isinstance(rule, list) or "flat" in rule for rule in reader.meta["pieces"].values())
    return flat_saved == isinstance(masters, Zero3)


def _swapper(group):
    """``swap(parts, sizes)``: collective over ``group``, ``parts[j]`` (1-D) to its rank j; returns what
    each rank j sent here (``sizes[j]`` elements)."""

    def swap(parts: list[torch.Tensor], sizes: list[int]) -> list[torch.Tensor]:
        send = torch.cat(parts)
        out = torch.empty(sum(sizes), dtype=send.dtype)
        collectives.all_to_all_single(out, send, sizes, [t.numel() for t in parts], group=group)
        return list(out.split(sizes))

    return swap


def exchange_into(reader: UniversalReader, owned, keys, replica: int, replicas: int, swap) -> None:
    """Collective over the ``replicas`` ranks holding this rank's TP slice (``swap``: ``_swapper``'s):
    fill each ``(name, Owned)`` range of ``owned`` as ``read_into`` does, but every rank reads the files
    (or the part of one) that ``Exchange`` gives it and the elements travel to their owners, one key at a
    time: a ZeRO-stage change opens one or ``ceil(saved / new replicas)`` files per rank instead of up to
    every file, and reads its share of bytes (held at once: this rank's part of one key, what it sends
    and what it receives). A rank whose read fails (a corrupt file) goes on with zeros through every
    collective and raises its CheckpointError at the end, so no rank waits in a collective another left."""
    ex = Exchange(reader, replica, replicas)
    failed = ""
    try:
        asks, lands = ex.requests([(name, o.start, o.numel) for name, o in owned])
    except CheckpointError as e:
        failed, asks, lands = str(e), [[] for _ in range(replicas)], [[] for _ in range(replicas)]
    counts = swap([torch.tensor([len(rows)], dtype=torch.int64) for rows in asks], [1] * replicas)
    flat = [torch.tensor(rows, dtype=torch.int64).reshape(-1) for rows in asks]
    asked = [t.reshape(-1, 3).tolist() for t in swap(flat, [3 * int(c) for c in counts])]
    sizes = [sum(numel for _, _, numel in rows) for rows in lands]
    with torch.no_grad():
        for key in keys:
            try:
                held = ex.read(key) if not failed else {}
            except CheckpointError as e:
                failed, held = str(e), {}
            if failed:  # what the others asked for, as zeros
                held = {i: (a, torch.zeros(z - a)) for i, a, z in ex.assignment()}
            got = swap(ex.serve(held, asked), sizes)
            del held
            ex.place(got, lands, [o.dest[key] for _, o in owned])
            del got
            if not key:
                for _, o in owned:
                    if "lp" in o.dest:
                        o.dest["lp"].copy_(o.dest[""])
    if failed:
        raise CheckpointError(failed)


def _agree(
    step_dir: Path,
    problem: str,
    mismatched: list[str],
    files: tuple[int, int | None] = (0, None),
    stage_change: bool = False,
) -> bool:
    """Collective: the lowest failing rank's problem, or model mismatch, raised on every rank. Returns
    whether every rank reads by file (``Exchange``): where every rank can, and the most files a direct
    read opens on a rank (``files``: ``_files_to_open``'s) is more than a read by file opens, across a
    ZeRO-stage change (``stage_change``: the same on every rank), or more by two otherwise: a DP change
    keeps its direct reads (1-3 files)."""
    raise_everywhere(problem)
    if any_rank(bool(mismatched)):  # the lists are gathered only then
        for problems in gather(mismatched):
            if problems:
                raise ModelMismatch(problems, step_dir)
    direct, by_file = files
    most = torch.tensor([direct, -1 if by_file is None else by_file, by_file is None], dtype=torch.int64)
    reduce(most, "max")  # the most files on any rank; whether any cannot read by file
    if most[2]:
        return False
    return bool(most[0] > most[1]) if stage_change else bool(most[0] > most[1] + 1)


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
    step_dir: Path, keys: tuple[str, ...] = ("",), manifest: dict | None = None
) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
    """Every parameter whole (TP merged), per key ("" = value, or a moment): ({name: {key: tensor}}, meta).
    The whole model on the host: for tests and small tools (export streams tensor by tensor instead; a
    training rank reads its slices through ``slices.UniversalReader``)."""
    with UniversalReader(step_dir, 1, 0, manifest) as reader:
        out = {name: {key: reader.read_local(name, key) for key in keys} for name in reader.meta["params"]}
        return out, reader.meta


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
