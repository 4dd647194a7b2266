"""A TP change reads column ranges of the row-parallel tensors, and checks exactly what it reads.

* ``tensor_file``'s aligned checksum blocks: blocks of ``block`` elements whose boundaries fall where
  ``phase + i`` is a multiple of ``block``; any range reads back exactly, a flipped byte is named by its
  block, and a read of whole blocks costs its bytes and their checksums only. Such a file names its rule
  under a key an earlier release does not know, so that release checks the file whole (sha256).
* ``slices``: TP 1 -> 8 takes 1/8 of the columns of every row of a row-parallel weight; each rank reads its
  columns (strided, one read per row) and not the whole rows: the bytes read stay <= 1.1 x its share,
  where whole rows cost 8 x. TP 8 -> 1 reads whole rows of each saved rank. A corrupt byte in columns
  another rank takes is found by that rank, not by this one.
"""

from __future__ import annotations

import math

import pytest
import torch

from goat_dist.checkpoint import tensor_file, universal
from goat_dist.checkpoint.digests import digest, listing, read_manifest
from goat_dist.checkpoint.errors import CheckpointError
from goat_dist.checkpoint.manager import write_manifest
from goat_dist.checkpoint.slices import UniversalReader
from goat_dist.checkpoint.tensor_file import TensorFile
from goat_dist.engine.masters import KEYS

PARAMS = {  # at TP=1: a row-parallel weight, a column-parallel one (fused halves), a norm
    "proj": {"tp_split": True, "dim": 1, "stride": 1, "shape": [64, 384]},
    "fc1": {"tp_split": True, "dim": 0, "stride": 2, "shape": [768, 64]},
    "norm": {"tp_split": False, "dim": 0, "stride": 1, "shape": [64]},
}


def whole(name: str, key: str) -> torch.Tensor:
    shape = PARAMS[name]["shape"]
    base = list(PARAMS).index(name) * 1000 + KEYS.index(key) * 100
    return (torch.arange(math.prod(shape), dtype=torch.float64) * 1e-3 + base).float().reshape(shape)


def local(name: str, key: str, tp: int, rank: int) -> torch.Tensor:
    return universal.split(whole(name, key), PARAMS[name], tp, rank).contiguous()


