"""Checkpoints that scale: the manifest's digests computed by every rank in parallel, a resume that reads
(and checks) each rank's share and nothing else, and asynchronous saves (``checkpoint.async``) that stage
in host memory, write in the background and publish only complete checkpoints."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import yaml
from harness.faults import fault_env, fault_override
from harness.multiproc import (
    ROOT,
    assert_config_is_the_runs,
    clean_env,
    goat_train_command,
    in_process_config,
    launch_command,
    per_step,
)
from harness.multiproc import run as run_cmd
from safetensors.torch import load_file

from goat_dist.checkpoint import manifest as manifest_file
from goat_dist.checkpoint import staging
from goat_dist.checkpoint.digests import read_manifest, shares
from goat_dist.checkpoint.errors import CheckpointError
from goat_dist.checkpoint.manager import verify, write_manifest
from goat_dist.checkpoint.safe_load import load as safe_load
from goat_dist.config import load_config
from goat_dist.distributed import free_port


# ---- config ----------------------------------------------------------------------------------------------
def test_async_key_is_checkpoint_async(tmp_path):
    """The documented key is ``checkpoint.async`` (a Python keyword): overrides and YAML files take it, the
    field is ``async_save`` (also accepted) and a wrong value is an error naming the key."""
    assert load_config(None, []).checkpoint.async_save is False
    assert load_config(None, ["checkpoint.async=true"]).checkpoint.async_save is True
    assert load_config(None, ["checkpoint.async_save=true"]).checkpoint.async_save is True
    path = tmp_path / "c.yaml"
    path.write_text("checkpoint:\n  async: true\n")
    cfg = load_config(path)
    assert cfg.checkpoint.async_save is True and getattr(cfg.checkpoint, "async") is True
    assert cfg.to_dict()["checkpoint"]["async_save"] is True  # config.yaml records it; reloading works
    with pytest.raises(Exception, match=r"checkpoint\.async' expects bool"):
        load_config(None, ["checkpoint.async=3"])


# ---- parallel digests --------------------------------------------------------------------------------------
def test_shares_are_deterministic_disjoint_and_balanced_by_bytes():
    sizes = {"a": 100, "b": 90, "c": 60, "d": 40, "e": 10, "f": 0}
    split = shares(sizes, 2)
    assert split == shares(dict(reversed(sizes.items())), 2)  # the order rank 0 listed them in is irrelevant
    assert sorted(n for part in split for n in part) == sorted(sizes)
    loads = [sum(sizes[n] for n in part) for part in split]
    assert loads == [150, 150]
    assert shares(sizes, 1) == [sorted(sizes, key=lambda n: (-sizes[n], n))]
    assert shares({"x": 5}, 3) == [["x"], [], []]


def fake_step_dir(root: Path) -> Path:
    step_dir = root / "step_00000007"
    (step_dir / "universal").mkdir(parents=True)
    for i, (name, size) in enumerate([("a.pt", 30000), ("b.bin", 20000), ("c.json", 100)]):
        (step_dir / name).write_bytes(bytes([i + 1]) * size)
    (step_dir / "universal" / "tp00.safetensors").write_bytes(b"u" * 25000)
    return step_dir


def test_verify_needs_no_process_group(tmp_path, monkeypatch):
    """``verify`` (goat-dist ckpt inspect, export) works in a process without a process group: it checks
    every file itself and names a corrupt one."""
    import torch.distributed as dist

    def no_collectives(*args, **kwargs):
        raise AssertionError("verify used a collective")

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "all_gather_object", no_collectives)
    step_dir = fake_step_dir(tmp_path)
    write_manifest(step_dir, {"step": 7})
    assert verify(step_dir)["step"] == 7
    data = bytearray((step_dir / "c.json").read_bytes())
    data[0] ^= 1
    (step_dir / "c.json").write_bytes(bytes(data))
    verify(step_dir, checksums=False)
    for parallel in (False, True):  # without a group, parallel=True is the same one-process check
        with pytest.raises(CheckpointError, match=r"\(step 7\): c\.json does not match its sha256"):
            verify(step_dir, parallel=parallel)


@pytest.mark.slow
def test_digests_are_computed_in_parallel_and_failures_reach_every_rank(tmp_path):
    """Two ranks: each hashes a share of the files (together every file once, the same digests one process
    computes, received by rank 0 alone, which writes the manifest; a file a writer already hashed is not
    read again); resume's check hashes in shares too, and a corrupt file or a failed write on one rank is
    the same CheckpointError, naming the file, on every rank."""
    step_dir = fake_step_dir(tmp_path)
    write_manifest(step_dir, {"step": 7})
    single = dict(read_manifest(step_dir)["files"])
    (step_dir / "manifest.json").unlink()
    worker = str(ROOT / "tests" / "workers" / "parallel_digests.py")
    port = free_port()
    procs = [  # two plain processes (no launcher): the cheapest 2-rank world
        subprocess.Popen(
            [sys.executable, worker, str(step_dir), str(tmp_path)],
            env=clean_env(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["files"] == single and ranks[1]["files"] == {}  # rank 0 alone receives the digests
    hashed = [set(r["hashed"]) for r in ranks]
    assert all(hashed) and not hashed[0] & hashed[1] and hashed[0] | hashed[1] == set(single)
    assert all(r["again_same"] for r in ranks)  # with a.pt's digest known on rank 1 ...
    assert "a.pt" not in ranks[0]["rehashed"] + ranks[1]["rehashed"]  # ... nobody reads it again
    resized = {r["resized"] for r in ranks}
    assert len(resized) == 1 and "a.pt has 30000 bytes on rank 0" in resized.pop()
    assert [r["intact"] for r in ranks] == ["ok", "ok"]
    corrupt = {r["corrupt"] for r in ranks}
    assert len(corrupt) == 1, corrupt  # the same message on both ranks
    message = corrupt.pop()
    assert "b.bin does not match its sha256" in message and "step 7" in message
    assert [r["sizes_only"] for r in ranks] == ["ok", "ok"]  # same size: only the checksum catches it
    assert {r["writer_failed"] for r in ranks} == {"disk full (found on rank 1)"}


# ---- what each rank of a large world reads at resume -------------------------------------------------------
@pytest.fixture(scope="module")
def zero3_dp64(tmp_path_factory):
    """A ZeRO-3 checkpoint of a TP=1 x DP=64 world (tests/workers/share_reads.py): a real small model's
    inventory, every rank's file written by the real writer."""
    from workers import share_reads

    from goat_dist import distributed

    distributed.init(tp=1)
    params = share_reads.inventory()
    step_dir = tmp_path_factory.mktemp("dp64") / "step_00000007"
    share_reads.write_world(step_dir, params, 64)
    return step_dir, params


