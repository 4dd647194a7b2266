"""A ZeRO-stage change reads the saved files by file and routes each element to its owner.

``universal.exchange_into`` on every rank of a small world, the ranks as threads and the all-to-all an
in-memory mesh: ZeRO-1 -> ZeRO-3 and ZeRO-3 -> ZeRO-1 at the same DP, fewer and more replicas than saved.
Each rank opens only the files ``exchange.Exchange`` gives it, every element of every key (and the forward
weights' ``lp``) arrives as saved; a corrupt file stops its reader with the file named while the others
finish their collectives. ``universal._agree`` reads by file only where a direct read opens more than one
file more than reading by file does (a DP change keeps its direct reads).
"""

from __future__ import annotations

import math
import threading

import pytest
import torch

from goat_dist.checkpoint import universal
from goat_dist.checkpoint.digests import digest, listing, read_manifest
from goat_dist.checkpoint.errors import CheckpointError
from goat_dist.checkpoint.manager import write_manifest
from goat_dist.checkpoint.slices import UniversalReader
from goat_dist.engine.masters import KEYS, Owned, Zero3

PARAMS = {
    "emb": {"tp_split": True, "dim": 0, "stride": 1, "shape": [50, 16]},
    "proj": {"tp_split": True, "dim": 1, "stride": 1, "shape": [16, 96]},
    "norm": {"tp_split": False, "dim": 0, "stride": 1, "shape": [16]},
    "fc": {"tp_split": True, "dim": 0, "stride": 2, "shape": [64, 16]},
}


def whole(name: str, key: str) -> torch.Tensor:
    base = list(PARAMS).index(name) * 10000 + KEYS.index(key) * 1000
    return torch.arange(math.prod(PARAMS[name]["shape"]), dtype=torch.float64).float() + base