def write(step_dir, tp: int, dp: int) -> dict:
    """A TP x DP ZeRO-3 save by the real writer (each parameter split evenly over the DP ranks)."""
    udir = step_dir / "universal"
    udir.mkdir(parents=True)
    params = {n: {**m, "shape": list(local(n, "", tp, 0).shape)} for n, m in PARAMS.items()}
    gathered, known = [], {}
    for rank in range(tp * dp):
        t, i = rank % tp, rank // tp
        pieces = []
        for name, m in params.items():
            n = math.prod(m["shape"])
            size = -(-n // dp)
            start, numel = i * size, max(0, min(size, n - i * size))
            if numel:
                dest = {k: local(name, k, tp, t).reshape(-1)[start : start + numel] for k in KEYS}
                pieces.append((name, start, numel, dest))
        path = udir / universal.file_name(rank)
        known[f"universal/{path.name}"] = universal.write_share(path, pieces, rank, 3, params=params)
        gathered.append({"file": path.name, "tp": t, "replica": i, "pieces": [p[:3] for p in pieces]})
    universal.write_index(udir, params, gathered, tp, {"step": 3, "adam_step": 3})
    files = {name: digest(step_dir / name) for name in listing(step_dir)}
    write_manifest(step_dir, {"step": 3}, files={**files, **known})
    return read_manifest(step_dir)


@pytest.fixture
def counted(monkeypatch):
    """Bytes read through ``TensorFile`` (data, checksums and headers), reset by the test."""
    seen = {"bytes": 0}
    real = TensorFile._pread

    def pread(self, offset, nbytes, into=None):
        seen["bytes"] += nbytes
        return real(self, offset, nbytes, into)

    monkeypatch.setattr(TensorFile, "_pread", pread)
    return seen


# ---- tensor_file -----------------------------------------------------------------------------------------
def test_aligned_checksum_blocks_read_exactly_and_name_the_damage(tmp_path, counted):
    value = torch.randn(1000)
    entries = [
        tensor_file.Entry("a", torch.float32, [1000], lambda: value, block=48, phase=17),
        tensor_file.Entry("b", torch.float32, [300], lambda: value[:300]),  # the plain rule
    ]
    path = tmp_path / "f.safetensors"
    written = tensor_file.write(path, entries, {"x": "1"}, checksums=True)
    with TensorFile(path, expect=written) as f:
        # an earlier release finds no rule it knows there: it checks the file whole against the manifest
        assert "crc32_blocks" not in f.metadata and "crc32_aligned" in f.metadata
        assert f.shape("__crc32__") == [(999 + 17) // 48 + 1 + 2, 4]  # a: 22 blocks, b: 2 (256 + 44)
        for lo, hi in ((0, 1000), (0, 31), (31, 79), (30, 32), (999, 1000), (500, 500)):
            assert torch.equal(f.read("a", lo, hi), value[lo:hi]), (lo, hi)
        assert torch.equal(f.read("b"), value[:300])
        counted["bytes"] = 0
        f.read("a", 31 + 48 * 3, 31 + 48 * 5)  # blocks 4 and 5, whole: their bytes and 2 checksums
        assert counted["bytes"] == 4 * 96 + 4 * 2
    data = bytearray(path.read_bytes())
    head = 8 + int.from_bytes(data[:8], "little")
    data[head + 4 * 100] ^= 1  # element 100 of a: block (100 + 17) // 48 = 2, elements 79..126
    path.write_bytes(bytes(data))
    with TensorFile(path, "universal/f.safetensors", "checkpoint X (step 3): ", written) as f:
        assert torch.equal(f.read("a", 0, 79), value[:79])
        assert torch.equal(f.read("a", 127, 1000), value[127:])
        with pytest.raises(CheckpointError, match=r"universal/f.safetensors does not match its checksums: "
                           r"block 2 of 'a' \(elements from 79\)"):  # fmt: skip
            f.read("a", 126, 127)


def test_row_parallel_blocks_are_a_fraction_of_the_row():
    assert universal.row_block(384) == 48 and 384 % (8 * 48) == 0  # TP 8 takes whole blocks
    assert universal.row_block(20480) == 2560 and universal.row_block(6144) == 768  # 30B: cheap checks
    assert universal.row_block(48) == 48 and universal.row_block(7) == 7  # small rows: a block a row
    assert universal.checksum_blocks(PARAMS) == {"proj": 48}


# ---- slices ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("saved_tp,new_tp", [(1, 8), (8, 1), (1, 2), (2, 4)])
def test_a_tp_change_reads_the_columns_it_keeps(saved_tp, new_tp, tmp_path, counted):
    """Every rank of DP=2 at the new TP reads its ZeRO-3 ranges of every tensor exactly and <= 1.1 x its
    share of bytes (headers and checksums included; whole rows of the row-parallel weight: 3.3 x at TP 1 -> 8
    and 1.34 x at 1 -> 2 here). TP 8 -> 1 (whole rows of each saved rank) read its share before too."""
    manifest = write(tmp_path, saved_tp, dp=2)
    for rank in range(new_tp * 2):
        t, i = rank % new_tp, rank // new_tp
        counted["bytes"], share = 0, 0
        with UniversalReader(tmp_path, new_tp, t, manifest) as reader:
            for name in PARAMS:
                for key in KEYS:
                    flat = local(name, key, new_tp, t).reshape(-1)
                    size = -(-flat.numel() // 2)
                    start, numel = i * size, min(size, flat.numel() - i * size)
                    got = reader.read_flat(name, key, start, numel)
                    assert torch.equal(got, flat[start : start + numel]), (rank, name, key)
                    share += 4 * numel
        ratio = counted["bytes"] / share
        assert ratio <= 1.1, f"TP {saved_tp} -> {new_tp} rank {rank}: {ratio:.3f} x its share"


def test_corrupt_columns_are_found_by_the_rank_that_reads_them(tmp_path):
    """TP 1 -> 8: a flipped byte in the row-parallel weight's columns of TP rank 3 stops rank 3's read,
    naming the file; the other TP ranks read their columns of the same rows without reading that block."""
    manifest = write(tmp_path, 1, dp=1)
    path = tmp_path / "universal" / "rank00000.safetensors"
    with TensorFile(path) as f:
        at = f._begin[f._slot["proj"]]
    data = bytearray(path.read_bytes())
    data[at + 4 * (5 * 384 + 3 * 48 + 7)] ^= 1  # row 5, column 3 * 48 + 7: TP rank 3's
    path.write_bytes(bytes(data))
    for t in range(8):
        with UniversalReader(tmp_path, 8, t, manifest) as reader:
            if t == 3:
                with pytest.raises(
                    CheckpointError, match=r"rank00000.safetensors does not match its checksums"
                ):
                    reader.read_local("proj")
            else:
                assert torch.equal(reader.read_local("proj"), local("proj", "", 8, t))


def test_evaluation_and_export_read_the_tp_slice_alone(tmp_path, counted):
    """``read_local`` (what ``goat-dist eval`` reads per TP rank, ``ckpt export`` at TP 1) of a TP=1 x DP=2
    ZeRO-3 checkpoint at TP 8: each rank's values of every tensor, <= 1.1 x its TP slice (whole rows of
    the row-parallel weight: 3.4 x here); at TP 1, the whole model."""
    manifest = write(tmp_path, 1, dp=2)
    for tp in (8, 1):
        for t in range(tp):
            counted["bytes"] = 0
            with UniversalReader(tmp_path, tp, t, manifest) as reader:
                got = {name: reader.read_local(name) for name in PARAMS}
            for name, value in got.items():
                assert torch.equal(value, local(name, "", tp, t)), (tp, t, name)
            ratio = counted["bytes"] / sum(4 * v.numel() for v in got.values())
            assert ratio <= 1.1, f"TP {tp} rank {t}: {ratio:.3f} x its slice"
