"""One process playing every rank of a large world in turn: what a resume reads, rank by rank.

A real model's inventory (its parameters' shapes and TP splits, ``inventory``) is cut as a TP x DP world
cuts it: each TP rank's slice (``local_params``), then ZeRO-3's equal partitions of each flattened
parameter (the last short or empty) or ZeRO-1/2's equal partitions of the flattened parameters
(``ranges``). Every rank's file is written by the real writer (``universal.write_share``: checksummed;
each value computed from its position in the whole tensor, so any range read back at any TP can be
checked), rank 0's index by ``universal.write_index``, the manifest with the digests a save records, plus
each rank's RNG file and the run state. Then, for every rank of a layout (the saved one or another), the
real read path runs: ``manager.read_run_files`` (manifest, run state, and the RNG file on the same layout)
and ``UniversalReader`` + ``universal.read_into`` for the rank's ranges of the fp32 value and both Adam
moments (``read_rank``), or the reads by file of a ZeRO-stage change with the all-to-all played here
(``read_world_by_file``). Counted per rank (``IoCount``): files opened (Python's audit hook sees every
open, and ``safetensors``' own opener is taken away), paths and descriptors stat'ed, bytes read
(``/proc/self/io`` ``rchar``: every byte any read call returned) and the peak RSS above the RSS before
(the destination tensors are allocated first, as an engine's are). ``plan_world`` / ``plan_rank`` do the
same for the 30B config at 512 ranks over stand-in files (``PlannedFile``).

    python tests/workers/share_reads.py OUT.json DP_SAVED DP_READ [DP_READ ...]
"""

from __future__ import annotations

import ctypes
import gc
import json
import math
import os
import re
import sys
from pathlib import Path

import torch

from goat_dist.checkpoint import universal
from goat_dist.checkpoint.digests import digest, listing
from goat_dist.checkpoint.manager import read_run_files, write_manifest
from goat_dist.checkpoint.slices import UniversalReader
from goat_dist.engine.masters import KEYS, Owned

MODEL = [  # a real small model: 92 parameters, 16.5M elements (198 MB of fp32 value + moments); 8 heads: TP 8
    "model.num_layers=6",
    "model.hidden_size=384",
    "model.num_heads=8",
    "model.vocab_size=16384",
    "model.seq_len=64",
    "model.position=goat",
    "model.attention_backend=sdpa",
]
STEP = 7


def inventory(overrides: list[str] = MODEL) -> dict:
    """{name: split and shape} of the model's parameters at TP=1 (process groups must exist)."""
    from goat_dist.config import load_config
    from goat_dist.model import GPT

    model = GPT(load_config(None, overrides).model)
    return {name: {**universal.split_meta(p), "shape": list(p.shape)} for name, p in model.named_parameters()}