def zero1(dp: int, i: int) -> list[tuple[str, int, int]]:
    """ZeRO-1/2's pieces: the parameters flattened in order, cut into ``dp`` equal partitions."""
    total = sum(math.prod(m["shape"]) for m in PARAMS.values())
    size, out, offset = -(-total // dp), [], 0
    for name, m in PARAMS.items():
        n = math.prod(m["shape"])
        a, z = max(i * size, offset), min((i + 1) * size, offset + n)
        if a < z:
            out.append((name, a - offset, z - a))
        offset += n
    return out


def zero3(dp: int, i: int) -> list[tuple[str, int, int]]:
    out = []
    for name, m in PARAMS.items():
        n = math.prod(m["shape"])
        size = -(-n // dp)
        if i * size < n:
            out.append((name, i * size, min(size, n - i * size)))
    return out


def write(step_dir, dp: int, cut) -> dict:
    udir = step_dir / "universal"
    udir.mkdir(parents=True)
    gathered, known = [], {}
    for i in range(dp):
        pieces = [(n, s, c, {k: whole(n, k)[s : s + c] for k in KEYS}) for n, s, c in cut(dp, i)]
        path = udir / universal.file_name(i)
        known[f"universal/{path.name}"] = universal.write_share(path, pieces, i, 3, params=PARAMS)
        gathered.append({"file": path.name, "tp": 0, "replica": i, "pieces": [p[:3] for p in pieces]})
    universal.write_index(udir, PARAMS, gathered, 1, {"step": 3, "adam_step": 3})
    files = {name: digest(step_dir / name) for name in listing(step_dir)}
    write_manifest(step_dir, {"step": 3}, files={**files, **known})
    return read_manifest(step_dir)


class Mesh:
    """An all-to-all between threads: ``swap_for(j)`` is replica j's ``swap``."""

    def __init__(self, n: int):
        self.n, self.box = n, [[None] * n for _ in range(n)]
        self.barrier = threading.Barrier(n, timeout=30)

    def swap_for(self, me: int):
        def swap(parts, sizes):
            for j, t in enumerate(parts):
                self.box[me][j] = t.clone()
            self.barrier.wait()
            got = [self.box[j][me] for j in range(self.n)]
            self.barrier.wait()
            assert [g.numel() for g in got] == sizes
            return got

        return swap


def run_world(step_dir, manifest, dp: int, cut) -> list[dict]:
    """Every replica of the new layout runs ``exchange_into`` in its own thread."""
    mesh, results = Mesh(dp), [{} for _ in range(dp)]

    def rank(j: int) -> None:
        owned = [
            (n, Owned(s, c, {**{k: torch.full((c,), -1.0) for k in KEYS}, "lp": torch.full((c,), -1.0)}))
            for n, s, c in cut(dp, j)
        ]
        reader = UniversalReader(step_dir, 1, 0, manifest)
        try:
            universal.exchange_into(reader, owned, KEYS, j, dp, mesh.swap_for(j))
        except CheckpointError as e:
            results[j]["error"] = str(e)
        results[j]["files"] = sorted(reader._files)
        reader.close()
        results[j]["exact"] = all(
            torch.equal(o.dest[k], whole(n, k)[o.start : o.start + o.numel]) for n, o in owned for k in KEYS
        ) and all(torch.equal(o.dest["lp"], o.dest[""]) for _, o in owned)

    threads = [threading.Thread(target=rank, args=(j,)) for j in range(dp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


CASES = [  # (saved cut, saved DP, new cut, new DP, files each new replica opens)
    ("zero1-to-zero3", zero1, 4, zero3, 4, lambda j: [j]),
    ("zero3-to-zero1", zero3, 4, zero1, 4, lambda j: [j]),
    ("zero3-dp4-to-zero1-dp2", zero3, 4, zero1, 2, lambda j: [2 * j, 2 * j + 1]),
    ("zero1-dp2-to-zero3-dp4", zero1, 2, zero3, 4, lambda j: [j // 2]),
]


@pytest.mark.parametrize("name,saved,saved_dp,new,dp,files", CASES, ids=[c[0] for c in CASES])
def test_each_replica_reads_its_files_and_gets_its_share(name, saved, saved_dp, new, dp, files, tmp_path):
    manifest = write(tmp_path, saved_dp, saved)
    for j, r in enumerate(run_world(tmp_path, manifest, dp, new)):
        assert "error" not in r, r
        assert r["files"] == [f"universal/rank{i:05d}.safetensors" for i in files(j)], (j, r["files"])
        assert r["exact"], f"replica {j}"


def test_a_corrupt_file_stops_its_reader_and_the_others_finish(tmp_path):
    manifest = write(tmp_path, 4, zero1)
    path = tmp_path / "universal" / "rank00002.safetensors"
    data = bytearray(path.read_bytes())
    data[-4 * 40] ^= 0xFF  # inside its last tensor, before the checksum table
    path.write_bytes(bytes(data))
    results = run_world(tmp_path, manifest, 4, zero3)
    assert "rank00002.safetensors does not match its checksums" in results[2]["error"]
    assert all("error" not in results[j] for j in (0, 1, 3)), results  # no rank left in a collective


def test_reading_by_file_is_chosen_where_it_spares_files(tmp_path):
    assert universal._agree("x", "", [], (4, 1)) is True  # 4 files read directly, 1 by file
    assert universal._agree("x", "", [], (3, 2)) is False  # a DP change: 2-3 files either way
    assert universal._agree("x", "", [], (2, 1), stage_change=True) is True  # ZeRO 1 -> 3 at DP 2
    assert universal._agree("x", "", [], (8, None), stage_change=True) is False  # another TP, no all-to-all
    manifest = write(tmp_path / "zero1", 2, zero1)
    flat = UniversalReader(tmp_path / "zero1", 1, 0, manifest)
    manifest = write(tmp_path / "zero3", 2, zero3)
    even = UniversalReader(tmp_path / "zero3", 1, 0, manifest)

    class Masters:
        replicated = False

    zero3_engine = Zero3.__new__(Zero3)  # its class alone matters
    assert universal._stage_change(flat, zero3_engine) and universal._stage_change(even, Masters())
    assert not universal._stage_change(even, zero3_engine) and not universal._stage_change(flat, Masters())
    flat.close()
    even.close()
