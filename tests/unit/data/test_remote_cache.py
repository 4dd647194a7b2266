"""Remote shards within a budget: staged copies evicted least recently used within ``data.cache_max_gb``,
never one a reader pins (in this process or another), prefetched ahead of the reader so that no step
waits on a download once prefetching has started, in node-local scratch under Slurm; and the figure the
README quotes: what a node of a dp=512 job downloads against what its ranks read.

Remote sources are ``pipe:cat <dir>/{}`` over local data sets (``gopen`` runs the command, as it would
``aws s3 cp``): the cache cannot tell them from any other URL."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import numpy as np
import pytest
from harness.batches import batches, same

from data_tools.shard_format import read_manifest, write_manifest
from data_tools.writer import ShardWriter
from goat_dist.config import ConfigError
from goat_dist.data import remote_cache as remote_cache_module
from goat_dist.data import shard_index
from goat_dist.data.loader import build_train_loader
from goat_dist.data.reader import shard_sequence
from goat_dist.data.schedule import SourceSchedule
from goat_dist.data.shard_index import RECORD_NAME, RemoteCache, remote_cache_root

VOCAB = 60_000
SHARDS = 10
SEQ, MB = 64, 8


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """10 train shards of 40 KB (9 documents of 1,500 tokens each): ~26 micro-batches (of 8 windows of
    64 tokens) per shard."""
    root = tmp_path_factory.mktemp("remote-src")
    splits, pos = {}, 0
    for split, count in (("train", 9 * SHARDS), ("val", 2)):
        with ShardWriter(root, split, 0.03, vocab_size=VOCAB) as w:
            for d in range(count):
                w.write(f"doc-{d:05d}", np.arange(pos, pos + 1500) % VOCAB)
                pos += 1500
        splits[split] = w.shards
    assert len(splits["train"]) == SHARDS
    write_manifest(
        root, {"vocab_size": VOCAB, "dtype": "uint16", "tokenizer_sha256": "0" * 64, "splits": splits}
    )
    return root


@pytest.fixture(autouse=True)
def no_slurm(monkeypatch):
    """Outside a Slurm job: the cache lies where each test says."""
    for var in ("SLURM_JOB_ID", "SLURM_TMPDIR"):
        monkeypatch.delenv(var, raising=False)
    for key in shard_index.REMOTE_STATS:
        monkeypatch.setitem(shard_index.REMOTE_STATS, key, 0)


def train(data) -> list[dict]:
    return read_manifest(data)["splits"]["train"]


def url_of(data, entry) -> str:
    return f"pipe:cat {data}/{entry['name']}"


def budget_bytes(data, shards: int) -> int:
    cache = RemoteCache("unused")
    return shards * max(cache.need(e) for e in train(data)) + 1000


def staged_bytes(root: Path) -> int:
    """What the cache holds on disk: shards, their indexes, downloads under way (not the record)."""
    total = 0
    for path in root.rglob("*"):
        if not path.name.lstrip(".").startswith(RECORD_NAME):
            try:
                total += path.stat().st_size if path.is_file() else 0
            except FileNotFoundError:  # a temporary file renamed or deleted meanwhile
                pass
    return total


def loader(data, cache, **kw):
    kw = {
        "seq_len": SEQ,
        "micro_batch_size": MB,
        "seed": 3,
        "shuffle_buffer": 8,
        "window_order": "keyed",
        **kw,
    }
    return build_train_loader([f"pipe:cat {data}/{{}}"], dp_rank=0, dp_size=1, cache_dir=cache, **kw)


def epoch_batches(data) -> int:
    tokens = sum(e["n_tokens"] for e in train(data))
    return (tokens - 1) // SEQ // MB


def test_an_epoch_of_10_shards_in_a_budget_of_3_without_waiting(data, tmp_path, monkeypatch):
    """The cache never holds more than the budget (measured on disk after every step and whenever a
    download completes, when it is fullest), and once the first step is done (a long one, as a real first
    step is: compilation, communicator set-up; the prefetcher fills the cache meanwhile) no step waits on
    a download: the prefetcher keeps 2 shards ahead of the reader, evicting the shards it has passed."""
    root = tmp_path / "cache" / "remote"
    budget = budget_bytes(data, 3)
    peaks = []
    real_download = RemoteCache._download
    active = {"downloads": 0, "last": time.monotonic()}

    def measured(self, url, entry, dest):  # the cache is fullest when a download completes
        active["downloads"] += 1
        try:
            out = real_download(self, url, entry, dest)
        finally:
            active["downloads"] -= 1
            active["last"] = time.monotonic()
        peaks.append(staged_bytes(root))
        return out

    def training_step() -> None:
        """A step lasts at least as long as the downloads it overlaps: on a loaded machine starting
        ``pipe:cat`` alone can take longer than a short sleep, which would count a slow machine, not a
        prefetcher that fell behind. Over when no download has been under way for 0.2 s."""
        time.sleep(0.02)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (
            active["downloads"] or time.monotonic() - active["last"] < 0.2
        ):
            time.sleep(0.01)

    monkeypatch.setattr(RemoteCache, "_download", measured)
    expected = batches(_local(data), 1)
    it = iter(loader(data, tmp_path / "cache", cache_max_gb=budget / 1e9))
    assert same([next(it)], expected)  # the staged copy reads as the local data set
    assert shard_index.REMOTE_STATS["waits"] == 1  # the first shard: the stream and its prefetch begin
    deadline = time.monotonic() + 20
    while len(RemoteCache(root).record()["entries"]) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)  # the first step
    sizes = []
    for _ in range(epoch_batches(data) - 1):
        training_step()  # the prefetcher downloads meanwhile
        next(it)
        sizes.append(staged_bytes(root))
    del it
    record = RemoteCache(root).record()
    assert shard_index.REMOTE_STATS["waits"] == 1, "a step waited on a fetch after the first"
    assert max(sizes) <= budget and max(peaks) <= budget, (max(sizes), max(peaks), budget)
    # each shard of the epoch once; the prefetcher may have begun on the next epoch's first shards
    assert SHARDS <= record["downloads"] <= SHARDS + shard_index.PREFETCH_SHARDS
    assert record["evictions"] >= record["downloads"] - 3
    assert len(record["entries"]) <= 3 and sum(e["bytes"] for e in record["entries"].values()) <= budget


def _local(data):
    return build_train_loader(
        [str(data)], seq_len=SEQ, micro_batch_size=MB, dp_rank=0, dp_size=1, seed=3, shuffle_buffer=8,
        window_order="keyed", cache_dir=None,
    )  # fmt: skip


def test_no_budget_keeps_every_shard_as_before(data, tmp_path):
    cache = tmp_path / "cache"
    n = epoch_batches(data)
    assert same(batches(loader(data, cache, cache_max_gb=0), n), batches(_local(data), n))
    staged = sorted((cache / "remote").rglob("train-*.tar"))
    assert sorted(p.name for p in staged) == sorted(e["name"] for e in train(data))
    record = RemoteCache(cache / "remote").record()
    assert record["downloads"] == SHARDS and record["evictions"] == 0


def test_a_pinned_shard_is_never_evicted(data, tmp_path, monkeypatch):
    """Budget of 2 shards: a reader holds shard 0 (pinned), shards 1, 2, 3 pass through the rest."""
    entries = train(data)
    cache = RemoteCache(tmp_path / "remote", budget_bytes(data, 2))
    held = cache.acquire(url_of(data, entries[0]), entries[0])
    for e in entries[1:4]:
        cache.acquire(url_of(data, e), e).release()
        assert held.path.is_file()  # the least recently used, yet pinned
        assert staged_bytes(cache.root) <= cache.max_bytes
    assert not cache.place(url_of(data, entries[1]), entries[1])[1].exists()  # evicted instead
    # every staged shard pinned: a prefetcher gives up at once, a reader waits, then names the budget
    other = cache.acquire(url_of(data, entries[3]), entries[3])
    assert cache.acquire(url_of(data, entries[4]), entries[4], soft=True) is None
    monkeypatch.setattr(remote_cache_module, "SPACE_WAIT_S", 0.3)
    with pytest.raises(ConfigError, match=r"held open by readers.*data\.cache_max_gb="):
        cache.acquire(url_of(data, entries[4]), entries[4])
    held.release()
    cache.acquire(url_of(data, entries[4]), entries[4]).release()  # room now: shard 0 goes
    assert not held.path.exists() and other.path.is_file()
    other.release()


def _hold(root: str, url: str, entry: dict, ready, done) -> None:
    pin = RemoteCache(root, None).acquire(url, entry)
    ready.set()
    done.wait(30)
    pin.release()


def test_a_shard_pinned_by_another_process_is_never_evicted(data, tmp_path):
    """Pins are flocks: a DataLoader worker (another process) holding a shard keeps it staged."""
    entries = train(data)
    cache = RemoteCache(tmp_path / "remote", budget_bytes(data, 2))
    ctx = multiprocessing.get_context("fork")
    ready, done = ctx.Event(), ctx.Event()
    child = ctx.Process(
        target=_hold, args=(str(cache.root), url_of(data, entries[0]), entries[0], ready, done)
    )
    child.start()
    try:
        assert ready.wait(30)
        pinned = cache.place(url_of(data, entries[0]), entries[0])[1]
        for e in entries[1:4]:
            cache.acquire(url_of(data, e), e).release()
            assert pinned.is_file()
    finally:
        done.set()
        child.join(30)
    cache.acquire(url_of(data, entries[4]), entries[4]).release()
    assert not pinned.exists()  # its holder gone (the kernel dropped the flock): evictable again


def test_eviction_deletes_only_what_the_cache_recorded(data, tmp_path):
    """Files the cache did not write survive eviction, even in its own directories; a copy staged by an
    older version (no record) is adopted when used, and counts against the budget from then on."""
    entries = train(data)
    cache = RemoteCache(tmp_path / "remote", budget_bytes(data, 2))
    rel, legacy = cache.place(url_of(data, entries[0]), entries[0])
    legacy.parent.mkdir(parents=True)
    legacy.write_bytes((data / entries[0]["name"]).read_bytes())  # as the cache staged it before
    foreign = [cache.root / "notes.txt", legacy.parent / "mine.tar", cache.root / "x" / "train-000001.tar"]
    for path in foreign:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"not the cache's")
    cache.acquire(url_of(data, entries[0]), entries[0]).release()
    assert rel in cache.record()["entries"]
    for e in entries[1:5]:
        cache.acquire(url_of(data, e), e).release()
    assert not legacy.exists() and all(p.read_bytes() == b"not the cache's" for p in foreign)


def test_a_shard_larger_than_the_budget_is_named(data, tmp_path):
    with pytest.raises(ConfigError, match=r"remote shard .*/train-\d+\.tar takes .*data\.cache_max_gb=1e-05"):
        loader(data, tmp_path / "cache", cache_max_gb=0.00001)


def test_a_source_read_whole_needs_a_budget_that_holds_it(data, tmp_path):
    from goat_dist.data.schedule import WINDOW_ORDERS

    if "epoch" not in WINDOW_ORDERS:
        pytest.skip("no whole-epoch window order in this schedule")
    with pytest.raises(ConfigError, match=r"window_order=epoch.*data\.cache_max_gb="):
        loader(data, tmp_path / "cache", cache_max_gb=budget_bytes(data, 3) / 1e9, window_order="epoch")
    n = 20  # a budget that holds it: staged once, read as the local data set
    got = batches(
        loader(data, tmp_path / "cache", cache_max_gb=budget_bytes(data, 11) / 1e9, window_order="epoch"), n
    )
    local = build_train_loader(
        [str(data)], seq_len=SEQ, micro_batch_size=MB, dp_rank=0, dp_size=1, seed=3, shuffle_buffer=8,
        window_order="epoch", cache_dir=None,
    )  # fmt: skip
    assert same(got, batches(local, n))


def test_the_cache_goes_to_node_local_scratch_under_slurm(tmp_path):
    scratch, tmp = tmp_path / "slurm-tmp", tmp_path / "tmp"
    scratch.mkdir()
    tmp.mkdir()
    uid = os.getuid()
    job = {"SLURM_JOB_ID": "7"}
    assert remote_cache_root("~/c", env={**job, "SLURM_TMPDIR": str(scratch), "TMPDIR": str(tmp)}) == (
        scratch / f"goat-dist-remote-{uid}"
    )
    assert remote_cache_root("~/c", env={**job, "TMPDIR": str(tmp)}) == tmp / f"goat-dist-remote-{uid}"
    assert remote_cache_root(tmp_path, env={**job, "TMPDIR": str(tmp / "gone")}) == tmp_path / "remote"
    assert remote_cache_root(tmp_path, env={"TMPDIR": str(tmp)}) == tmp_path / "remote"  # not a Slurm job
    assert remote_cache_root(tmp_path, "/x/y", env={**job, "TMPDIR": str(tmp)}) == Path("/x/y")


def test_what_a_node_of_dp_512_downloads():
    """A node of 8 ranks of a dp=512 job (seq_len 4096, 64 MB shards of 32M tokens, window_order=keyed):
    its ranks read 8/512 of the windows, but those lie in every shard, so the node downloads the whole
    source each epoch (once per job when data.cache_max_gb holds it)."""
    shards, seq, dp, per_node = 200, 4096, 512, 8
    n_tokens = [32 * 2**20] * shards
    sched = SourceSchedule(n_tokens, seq, seed=1, source_index=0, shuffle_buffer=1024, window_order="keyed")

    class Split:  # what shard_sequence reads of a SourceSplit
        pass

    split = Split()
    split.n_tokens = n_tokens
    touched, cache = set(), {}
    samples = range(0, sched.windows - sched.windows % dp)
    node_samples = [n for n in samples if n % dp < per_node]
    for n in node_samples:
        touched.update(shard_sequence(split, sched, cache, n))
    read = len(node_samples) * (seq + 1) * 2
    downloaded = len(touched) * n_tokens[0] * 2
    assert len(touched) == shards  # every shard, so the whole source
    assert 63 < downloaded / read < 65  # ~ the number of nodes (64)


def test_the_run_config_reaches_both_loaders(monkeypatch):
    """``data.cache_max_gb`` and ``data.remote_cache_dir`` reach the training and validation loaders."""
    import torch

    from goat_dist.config import load_config
    from goat_dist.data import batches
    from goat_dist.distributed import Layout

    seen = []
    for name in ("build_train_loader", "build_val_loader"):
        monkeypatch.setattr(batches, name, lambda *a, _n=name, **kw: seen.append((_n, kw)))
    cfg = load_config(None, ["data.cache_max_gb=1.5", "data.remote_cache_dir=/scratch/goat"])
    layout = Layout(
        world=1, rank=0, local_rank=0, tp=1, dp=1, tp_rank=0, dp_rank=0, device=torch.device("cpu")
    )
    batches.train_loader(cfg, layout, [])
    batches.val_loader(cfg, layout, [])
    assert [(n, kw["cache_max_gb"], kw["remote_cache_dir"]) for n, kw in seen] == [
        ("build_train_loader", 1.5, "/scratch/goat"),
        ("build_val_loader", 1.5, "/scratch/goat"),
    ]