def _figures(reads: list[dict]) -> str:
    ratio = [r["bytes"] / r["share_bytes"] for r in reads]
    files = [len(r["state_files"]) for r in reads]
    return (
        f"{len(reads)} ranks: state files opened {min(files)}-{max(files)}, all files opened "
        f"{min(len(r['opened']) for r in reads)}-{max(len(r['opened']) for r in reads)}, stat'ed "
        f"{max(len(r['stats']) for r in reads)} at most, read/share {min(ratio):.3f}-{max(ratio):.3f}, "
        f"share {reads[0]['share_bytes'] / 2**20:.2f} MiB, extra peak RSS <= "
        f"{max(r['extra_rss'] for r in reads) / 2**20:.2f} MiB"
    )


def test_a_same_layout_zero3_resume_reads_only_each_ranks_own_file(zero3_dp64):
    """Every rank of the DP=64 ZeRO-3 world resuming on the same layout opens the manifest, the part of it
    listing its 8 ranks' files, the run state, its RNG file, the index and its own state file, each once:
    no other rank's file is opened or stat'ed; it reads <= 1.1 x its share (the fp32 value and both
    moments of its partitions; measured 1.025-1.031: the manifest, index, its file's header and
    checksums), every element as saved. Before: ranks 0-63 of a 30B world opened 18 files 7,900-9,600
    times, and every rank stat'ed every file and hashed another's."""
    from workers import share_reads

    step_dir, params = zero3_dp64
    reads = [share_reads.read_rank(step_dir, params, 64, rank) for rank in range(64)]
    print(_figures(reads))
    for rank, r in enumerate(reads):
        own = f"universal/rank{rank:05d}.safetensors"
        part = manifest_file.part_name(rank // manifest_file.RANKS_PER_PART)  # its 8 ranks' digests
        expected = [
            "manifest.json",
            part,
            "trainer_state.json",
            f"rng_rank{rank}.pt",
            "universal/index.json",
            own,
        ]
        assert sorted(r["opened"]) == sorted(expected), f"rank {rank}: {r['opened']}"
        assert set(r["stats"]) <= set(r["opened"]), f"rank {rank} stat'ed {r['stats']}"
        assert r["bytes"] <= 1.1 * r["share_bytes"], f"rank {rank}: {r['bytes']} bytes for {r['share_bytes']}"
        assert r["exact"] and r["rng"], f"rank {rank}"
        assert r["extra_rss"] <= 8 << 20, f"rank {rank}: +{r['extra_rss'] / 2**20:.1f} MiB"


@pytest.mark.parametrize("dp", [32, 128], ids=["dp64-to-dp32", "dp64-to-dp128"])
def test_a_dp_change_opens_each_file_it_reads_once(zero3_dp64, dp):
    """The same checkpoint resumed by every rank of DP=32 (each partition is two saved ones) and of DP=128
    (half of one; the smallest parameters' single elements lie on other ranks): each rank opens the <= 3
    (<= 2) state files holding its ranges, each once, stats nothing else, reads no RNG file (another layout
    starts from the run's seed) and <= 1.1 x its share (measured <= 1.024 and <= 1.08: reads are rounded to
    the checksum blocks around them, and each file read costs its header)."""
    from workers import share_reads

    step_dir, params = zero3_dp64
    reads = [share_reads.read_rank(step_dir, params, dp, rank) for rank in range(dp)]
    print(_figures(reads))
    for rank, r in enumerate(reads):
        assert len(r["opened"]) == len(set(r["opened"])), f"rank {rank} opened a file twice: {r['opened']}"
        assert 1 <= len(r["state_files"]) <= (3 if dp < 64 else 2), f"rank {rank}: {r['state_files']}"
        assert set(r["stats"]) <= set(r["opened"]), f"rank {rank} stat'ed {r['stats']}"
        assert r["bytes"] <= 1.1 * r["share_bytes"], f"rank {rank}: {r['bytes']} bytes for {r['share_bytes']}"
        assert r["exact"] and not r["rng"], f"rank {rank}"


@pytest.fixture(scope="module")
def zero3_tp8_dp8(tmp_path_factory):
    """The same model saved by a TP=8 x DP=8 ZeRO-3 world (64 files)."""
    from workers import share_reads

    from goat_dist import distributed

    distributed.init(tp=1)
    params = share_reads.inventory()
    step_dir = tmp_path_factory.mktemp("tp8dp8") / "step_00000007"
    share_reads.write_world(step_dir, params, 8, tp=8)
    return step_dir, params


TP_CHANGES = [("tp1-to-tp2", 1, 2), ("tp1-to-tp8", 1, 8), ("tp8-to-tp1", 8, 1)]


@pytest.mark.parametrize("name,saved_tp,tp", TP_CHANGES, ids=[c[0] for c in TP_CHANGES])
def test_a_tp_change_reads_only_the_columns_and_rows_it_keeps(zero3_dp64, zero3_tp8_dp8, name, saved_tp, tp):
    """64 ranks resume a 64-rank ZeRO-3 checkpoint at another TP (DP = 64 / TP); every fifth rank (every TP
    rank, most replicas) is checked. The row-parallel weights (attention output, fc2) are read as
    column ranges of their rows, one strided read per saved row, against checksum blocks aligned to those
    columns (``universal.checksum_blocks``): the data and checksums read are <= 1.1 x the share (measured
    TP 1 -> 2 1.022-1.028, 1 -> 8 1.022-1.029, 8 -> 1 1.025-1.032; whole rows: 1.22 x at 1 -> 2 and 2.4 x at
    1 -> 8). On top come the
    headers of the files a rank opens, a fixed ~27 KB each: a rank of another TP needs rows that DP=64's
    partitions spread over 8 files, so with this model's 3 MB shares all its reads are 1.04-1.12 x
    the share (at 30B the same headers are < 1 %: ``test_the_30b_config_..._across_tp_sizes``). Every
    element arrives as saved."""
    from workers import share_reads

    step_dir, params = zero3_dp64 if saved_tp == 1 else zero3_tp8_dp8
    dp = 64 // tp
    reads = [share_reads.read_rank(step_dir, params, dp, rank, tp=tp) for rank in range(0, 64, 5)]
    data = [(r["bytes"] - r["header_bytes"]) / r["share_bytes"] for r in reads]
    print(name, _figures(reads), f"without the headers {min(data):.3f}-{max(data):.3f}")
    for r, ratio in zip(reads, data):
        rank = r["rank"]
        assert len(r["opened"]) == len(set(r["opened"])), f"rank {rank} opened a file twice: {r['opened']}"
        assert set(r["stats"]) <= set(r["opened"]), f"rank {rank} stat'ed {r['stats']}"
        assert ratio <= 1.1, f"rank {rank}: {ratio:.3f} x its share besides the headers"
        assert r["bytes"] <= 1.2 * r["share_bytes"], f"rank {rank}: {r['bytes']} bytes for {r['share_bytes']}"
        assert r["exact"] and not r["rng"], f"rank {rank}"


@pytest.fixture(scope="module")
def zero1_dp64(tmp_path_factory):
    """The same model saved by a TP=1 x DP=64 ZeRO-1 world: each rank's file a contiguous 1/64 of the
    flattened parameters (a few whole ones and parts), listed in the index."""
    from workers import share_reads

    from goat_dist import distributed

    distributed.init(tp=1)
    params = share_reads.inventory()
    step_dir = tmp_path_factory.mktemp("zero1dp64") / "step_00000007"
    share_reads.write_world(step_dir, params, 64, stage=1)
    return step_dir, params


@pytest.mark.parametrize("saved,stage", [(1, 3), (3, 1)], ids=["zero1-to-zero3", "zero3-to-zero1"])
def test_a_zero_stage_change_opens_only_the_files_of_its_share(zero3_dp64, zero1_dp64, saved, stage):
    """Every rank of the DP=64 world resumes the other ZeRO stage's checkpoint by file (``exchange.Exchange``;
    tests/workers/share_reads.py plays the all-to-all): it opens one state file (its own: the same DP) and
    the four run files (the manifest's part listing it among them), reads <= 1.1 x its share, and every
    element reaches its owner as saved (measured 1.013-1.026). Read directly, a rank's share lies in
    pieces of most files: rank 63 opens 23 state files at ZeRO 1 -> 3 and 64 at 3 -> 1 here (sampled ranks
    of the 30B config on 512: 221-287 and 98-512, and 1.6-2.7 x the share at 1 -> 3, its blocks being 1/64
    of a piece)."""
    from workers import share_reads

    step_dir, params = zero1_dp64 if saved == 1 else zero3_dp64
    direct = share_reads.read_rank(step_dir, params, 64, 63, stage=stage)
    assert len(direct["state_files"]) > 2 and direct["exact"]  # what the exchange spares
    reads = share_reads.read_world_by_file(step_dir, params, 64, stage)
    print(
        f"ZeRO {saved} -> {stage}: direct rank 63 opened {len(direct['state_files'])}; by file:",
        _figures(reads),
    )
    for rank, r in enumerate(reads):
        assert r["state_files"] == [f"universal/rank{rank:05d}.safetensors"], (
            f"rank {rank}: {r['state_files']}"
        )
        assert len(r["opened"]) == len(set(r["opened"])) == 5, f"rank {rank}: {r['opened']}"
        assert set(r["stats"]) <= set(r["opened"]), f"rank {rank} stat'ed {r['stats']}"
        assert r["bytes"] <= 1.1 * r["share_bytes"], f"rank {rank}: {r['bytes']} bytes for {r['share_bytes']}"
        assert r["exact"], f"rank {rank}"


@pytest.fixture(scope="module")
def params_30b(world1):
    """{name: split and shape} of configs/models/goat_30b.yaml at TP=1 (built on the meta device)."""
    from workers import share_reads

    return share_reads.inventory_30b()


def test_the_30b_config_on_512_ranks_finds_its_pieces_in_a_small_index(params_30b, tmp_path):
    """configs/models/goat_30b.yaml (963 parameters, 30.0B elements) saved by TP=1 x DP=512 under ZeRO-3,
    planned without its 360 GB (tests/workers/share_reads.py: the real index writer and reader over
    stand-in files): index.json is 128 KB and parses into 0.6 MB, where the full list earlier releases wrote
    beside it (meta.json, no longer written) is 4.4 MB and ~100 MB parsed; what rank 0 writes of the state
    but its share, and every rank reads, does not grow from DP=64 to DP=512 (128,331 and 128,075 B: the
    files' names and grid are rules; listed, they grew by 27 B per rank, 142 KB at 512; with the full list
    8.1 KB per rank, a piece of every parameter); on the same layout a rank opens its
    own file alone and reads 1.0005-1.0007 x its share (its header and checksums); at DP=1024 and DP=256
    each rank opens the <= 2 files holding its ranges, once each, and reads <= 1.006 x its share (1.0050 at
    DP=1024 rank 1, half of each saved piece: 1.0049 before the row-aligned checksums of the row-parallel
    weights, whose table and header entries add 0.01 %)."""
    import tracemalloc

    from workers import share_reads

    params = params_30b
    assert len(params) == 963 and 29.9e9 < sum(math.prod(m["shape"]) for m in params.values()) < 30.1e9
    index, manifest = share_reads.plan_world(tmp_path, params, 512)
    text = (tmp_path / "universal" / "index.json").read_text()
    tracemalloc.start()
    json.loads(text)
    parsed = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    meta_bytes = manifest["meta_json_bytes"]
    print(f"index.json {len(text):,} B (parsed {parsed / 2**20:.2f} MiB), meta.json {meta_bytes:,} B")
    assert len(text) < 256_000 and parsed < 4 << 20 and manifest["meta_json_bytes"] > 4_000_000
    _, manifest64 = share_reads.plan_world(tmp_path / "dp64", params, 64)
    written = {dp: sum(f.stat().st_size for f in (root / "universal").iterdir())  # universal.write_index's
               for dp, root in ((64, tmp_path / "dp64"), (512, tmp_path))}  # fmt: skip
    per_rank = (written[512] - written[64]) / (512 - 64)
    full_per_rank = (meta_bytes - manifest64["meta_json_bytes"]) / (512 - 64)
    print(f"rank 0 writes {written[64]:,} B at DP=64, +{per_rank:.1f} B per rank (was {full_per_rank:,.0f})")
    assert per_rank < 1 and full_per_rank > 4000
    assert "files" not in index and index["grid"] == {"tp_inner": True}
    assert all(isinstance(rule, dict) for rule in index["pieces"].values())  # ZeRO-3: one rule each
    for dp, ranks, most in ((512, (0, 1, 63, 64, 511), 1), (1024, (0, 1, 1023), 2), (256, (255,), 2)):
        for rank in ranks:
            plan = share_reads.plan_rank(tmp_path, params, manifest, dp, rank)
            where = f"DP={dp} rank {rank}: {plan['files']}"
            assert len(plan["files"]) == len(set(plan["files"])) <= most, where
            if dp == 512:
                assert plan["files"] == [f"universal/rank{rank:05d}.safetensors"], where
            assert plan["bytes"] <= 1.006 * plan["share_bytes"], (
                f"{where}: {plan['bytes'] / plan['share_bytes']}"
            )


def test_the_30b_config_on_512_ranks_reads_its_share_across_tp_sizes(params_30b, tmp_path):
    """configs/models/goat_30b.yaml planned at 512 ranks (tests/workers/share_reads.py), saved by TP=1 x
    DP=512 and resumed by TP=8 x DP=64, and saved by TP=8 x DP=64 and resumed by TP=1 x DP=512: sampled
    ranks read <= 1.1 x their share (measured 1.004-1.006 and 1.005-1.007 with the 8-11 files' headers;
    whole rows: 3.45 x at TP 1 -> 8)."""
    from workers import share_reads

    params = params_30b
    for saved_tp, tp, ranks in ((1, 8, (7,)), (8, 1, (511,))):  # rank 7: 11 files, the most sampled
        root = tmp_path / f"tp{saved_tp}"
        _, manifest = share_reads.plan_world(root, params, 512 // saved_tp, tp=saved_tp)
        for rank in ranks:
            plan = share_reads.plan_rank(root, params, manifest, 512 // tp, rank, tp=tp)
            ratio = plan["bytes"] / plan["share_bytes"]
            print(f"TP {saved_tp} -> {tp} rank {rank}: {len(plan['files'])} files, {plan['reads']} reads, "
                  f"{ratio:.4f} x its share")  # fmt: skip
            assert len(plan["files"]) == len(set(plan["files"])), plan["files"]
            assert ratio <= 1.1, f"TP {saved_tp} -> {tp} rank {rank}: {ratio:.3f} x its share"


def test_the_30b_config_on_512_ranks_changes_zero_stage_opening_one_file_per_rank(params_30b, tmp_path):
    """configs/models/goat_30b.yaml planned at DP=512 (tests/workers/share_reads.py), saved at ZeRO-1 and
    resumed at ZeRO-3 and the other way, read by file (``exchange.Exchange``): sampled ranks open one state
    file (<= 2 asked) and read <= 1.1 x their share (measured 1.0000-1.0008); read directly they open
    98-512 and read up to 2.7 x. The ZeRO-1 index gives every parameter's pieces as a rule (``flat``: its
    run of partitions), so it grows only by digits from DP=64 to DP=512 (136,234 -> 138,127 B, 4 B per
    rank; listed: 134,337 -> 159,166 B, 55 B per rank)."""
    from workers import share_reads

    params = params_30b
    share_reads.plan_world(tmp_path / "zero1-dp64", params, 64, stage=1)
    sizes = {64: (tmp_path / "zero1-dp64" / "universal" / "index.json").stat().st_size}
    for saved, stage in ((1, 3), (3, 1)):
        root = tmp_path / f"zero{saved}"
        index, manifest = share_reads.plan_world(root, params, 512, stage=saved)
        for rank in (0, 255):  # rank 255 of ZeRO-1 asks all 512 readers
            plan = share_reads.plan_rank(root, params, manifest, 512, rank, stage=stage, by_file=True)
            ratio = plan["bytes"] / plan["share_bytes"]
            print(f"ZeRO {saved} -> {stage} rank {rank}: {len(plan['files'])} files, {ratio:.4f} x share, "
                  f"asks {plan['peers']} ranks")  # fmt: skip
            assert plan["files"] == [f"universal/rank{rank:05d}.safetensors"], plan["files"]
            assert ratio <= 1.1, f"ZeRO {saved} -> {stage} rank {rank}: {ratio:.3f} x its share"
        if saved == 1:
            sizes[512] = (root / "universal" / "index.json").stat().st_size
            assert all(isinstance(rule, dict) for rule in index["pieces"].values())  # none listed
    print(f"ZeRO-1 index.json: {sizes[64]:,} B at DP=64, {sizes[512]:,} B at DP=512")
    assert sizes[512] <= sizes[64] + 8 * (512 - 64), sizes


EVAL_MODEL = [  # 330 MiB of fp32 weights, the largest tensor 12 MiB
    "model.num_layers=12",
    "model.hidden_size=768",
    "model.num_heads=12",
    "model.vocab_size=4096",
    "model.seq_len=64",
    "model.position=goat",
    "model.attention_backend=sdpa",
]


def write_tp2_checkpoint(step_dir: Path, cache: Path) -> tuple[int, int]:
    """A TP=2 checkpoint of EVAL_MODEL's initial weights as a TP=2 x DP=1 run saves it (the real writer,
    index and manifest); returns (the model's fp32 bytes, its largest tensor's bytes)."""
    from goat_dist.checkpoint import universal
    from goat_dist.checkpoint.digests import digest, listing
    from goat_dist.engine.masters import KEYS
    from goat_dist.model import GPT

    cfg = load_config(None, [*EVAL_MODEL, f"data.cache_dir={cache}"])
    torch.manual_seed(0)
    full = {name: p.detach() for name, p in GPT(cfg.model).named_parameters()}
    splits = {name: universal.split_meta(p) for name, p in GPT(cfg.model).named_parameters()}
    udir = step_dir / "universal"
    udir.mkdir(parents=True)
    gathered, known, params = [], {}, {}
    for rank in range(2):
        local = {name: universal.split(t, splits[name], 2, rank) for name, t in full.items()}
        params = {name: {**splits[name], "shape": list(t.shape)} for name, t in local.items()}
        pieces = [(name, 0, t.numel(), {k: (name, k) for k in KEYS}) for name, t in local.items()]
        path = udir / universal.file_name(rank)

        def host(ref, local=local):
            name, key = ref
            return local[name].reshape(-1).float() * (1.0 if not key else 0.1 if key == "exp_avg" else 0.01)

        known[f"universal/{path.name}"] = universal.write_share(path, pieces, rank, 1, host)
        gathered.append({"file": path.name, "tp": rank, "replica": 0, "pieces": [p[:3] for p in pieces]})
    universal.write_index(udir, params, gathered, 2, {"step": 1, "adam_step": 1, "lr_step": 1, "engine": {}})
    layout = {"world": 2, "tp": 2, "dp": 1, "zero_stage": 0, "precision": "fp32", "param_groups": ["decay"]}
    (step_dir / "trainer_state.json").write_text(json.dumps({"step": 1, **layout}))
    (step_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    files = {name: digest(step_dir / name) for name in listing(step_dir) if name not in known}
    write_manifest(step_dir, {"step": 1}, files={**files, **known})
    return 4 * sum(t.numel() for t in full.values()), 4 * max(t.numel() for t in full.values())


@pytest.mark.slow
def test_sharded_eval_and_streamed_export_hold_a_slice_and_a_tensor(world1, builtin_cache, tmp_path):
    """``goat-dist eval ppl`` on 2 ranks at TP=2 from a TP=2 checkpoint of a 327 MiB (fp32) model: each rank
    reads its own file's values only, straight into its model; its peak host RSS while building and loading
    its model stays <= 0.6 x the model's fp32 size (measured 0.52-0.56: its slice 0.50, the model's
    construction and one tensor), and so does the whole evaluation (0.53-0.56; 0.60-0.62 while glibc kept
    the freed activation buffers of a batch in its heap, ``session.free_large_buffers_at_once``; 0.67-0.71
    while rank 0 drew the report figure holding its weights). The libraries' code pages are loaded before
    the baselines (``tests/workers/eval_rss.py``: on one machine they were 0.07 of the 0.62 measured).
    Before, every rank read the whole TP-merged model: 1.60 x.
    ``ckpt export`` (goat and Hugging Face formats) streams tensor by tensor: peak RSS <= the largest tensor
    + 256 MiB (measured 21-23 MiB, the largest tensor being 12 MiB; before, 341 and 406 MiB)."""
    from data_tools.builtin import builtin_dataset_dir

    step_dir = tmp_path / "run" / "checkpoints" / "step_00000001"
    model_bytes, largest = write_tp2_checkpoint(step_dir, builtin_cache)
    assert model_bytes > 300 << 20
    data = builtin_dataset_dir(builtin_cache, 4096, 1_000_000)
    worker = str(ROOT / "tests" / "workers" / "eval_rss.py")
    rss = tmp_path / "rss"
    args = ["ppl", "--checkpoint", str(step_dir), "--tp", "2", "--data", str(data), "--lengths", "64"]
    args += ["--tokens", "256", "--batch-tokens", "256", "--out", str(tmp_path / "ppl")]
    run_cmd(launch_command(2, [worker, str(rss / "eval"), "eval", *args]))
    ranks = [json.loads((rss / "eval" / f"rank{r}.json").read_text()) for r in (0, 1)]
    print("eval: load peak / model", [round(r["load_extra_bytes"] / model_bytes, 3) for r in ranks],
          "whole eval", [round(r["extra_bytes"] / model_bytes, 3) for r in ranks])  # fmt: skip
    for r in ranks:
        assert r["params"] * 4 < 0.55 * model_bytes  # its slice (the command exited 0: run_cmd checks)
        assert r["load_extra_bytes"] <= 0.6 * model_bytes, r
        assert r["extra_bytes"] <= 0.6 * model_bytes, r
    assert (tmp_path / "ppl").is_dir()
    for fmt in ("goat", "hf"):
        out = tmp_path / f"export-{fmt}"
        run_cmd(
            [
                sys.executable,
                worker,
                str(rss / fmt),
                "ckpt",
                "export",
                str(step_dir),
                str(out),
                "--format",
                fmt,
            ]
        )
        r = json.loads((rss / fmt / "rank0.json").read_text())
        print(
            f"export {fmt}: peak {r['extra_bytes'] / 2**20:.1f} MiB, largest tensor {largest / 2**20:.1f} MiB"
        )
        assert r["code"] == 0 and r["extra_bytes"] <= largest + (256 << 20), r
    exported = load_file(tmp_path / "export-goat" / "model.safetensors")
    with torch.no_grad():
        torch.manual_seed(0)
        from goat_dist.model import GPT

        expected = dict(GPT(load_config(None, EVAL_MODEL).model).named_parameters())
    assert exported.keys() == expected.keys()
    assert all(torch.equal(exported[k], expected[k]) for k in expected)


# ---- asynchronous saves ----------------------------------------------------------------------------------
def test_staging_copies_keep_storage_sharing_and_stop_following_training():
    """The staged copy shares storage where the state did (a tied embedding, views into one flat buffer),
    keeps parameters parameters, and no longer changes when training updates the originals in place."""
    w, flat = torch.randn(10, 4), torch.randn(64)
    state = {"emb": w, "out": w, "a": flat[:8].view(2, 4), "b": [flat[8:40]], "p": torch.nn.Parameter(w[0])}
    staged = staging.stage(state)
    ptr = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    assert ptr(staged["emb"]) == ptr(staged["out"]) != ptr(w)
    assert ptr(staged["a"]) == ptr(staged["b"][0]) and staged["b"][0].storage_offset() == 8
    assert isinstance(staged["p"], torch.nn.Parameter)
    expected = {k: v.clone() for k, v in state.items() if k != "b"}
    w.add_(1.0)
    flat.zero_()
    for k, v in expected.items():
        assert torch.equal(staged[k], v), k


# log.peak_tflops set: no CPU matmul probe, which draws from torch's RNG in the first run of a session only
ASYNC_RUN = [
    "train.max_steps=4",
    "checkpoint.interval=2",
    "checkpoint.keep_last=0",
    "log.interval=1",
    "log.peak_tflops=1",
]


def same(a, b, where: str) -> None:
    assert type(a) is type(b), f"{where}: {type(a)} vs {type(b)}"
    if isinstance(a, torch.Tensor):
        bits = [t.detach().contiguous().view(-1).view(torch.uint8) for t in (a, b)]  # bitwise, NaN too
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(*bits), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        same(vars(a), vars(b), where)
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def assert_same_checkpoint(sync_dir: Path, async_dir: Path) -> None:
    """Every file of both has the same content: torch files unpickled (their zip archives carry a random
    serialization id), safetensors tensor by tensor, the rest byte for byte."""
    files = read_manifest(sync_dir)["files"]
    assert read_manifest(async_dir)["files"].keys() == files.keys()
    for name in files:
        a, b = sync_dir / name, async_dir / name
        if name.endswith(".pt"):
            same(safe_load(a), safe_load(b), name)
        elif name.endswith(".safetensors"):
            same(load_file(a), load_file(b), name)
        elif name == "config.yaml":  # the runs differ in these two keys only
            configs = [yaml.safe_load(p.read_text()) for p in (a, b)]
            for c in configs:
                del c["run"]["dir"], c["checkpoint"]["async_save"]
            assert configs[0] == configs[1]
        elif name == "trainer_state.json":  # and in the wall-clock time they took
            states = [json.loads(p.read_text()) for p in (a, b)]
            for s in states:
                del s["run_state"]["elapsed_s"]
            assert states[0] == states[1]
        else:
            assert a.read_bytes() == b.read_bytes(), name


def test_async_checkpoints_equal_sync_ones_and_resume_the_same(world1, builtin_cache, tmp_path):
    """checkpoint.async=true: the checkpoints hold exactly what a synchronous save writes (every rank's
    share of universal/, RNG, run state), every one is published, and a resume from one continues with the
    uninterrupted run's losses. ``latest`` names a checkpoint with a manifest at every step boundary."""
    from goat_dist.trainer.callbacks import Callback
    from goat_dist.trainer.trainer import Trainer

    sync_run, async_run, resumed = tmp_path / "sync", tmp_path / "async", tmp_path / "resumed"
    Trainer(in_process_config(builtin_cache, sync_run, *ASYNC_RUN)).fit()

    class LatestIsComplete(Callback):
        """At every step boundary and at every publication (when a background write finishes is the
        machine's business: the step-2 save may be published at step 3's boundary or only when step 4's
        save waits for it), ``latest`` names a complete checkpoint."""

        seen: list = []

        def check(self):
            pointer = async_run / "checkpoints" / "latest"
            if pointer.is_file():
                tag = pointer.read_text()
                verify(async_run / "checkpoints" / tag)
                self.seen.append(tag)

        def on_log(self, state, metrics):
            self.check()

        def on_checkpoint(self, state, info):
            self.check()

    trainer = Trainer(in_process_config(builtin_cache, async_run, *ASYNC_RUN, "checkpoint.async=true"))
    trainer.callbacks.append(LatestIsComplete())
    trainer.fit()
    assert trainer.checkpoints.pending is None
    assert (async_run / "checkpoints" / "latest").read_text() == "step_00000004"
    assert "step_00000002" in LatestIsComplete.seen
    events = [json.loads(line) for line in (async_run / "metrics.jsonl").read_text().splitlines()]
    published = [e for e in events if e.get("event") == "checkpoint"]
    assert [Path(e["path"]).name for e in published] == ["step_00000002", "step_00000004"]
    assert all(e["pause_s"] <= e["save_s"] for e in published)
    for tag in ("step_00000002", "step_00000004"):
        assert_same_checkpoint(sync_run / "checkpoints" / tag, async_run / "checkpoints" / tag)

    start = async_run / "checkpoints" / "step_00000002"
    Trainer(in_process_config(builtin_cache, resumed, *ASYNC_RUN, f"train.resume={start}")).fit()
    assert_config_is_the_runs(resumed)
    expected, got = per_step(sync_run), per_step(resumed)
    assert min(got) == 3
    for step in (3, 4):
        assert got[step] == expected[step], f"step {step}: {got[step]} vs {expected[step]}"


def async_trainer(cache: Path, run_dir: Path):
    """A 2-step async run, finished (latest: step 2), to save more checkpoints from by hand."""
    from goat_dist.trainer.trainer import Trainer

    trainer = Trainer(in_process_config(cache, run_dir, "train.max_steps=2", "checkpoint.async=true"))
    trainer.fit()
    return trainer


def test_latest_moves_only_after_every_background_write(world1, builtin_cache, tmp_path, monkeypatch):
    """While an async save's files are still being written, the previous checkpoint stays ``latest`` and the
    new one has no manifest; ``poll`` does not publish it; once the writes finish, ``wait`` does."""
    trainer = async_trainer(builtin_cache, tmp_path)
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text() == "step_00000002"
    gate = threading.Event()
    submit = staging.BackgroundWriter.submit

    def gated(self, path, write):
        def held(p):
            assert gate.wait(60)
            write(p)

        submit(self, path, held)

    monkeypatch.setattr(staging.BackgroundWriter, "submit", gated)
    trainer.state.step = 3
    step_dir = trainer.save_checkpoint()
    assert step_dir.name == "step_00000003" and trainer.checkpoints.pending is not None
    assert (root / "latest").read_text() == "step_00000002"
    assert not (step_dir / "manifest.json").exists()
    assert trainer.checkpoints.poll() is None and trainer.checkpoints.pending is not None
    # the next save waits for the pending one and publishes it first (here: once the writes are let go)
    threading.Timer(0.5, gate.set).start()
    trainer.state.step = 4
    trainer.save_checkpoint()
    assert (root / "latest").read_text() == "step_00000003"
    verify(step_dir)
    assert trainer.checkpoints.pending.step_dir.name == "step_00000004"
    assert trainer.checkpoints.wait().name == "step_00000004"
    assert (root / "latest").read_text() == "step_00000004"


def test_a_failed_background_write_is_an_error_and_publishes_nothing(
    world1, builtin_cache, tmp_path, monkeypatch
):  # noqa: E501
    trainer = async_trainer(builtin_cache, tmp_path)
    submit = staging.BackgroundWriter.submit

    def failing(self, path, write):
        def broken(p):
            raise OSError(28, "No space left on device")

        submit(self, path, broken if Path(path).name.startswith("rng") else write)

    monkeypatch.setattr(staging.BackgroundWriter, "submit", failing)
    trainer.state.step = 3
    trainer.save_checkpoint()
    with pytest.raises(CheckpointError, match=r"writing rng_rank0\.pt failed: OSError.*No space left"):
        trainer.checkpoints.wait()
    assert trainer.checkpoints.pending is None
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_00000002"


@pytest.mark.slow
def test_crash_while_async_writes_are_in_flight_keeps_previous_latest(tmp_path, builtin_cache):
    """A real crash (SIGKILL) after the first file of step 4's background write: step 2 stays latest and
    intact, step 4 has no manifest."""
    run_dir = tmp_path / "run"
    overrides = [
        "train.max_steps=6",
        "checkpoint.interval=2",
        "checkpoint.async=true",
        f"data.cache_dir={builtin_cache}",
        f"run.dir={run_dir}",
    ]
    overrides.append(fault_override("KillMidAsyncWrite:4"))
    proc = run_cmd(goat_train_command(1, overrides), expect=None, **fault_env())
    assert proc.returncode != 0
    root = run_dir / "checkpoints"
    assert (root / "latest").read_text() == "step_00000002"
    verify(root / "step_00000002")
    assert (root / "step_00000004").is_dir() and not (root / "step_00000004" / "manifest.json").exists()


def test_a_stop_signal_with_async_saves_publishes_before_returning(world1, builtin_cache, tmp_path):
    """A preemption signal (here: the flag SIGTERM sets) with checkpoint.async: the stop's checkpoint is
    published before the loop returns, as with synchronous saves."""
    from goat_dist.trainer.trainer import Trainer

    cfg = in_process_config(builtin_cache, tmp_path, "train.max_steps=50", "checkpoint.async=true")
    trainer = Trainer(cfg)
    trainer.signals.received = "SIGTERM"
    state = trainer.fit()
    assert state.stop_requested == "SIGTERM" and state.step == 1
    assert trainer.checkpoints.pending is None
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_00000001"
    verify(tmp_path / "checkpoints" / "step_00000001")


def test_a_callbacks_save_and_stop_requests_are_honoured_at_that_step(world1, builtin_cache, tmp_path):
    """A callback asks for a save in step 2 and for a stop in step 3 (``post_backward``: that step's one
    collective carries them): both steps are saved, and the loop stops after step 3 with the reason."""
    from goat_dist.trainer.callbacks import Callback
    from goat_dist.trainer.trainer import Trainer

    class Requests(Callback):
        stops: list = []

        def post_backward(self, state):
            if state.step + 1 == 2:
                self.trainer.request_save()
            if state.step + 1 == 3:
                self.trainer.request_stop("enough")

        def on_stop(self, state, reason):
            self.stops.append((state.step, reason))

    trainer = Trainer(in_process_config(builtin_cache, tmp_path, "train.max_steps=50"))
    trainer.add_callback(Requests())
    state = trainer.fit()
    assert state.stop_requested == "enough" and state.step == 3 and Requests.stops == [(3, "enough")]
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_00000003"
    verify(tmp_path / "checkpoints" / "step_00000002")


def test_pinned_staging_buffers_are_reused_by_the_next_save_and_cpu_ones_freed(monkeypatch):
    """On CUDA the staging buffers are pinned and kept for the next save once the write finished (README);
    pinning itself needs CUDA, so here allocation is a stand-in that records the request."""
    requested = []
    real_empty = torch.empty

    def empty(*shape, pin_memory=False, **kw):
        requested.append(pin_memory)
        return real_empty(*shape, **kw)

    monkeypatch.setattr(staging.torch, "empty", empty)
    pinned = staging.HostBuffers()
    pinned.pin = True
    first = [pinned.take(64), pinned.take(128)]
    pinned.release()  # the write finished
    again = [pinned.take(128), pinned.take(64)]
    assert {b.data_ptr() for b in again} == {b.data_ptr() for b in first}  # reused, no new allocation
    assert requested == [True, True]
    cpu = staging.HostBuffers()
    assert not cpu.pin
    cpu.take(64)
    cpu.release()
    cpu.take(64)
    assert requested == [True, True, False, False]  # nothing kept on CPU: a fresh buffer per save
