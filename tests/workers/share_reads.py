"""One process playing every rank of a large ZeRO-3 world in turn: what a resume reads, rank by rank.

A real model's inventory (its parameters' shapes and TP splits, ``inventory``) is cut as ZeRO-3 cuts it
over DP ranks (equal partitions of each flattened parameter, the last short or empty). Every rank's file
is written by the real writer (``universal.write_share``: checksummed; each value computed from its
position, so any range read back can be checked), rank 0's index by ``universal.write_index``, the
manifest with the digests a save records, plus each rank's RNG file and the run state. Then, for every
rank of a DP (the saved one or another), the real read path runs:
``manager.read_run_files`` (manifest, run state, and the RNG file on the same layout) and
``UniversalReader`` + ``universal.read_into`` for the rank's ZeRO-3 ranges of the fp32 value and both
Adam moments. Counted per rank (``IoCount``): files opened (Python's audit hook sees every open, and
``safetensors``' own opener is taken away), paths and descriptors stat'ed, bytes read
(``/proc/self/io`` ``rchar``: every byte any read call returned) and the peak RSS above the RSS before
(the destination tensors are allocated first, as an engine's are).

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

MODEL = [  # a real small model: 92 parameters, 19.8M elements (238 MB of fp32 value + moments)
    "model.num_layers=6",
    "model.hidden_size=384",
    "model.num_heads=6",
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


def value(index: int, key: int, start: int, numel: int) -> torch.Tensor:
    """The saved value of elements ``[start, start + numel)`` of parameter ``index``'s ``key``."""
    return (
        (torch.arange(start, start + numel, dtype=torch.float64) % 65521) * 1e-4 + index + key / 4
    ).float()


def layout(dp: int) -> dict:
    return {"world": dp, "tp": 1, "dp": dp, "zero_stage": 3, "precision": "fp32", "param_groups": ["decay"]}


def write_world(step_dir: Path, params: dict, dp: int) -> None:
    """The checkpoint a TP=1 x DP=``dp`` ZeRO-3 save writes (module docstring)."""
    from goat_dist.checkpoint import rng

    udir = step_dir / "universal"
    udir.mkdir(parents=True)
    index = {name: i for i, name in enumerate(params)}
    gathered, known = [], {}
    rng_state = rng.capture()
    for rank in range(dp):
        ranges = zero3_ranges(params, dp, rank)
        pieces = [(n, s, c, {k: (index[n], j, s, c) for j, k in enumerate(KEYS)}) for n, s, c in ranges]
        path = udir / universal.file_name(rank)
        known[f"universal/{path.name}"] = universal.write_share(path, pieces, rank, STEP, lambda d: value(*d))
        gathered.append({"file": path.name, "tp": 0, "replica": rank, "pieces": ranges})
        with open(step_dir / f"rng_rank{rank}.pt", "wb") as f:
            torch.save(rng_state, f)
    counters = {"step": STEP, "optimizer": "ZeRO-3 (simulated)", "adam_step": STEP, "lr_step": STEP}
    universal.write_index(udir, params, gathered, 1, {**counters, "engine": {}})
    state = {"step": STEP, **layout(dp), "run_state": {"consumed_samples": 0, "consumed_tokens": 0}}
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


def read_rank(step_dir: Path, params: dict, dp: int, rank: int) -> dict:
    """One rank of a TP=1 x DP=``dp`` ZeRO-3 world resuming from ``step_dir``: its counts, its share
    (12 bytes per element it holds) and whether every element arrived as saved."""
    ranges = zero3_ranges(params, dp, rank)
    owned = [
        (name, Owned(start, numel, {k: torch.empty(numel) for k in KEYS})) for name, start, numel in ranges
    ]
    with IoCount(step_dir) as io:
        manifest, state, rng_state = read_run_files(step_dir, rank, layout=layout(dp))
        with UniversalReader(step_dir, 1, 0, manifest) as reader:
            universal.read_into(reader, owned, KEYS)
    index = {name: i for i, name in enumerate(params)}
    exact = all(
        torch.equal(o.dest[k], value(index[name], j, o.start, o.numel))
        for name, o in owned
        for j, k in enumerate(KEYS)
    )
    state_files = sorted({p for p in io.opened if p.startswith("universal/rank")})
    return {
        "rank": rank,
        "share_bytes": 12 * sum(numel for _, _, numel in ranges),
        "bytes": io.bytes,
        "opened": io.opened,
        "state_files": state_files,
        "stats": sorted(set(io.stats)),
        "extra_rss": io.extra_rss,
        "rng": rng_state is not None,
        "exact": exact,
    }


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

        self.label, self.bytes = label, 0
        self.numel = {k: n for k, n in expect["tensors"].items()}
        entries = [tensor_file.Entry(k, torch.float32, [n], None) for k, n in self.numel.items()]
        entries, meta = tensor_file.with_checksums(entries, {"format": "2", "rank": "0", "step": "0"})
        self.bytes += len(tensor_file.header(entries, meta))
        PlannedFile.opened.append(self)

    def read(self, name: str, lo: int, hi: int) -> torch.Tensor:
        from goat_dist.checkpoint.tensor_file import block_size

        block = block_size(self.numel[name])
        a, z = lo // block * block, min(self.numel[name], -(-hi // block) * block)
        self.bytes += 4 * (z - a) + 4 * (-(-(z - a) // block))  # the data and its checksums
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


def plan_world(root: Path, params: dict, dp: int) -> tuple[dict, dict]:
    """index.json of a TP=1 x DP=``dp`` ZeRO-3 save of ``params`` (written under ``root``, with the real
    writer's ``index_record``) and a manifest naming each state file's tensors (with ``meta_json_bytes``,
    the full list earlier releases wrote beside it)."""
    gathered = []
    for rank in range(dp):
        gathered.append({"file": universal.file_name(rank), "tp": 0, "replica": rank,
                         "pieces": zero3_ranges(params, dp, rank)})  # fmt: skip
    saved = {"step": STEP, "adam_step": STEP}
    udir = root / "universal"
    udir.mkdir(parents=True, exist_ok=True)
    universal.write_index(udir, params, gathered, 1, saved)  # what rank 0 writes of the state but its share
    index = json.loads((udir / "index.json").read_text())
    files = {"universal/index.json": digest(udir / "index.json")}
    for part in gathered:
        tensors = {universal.tensor_key(n, k): c for n, _, c in part["pieces"] for k in KEYS}
        files[f"universal/{part['file']}"] = {"bytes": 0, "sha256": "", "tensors": tensors}
    return index, {
        "step": STEP,
        "files": files,
        "meta_json_bytes": full_list_bytes(params, gathered, saved),
    }


def plan_rank(root: Path, params: dict, manifest: dict, dp: int, rank: int) -> dict:
    """The files and bytes rank ``rank`` of DP=``dp`` would read of the planned checkpoint (the real reader,
    over ``PlannedFile``s)."""
    from goat_dist.checkpoint import slices

    PlannedFile.opened = []
    real, slices.TensorFile = slices.TensorFile, PlannedFile
    share = 0
    try:
        with UniversalReader(root, 1, 0, manifest) as reader:
            for name, start, numel in zero3_ranges(params, dp, rank):
                share += 12 * numel
                for key in KEYS:
                    reader.read_flat(name, key, start, numel)
    finally:
        slices.TensorFile = real
    labels = [f.label for f in PlannedFile.opened]
    return {"files": labels, "bytes": sum(f.bytes for f in PlannedFile.opened), "share_bytes": share}


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