def zero3_ranges(params: dict, dp: int, rank: int) -> list[tuple[str, int, int]]:
    """(name, start, numel) of every parameter's ZeRO-3 partition on DP rank ``rank``: DeepSpeed pads each
    flattened parameter to a multiple of ``dp`` and gives rank r elements ``[r * size, (r + 1) * size)``."""
    out = []
    for name, m in params.items():
        n = math.prod(m["shape"])
        size = -(-n // dp)
        start = rank * size
        numel = max(0, min(size, n - start))
        if numel:
            out.append((name, start, numel))
    return out


def zero1_ranges(params: dict, dp: int, rank: int) -> list[tuple[str, int, int]]:
    """(name, start, numel) of the parameters' pieces in DP rank ``rank``'s ZeRO-1/2 partition: the
    parameters flattened into one group in order, cut into ``dp`` equal partitions (the last short), as
    DeepSpeed's flat groups cut them (without its alignment padding)."""
    total = sum(math.prod(m["shape"]) for m in params.values())
    size = -(-total // dp)
    lo, hi = rank * size, min(total, (rank + 1) * size)
    out, offset = [], 0
    for name, m in params.items():
        n = math.prod(m["shape"])
        a, z = max(lo, offset), min(hi, offset + n)
        if a < z:
            out.append((name, a - offset, z - a))
        offset += n
    return out


def ranges(params: dict, dp: int, rank: int, stage: int = 3) -> list[tuple[str, int, int]]:
    """The pieces DP rank ``rank`` holds at ZeRO ``stage`` (3, or 1 for ZeRO-1/2)."""
    return (zero3_ranges if stage == 3 else zero1_ranges)(params, dp, rank)


def value_at(index: int, key: int, positions: torch.Tensor) -> torch.Tensor:
    """The saved value of the elements at flat ``positions`` of the whole (TP=1) parameter ``index``'s
    ``key``."""
    return ((positions.double() % 65521) * 1e-4 + index + key / 4).float()


def value(index: int, key: int, start: int, numel: int) -> torch.Tensor:
    """The saved value of elements ``[start, start + numel)`` of parameter ``index``'s ``key`` (TP=1)."""
    return value_at(index, key, torch.arange(start, start + numel))


def local_params(params: dict, tp: int) -> dict:
    """``params`` (at TP=1) as each rank of TP=``tp`` holds them: the split dim of a split one cut by tp."""
    out = {}
    for name, m in params.items():
        shape = list(m["shape"])
        if m["tp_split"] and tp > 1:
            shape[m["dim"]] //= tp
        out[name] = {**m, "shape": shape}
    return out


_POSITIONS: dict = {}


def positions(params: dict, tp: int, t: int, name: str) -> torch.Tensor:
    """Where TP rank ``t`` of TP=``tp``'s local elements of ``name`` sit in the whole flattened tensor
    (``universal.split`` of the positions; cached for every TP rank of the last TP size: ~8 bytes per
    element of the model)."""
    if tp not in _POSITIONS:
        _POSITIONS.clear()
        _POSITIONS[tp] = {}
    cache = _POSITIONS[tp].setdefault(t, {})
    if name not in cache:
        m = params[name]
        whole = torch.arange(math.prod(m["shape"])).reshape(m["shape"])
        cache[name] = universal.split(whole, m, tp, t).reshape(-1).clone() if tp > 1 else whole.reshape(-1)
    return cache[name]


def layout(dp: int, tp: int = 1, stage: int = 3) -> dict:
    return {"world": dp * tp, "tp": tp, "dp": dp, "zero_stage": stage, "precision": "fp32",
            "param_groups": ["decay"]}  # fmt: skip


def write_world(step_dir: Path, params: dict, dp: int, tp: int = 1, stage: int = 3) -> None:
    """The checkpoint a TP=``tp`` x DP=``dp`` ZeRO-``stage`` save writes (module docstring); global rank
    ``i * tp + t`` is TP rank t of replica i."""
    from goat_dist.checkpoint import rng

    udir = step_dir / "universal"
    udir.mkdir(parents=True)
    index = {name: i for i, name in enumerate(params)}
    local = local_params(params, tp)
    gathered, known = [], {}
    rng_state = rng.capture()

    def host(ref):
        name, j, t, s, c = ref
        return value_at(index[name], j, positions(params, tp, t, name)[s : s + c])

    for rank in range(dp * tp):
        t, i = rank % tp, rank // tp
        held = ranges(local, dp, i, stage)
        pieces = [(n, s, c, {k: (n, j, t, s, c) for j, k in enumerate(KEYS)}) for n, s, c in held]
        path = udir / universal.file_name(rank)
        known[f"universal/{path.name}"] = universal.write_share(path, pieces, rank, STEP, host, local)
        gathered.append({"file": path.name, "tp": t, "replica": i, "pieces": held})
        with open(step_dir / f"rng_rank{rank}.pt", "wb") as f:
            torch.save(rng_state, f)
    counters = {"step": STEP, "optimizer": f"ZeRO-{stage} (simulated)", "adam_step": STEP, "lr_step": STEP}
    universal.write_index(udir, local, gathered, tp, {**counters, "engine": {}})
    run_state = {"consumed_samples": 0, "consumed_tokens": 0}
    state = {"step": STEP, **layout(dp, tp, stage), "run_state": run_state}
    (step_dir / "trainer_state.json").write_text(json.dumps(state, indent=1))
    (step_dir / "config.yaml").write_text("model: {}\n")
    files = {name: digest(step_dir / name) for name in listing(step_dir) if name not in known}
    write_manifest(step_dir, {"step": STEP, "saved_at": 0.0}, files={**files, **known})


# ---- counting ------------------------------------------------------------------------------------------
_ACTIVE: list = []


def _audit(event: str, args) -> None:
    if event == "open" and _ACTIVE and isinstance(args[0], (str, bytes, os.PathLike)):
        _ACTIVE[-1].saw_open(os.fsdecode(os.fspath(args[0])))


sys.addaudithook(_audit)


def _status_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def _rchar() -> int:
    return int(re.search(r"rchar:\s+(\d+)", Path("/proc/self/io").read_text()).group(1))


class IoCount:
    """What the code inside the block did to the files under ``root``: opens, stats, bytes, peak RSS."""

    def __init__(self, root: Path):
        self.root = str(Path(root).resolve())
        self.opened: list[str] = []
        self.stats: list[str] = []
        self._fds: dict[int, str] = {}

    def saw_open(self, path: str) -> None:
        path = os.path.abspath(path)
        if path.startswith(self.root):
            self.opened.append(os.path.relpath(path, self.root))

    def __enter__(self):
        import safetensors
        import safetensors.torch

        real = self._real = {"open": os.open, "stat": os.stat, "lstat": os.lstat, "fstat": os.fstat}

        def refused(*a, **k):
            raise AssertionError("safetensors opened a checkpoint file itself (uncounted, memory-mapped)")

        self._safetensors = (safetensors.safe_open, safetensors.torch.safe_open)
        safetensors.safe_open = safetensors.torch.safe_open = refused

        def opening(path, *a, **k):
            fd = real["open"](path, *a, **k)
            self._fds[fd] = os.path.abspath(os.fsdecode(os.fspath(path)))
            return fd

        def stat_of(kind):
            def stat(path, *a, **k):
                where = self._fds.get(path) if isinstance(path, int) else os.path.abspath(os.fsdecode(path))
                if where and where.startswith(self.root):
                    self.stats.append(os.path.relpath(where, self.root))
                return real[kind](path, *a, **k)

            return stat

        os.open, os.stat, os.lstat, os.fstat = opening, stat_of("stat"), stat_of("lstat"), stat_of("fstat")
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
        self.rss = _status_kib("VmRSS")
        _ACTIVE.append(self)
        self._rchar = _rchar()
        return self

    def __exit__(self, *exc):
        self.bytes = _rchar() - self._rchar
        _ACTIVE.remove(self)
        self.extra_rss = (_status_kib("VmHWM") - self.rss) * 1024
        import safetensors
        import safetensors.torch

        safetensors.safe_open, safetensors.torch.safe_open = self._safetensors
        os.open, os.stat, os.lstat, os.fstat = (self._real[k] for k in ("open", "stat", "lstat", "fstat"))


def _owned(params: dict, dp: int, rank: int, tp: int, stage: int) -> list:
    return [
        (name, Owned(start, numel, {k: torch.empty(numel) for k in KEYS}))
        for name, start, numel in ranges(local_params(params, tp), dp, rank // tp, stage)
    ]


def _result(step_dir: Path, rank: int, owned: list, params: dict, tp: int, io, rng: bool) -> dict:
    """What a rank read (``io``: an ``IoCount``), its share (12 bytes per element it holds), the headers of
    the state files it opened (``header_bytes``: a fixed cost per file, which a tiny share feels) and
    whether every element arrived as saved."""
    index = {name: i for i, name in enumerate(params)}
    t = rank % tp
    exact = all(
        torch.equal(
            o.dest[k], value_at(index[name], j, positions(params, tp, t, name)[o.start : o.start + o.numel])
        )
        for name, o in owned
        for j, k in enumerate(KEYS)
    )
    state_files = sorted({p for p in io.opened if p.startswith("universal/rank")})
    heads = 0
    for name in state_files:
        with open(step_dir / name, "rb") as f:
            heads += 8 + int.from_bytes(f.read(8), "little")
    return {
        "rank": rank,
        "share_bytes": 12 * sum(o.numel for _, o in owned),
        "bytes": io.bytes,
        "header_bytes": heads,
        "opened": io.opened,
        "state_files": state_files,
        "stats": sorted(set(io.stats)),
        "extra_rss": io.extra_rss,
        "rng": rng,
        "exact": exact,
    }


def read_rank(step_dir: Path, params: dict, dp: int, rank: int, tp: int = 1, stage: int = 3) -> dict:
    """One rank (``i * tp + t``: TP rank t of replica i) of a TP=``tp`` x DP=``dp`` ZeRO-``stage`` world
    resuming from ``step_dir`` by direct reads (``universal.read_into``): its counts (``_result``)."""
    owned = _owned(params, dp, rank, tp, stage)
    with IoCount(step_dir) as io:
        manifest, state, rng_state = read_run_files(step_dir, rank, layout=layout(dp, tp, stage))
        with UniversalReader(step_dir, tp, rank % tp, manifest) as reader:
            universal.read_into(reader, owned, KEYS)
    return _result(step_dir, rank, owned, params, tp, io, rng_state is not None)


class _Sums:
    """``IoCount``s of one rank's several blocks, added up."""

    def __init__(self):
        self.bytes, self.opened, self.stats, self.extra_rss = 0, [], [], 0

    def add(self, io: IoCount) -> None:
        self.bytes += io.bytes
        self.opened += io.opened
        self.stats += io.stats
        self.extra_rss = max(self.extra_rss, io.extra_rss)


def read_world_by_file(step_dir: Path, params: dict, dp: int, stage: int, tp: int = 1) -> list[dict]:
    """Every rank of a TP=``tp`` x DP=``dp`` ZeRO-``stage`` world resuming from ``step_dir`` by file
    (``exchange.Exchange``, what ``universal.exchange_into`` does with an all-to-all): each rank's
    requests, then key by key each rank's reads (counted per rank, ``IoCount``), and the all-to-all played
    here (rank j's answer to rank k is what k receives from j); per rank ``_result``'s figures."""
    from goat_dist.checkpoint.exchange import Exchange

    world = dp * tp
    owned = [_owned(params, dp, rank, tp, stage) for rank in range(world)]
    sums = [_Sums() for _ in range(world)]
    readers, plans = [], []
    for rank in range(world):
        with IoCount(step_dir) as io:
            manifest, _, _ = read_run_files(step_dir, rank, layout=layout(dp, tp, stage))
            reader = UniversalReader(step_dir, tp, rank % tp, manifest)
            ex = Exchange(reader, rank // tp, dp)
            plans.append((ex, *ex.requests([(name, o.start, o.numel) for name, o in owned[rank]])))
        readers.append(reader)
        sums[rank].add(io)
    peers = [[t + j * tp for j in range(dp)] for t in range(tp)]  # the ranks of each TP rank's replicas
    for key in KEYS:
        served = {}
        for rank in range(world):
            ex, _, _ = plans[rank]
            asked = [plans[peer][1][rank // tp] for peer in peers[rank % tp]]
            with IoCount(step_dir) as io:
                held = ex.read(key)
            sums[rank].add(io)
            served[rank] = ex.serve(held, asked)
            del held
        for rank in range(world):
            ex, _, lands = plans[rank]
            got = [served[peer][rank // tp] for peer in peers[rank % tp]]
            ex.place(got, lands, [o.dest[key] for _, o in owned[rank]])
        del served
    for reader in readers:
        reader.close()
    return [_result(step_dir, rank, owned[rank], params, tp, sums[rank], False) for rank in range(world)]


# ---- the 30B config on 512 ranks, without its 360 GB ---------------------------------------------------
def inventory_30b() -> dict:
    """{name: split and shape} of configs/models/goat_30b.yaml at TP=1, built on the meta device."""
    from goat_dist.config import load_config
    from goat_dist.model import GPT

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(root / "configs/models/goat_30b.yaml", ["parallel.tp=1", "parallel.sp=false"])
    with torch.device("meta"):
        model = GPT(cfg.model)
    return {name: {**universal.split_meta(p), "shape": list(p.shape)} for name, p in model.named_parameters()}


class PlannedFile:
    """Stands in for ``tensor_file.TensorFile`` over a file that is not there: the real file's header size
    (computed by the writer's own ``header``) and checksum rule, and each read's bytes, rounded to its
    checksum blocks as the real reader reads them. Returns zeros without memory (an expanded scalar)."""

    opened: list = []

    def __init__(self, path, label, where, expect):
        from goat_dist.checkpoint import tensor_file

        self.label, self.bytes, self.reads = label, 0, 0
        self.numel = {k: n for k, n in expect["tensors"].items()}
        self.blocks = {k: tuple(expect.get("blocks", {}).get(k, (0, 0))) for k in self.numel}
        entries = [
            tensor_file.Entry(k, torch.float32, [n], None, *self.blocks[k]) for k, n in self.numel.items()
        ]
        entries, meta = tensor_file.with_checksums(entries, {"format": "2", "rank": "0", "step": "0"})
        self.bytes += len(tensor_file.header(entries, meta))
        PlannedFile.opened.append(self)

    def read(self, name: str, lo: int, hi: int) -> torch.Tensor:
        from goat_dist.checkpoint.tensor_file import block_size, block_span

        block, phase = self.blocks[name]
        if not block:
            block = block_size(self.numel[name])
        first, a, z = block_span(self.numel[name], block, phase, lo, hi)
        last = (z - 1 + phase) // block
        self.bytes += 4 * (z - a) + 4 * (last - first + 1)  # the data and its checksums
        self.reads += 1
        return torch.zeros(()).expand(hi - lo)

    def close(self) -> None:
        pass


def full_list_bytes(params: dict, gathered: list, saved: dict) -> int:
    """The size of the ``meta.json`` earlier releases wrote beside the index: every rank's every piece."""
    table = {name: [] for name in params}
    for i, part in enumerate(gathered):
        for name, start, numel in part["pieces"]:
            table[name].append([part["tp"], start, numel, i])
    files = [part["file"] for part in gathered]
    meta = {"format": 2, "tp": 1, **saved, "params": params, "files": files, "pieces": table}
    return len(json.dumps(meta, separators=(",", ":")))


def plan_world(root: Path, params: dict, dp: int, tp: int = 1, stage: int = 3) -> tuple[dict, dict]:
    """index.json of a TP=``tp`` x DP=``dp`` ZeRO-``stage`` save of ``params`` (written under ``root``,
    with the real writer's ``index_record``) and a manifest naming each state file's tensors and their
    checksum blocks (with ``meta_json_bytes``, the full list earlier releases wrote beside it)."""
    local = local_params(params, tp)
    gathered = []
    for rank in range(dp * tp):
        gathered.append({"file": universal.file_name(rank), "tp": rank % tp, "replica": rank // tp,
                         "pieces": ranges(local, dp, rank // tp, stage)})  # fmt: skip
    saved = {"step": STEP, "adam_step": STEP}
    udir = root / "universal"
    udir.mkdir(parents=True, exist_ok=True)
    universal.write_index(udir, local, gathered, tp, saved)  # what rank 0 writes of the state but its share
    index = json.loads((udir / "index.json").read_text())
    files = {"universal/index.json": digest(udir / "index.json")}
    aligned = universal.checksum_blocks(local)
    for part in gathered:
        tensors = {universal.tensor_key(n, k): c for n, _, c in part["pieces"] for k in KEYS}
        blocks = {universal.tensor_key(n, k): (aligned[n], s % aligned[n])
                  for n, s, _ in part["pieces"] if n in aligned for k in KEYS}  # fmt: skip
        files[f"universal/{part['file']}"] = {"bytes": 0, "sha256": "", "tensors": tensors, "blocks": blocks}
    return index, {
        "step": STEP,
        "files": files,
        "meta_json_bytes": full_list_bytes(params, gathered, saved),
    }


def plan_rank(
    root: Path,
    params: dict,
    manifest: dict,
    dp: int,
    rank: int,
    tp: int = 1,
    stage: int = 3,
    by_file: bool = False,
) -> dict:
    """The files and bytes rank ``rank`` (``i * tp + t``) of TP=``tp`` x DP=``dp`` at ZeRO ``stage`` would
    read of the planned checkpoint (the real reader, over ``PlannedFile``s): directly, or ``by_file``
    (``exchange.Exchange``: its requests, then its reads)."""
    from goat_dist.checkpoint import slices
    from goat_dist.checkpoint.exchange import Exchange

    PlannedFile.opened = []
    real, slices.TensorFile = slices.TensorFile, PlannedFile
    held = ranges(local_params(params, tp), dp, rank // tp, stage)
    try:
        with UniversalReader(root, tp, rank % tp, manifest) as reader:
            if by_file:
                ex = Exchange(reader, rank // tp, dp)
                asks, _ = ex.requests(held)
                for key in KEYS:
                    ex.read(key)
            else:
                for name, start, numel in held:
                    for key in KEYS:
                        reader.read_flat(name, key, start, numel)
    finally:
        slices.TensorFile = real
    labels = [f.label for f in PlannedFile.opened]
    return {
        "files": labels,
        "bytes": sum(f.bytes for f in PlannedFile.opened),
        "reads": sum(f.reads for f in PlannedFile.opened),
        "share_bytes": 12 * sum(numel for _, _, numel in held),
        "peers": sum(1 for rows in asks if rows) if by_file else None,
    }


def main(out: str, saved_dp: int, read_dps: list[int]) -> None:
    import tempfile

    from goat_dist import distributed

    distributed.init(tp=1)
    params = inventory()
    with tempfile.TemporaryDirectory() as tmp:
        step_dir = Path(tmp) / "step_00000007"
        write_world(step_dir, params, saved_dp)
        result = {str(dp): [read_rank(step_dir, params, dp, r) for r in range(dp)] for dp in read_dps}
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    gc.collect()
    main(sys.argv[1], int(sys.argv[2]), [int(x) for x in sys.argv[3:]])
