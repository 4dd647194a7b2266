"""Random access into shards: the writer's index, the index built for older shards, per-rank bytes read,
remote shards staged once, and `data inspect` checking the index.

Bytes read are the process's own read syscalls (`rchar` in /proc/<pid>/io), so they count what the loader
asked the file system for (page cache or not), including index files and the manifest."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
import yaml
from harness.batches import batches, consecutive_splits, same  # the loader tests' helpers

from data_tools.inspection import inspect_dataset
from data_tools.shard_format import index_name, read_manifest, scan_index, write_manifest
from goat_dist.data import shard_index
from goat_dist.data.loader import build_train_loader

VOCAB = 60_000


def make_dataset(root: Path, n_docs: int, shard_mb: float, seed: int = 0, max_len: int = 3000) -> Path:
    """Documents of random lengths holding consecutive ids (mod VOCAB); 4 val documents."""
    rng = np.random.default_rng(seed)
    counts = {"train": n_docs, "val": 4}
    splits, _ = consecutive_splits(root, counts, rng, (1, max_len), shard_mb, VOCAB, key_digits=6)
    write_manifest(
        root, {"vocab_size": VOCAB, "dtype": "uint16", "tokenizer_sha256": "0" * 64, "splits": splits}
    )
    return root


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Path:
    """~6 MB of tokens in 2 MB shards."""
    return make_dataset(tmp_path_factory.mktemp("big"), 2000, 2.0, seed=3)


def loader(sources, dp_rank=0, dp_size=1, **kw):
    kw = {"seq_len": 64, "micro_batch_size": 4, "seed": 5, "shuffle_buffer": 64, **kw}
    return build_train_loader(sources, dp_rank=dp_rank, dp_size=dp_size, **kw)


def legacy_copy(src: Path, dst: Path) -> Path:
    """The data set as written before shard indexes existed: no sidecars, no "index" in the manifest."""
    shutil.copytree(src, dst)
    manifest = read_manifest(dst)
    for entries in manifest["splits"].values():
        for e in entries:
            (dst / e.pop("index")["name"]).unlink()
    write_manifest(dst, manifest)
    return dst


def test_the_writers_index_is_what_a_header_scan_finds(big):
    manifest = read_manifest(big)
    for e in manifest["splits"]["train"]:
        listed = np.load(big / index_name(e["name"]), allow_pickle=False)
        scanned, error = scan_index(big / e["name"])
        assert error is None and np.array_equal(listed, scanned)
        assert listed[-1].tolist() == [e["bytes"], e["n_tokens"]] and len(listed) == e["n_docs"] + 1
        with open(big / e["name"], "rb") as f:  # row 0: the first document's ids, exactly
            f.seek(int(listed[0, 0]))
            first = np.frombuffer(f.read(int(listed[1, 1]) * 2), dtype="<u2")
        assert np.array_equal(np.diff(first.astype(np.int64)) % VOCAB, np.ones(first.size - 1))


def test_indexed_windows_equal_a_sequential_decode_of_the_shards(big):
    """The reference: the epoch's shards decoded front to back as tar streams, concatenated in the
    epoch's shard order; sample n (no window shuffle) is window n of that stream."""
    from goat_dist.data.schedule import SourceSchedule
    from goat_dist.data.shards import iter_documents

    L = 64
    train = read_manifest(big)["splits"]["train"]
    order = SourceSchedule([e["n_tokens"] for e in train], L, 5, 0, 0).shard_order(0)
    stream = np.concatenate([ids for i in order for _, ids in iter_documents(big / train[i]["name"])])
    got = batches(loader([big], shuffle_buffer=0), 40)
    rows = torch.cat([b["tokens"] for b in got]).numpy()
    labels = torch.cat([b["labels"] for b in got]).numpy()
    for w, (row, lab) in enumerate(zip(rows, labels)):
        assert np.array_equal(row, stream[w * L : w * L + L]) and np.array_equal(
            lab, stream[w * L + 1 : w * L + L + 1]
        )


def test_shards_without_an_index_get_one_scanned_once_and_cached(big, tmp_path, monkeypatch):
    old = legacy_copy(big, tmp_path / "old")
    cache = tmp_path / "cache"
    expected = batches(loader([big], cache_dir=cache), 30)
    scans = []
    real_scan = shard_index.scan_index
    monkeypatch.setattr(shard_index, "scan_index", lambda p: scans.append(p) or real_scan(p))
    assert same(batches(loader([old], cache_dir=cache), 30), expected)  # the same stream, bitwise
    first = len(scans)
    assert first >= 1 and len(list((cache / "shard-index").glob("*.idx.npy"))) == first
    assert same(batches(loader([old], cache_dir=cache), 30), expected)
    assert len(scans) == first  # read from the cache, not scanned again
    shard = old / read_manifest(old)["splits"]["train"][0]["name"]
    os.utime(shard, ns=(time.time_ns(), time.time_ns() + 10**9))  # a replaced shard is scanned anew
    batches(loader([old], cache_dir=cache, shuffle_buffer=0, seed=0), 5)
    assert str(shard) in [str(p) for p in scans[first:]]


def _rchar(pids) -> int:
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/io") as f:
            total += int(next(line for line in f if line.startswith("rchar:")).split()[1])
    return total


@pytest.mark.parametrize(
    "dp,workers,order",
    [(8, 0, "epoch"), (8, 0, "keyed"), (64, 0, "epoch"), (64, 0, "keyed"), (8, 2, "epoch")],
)
def test_one_rank_reads_only_its_own_samples(big, tmp_path, dp, workers, order):
    """Rank 3 of dp reads <= 1.25x the bytes of the tokens it delivers, plus one index read per shard it
    opened, in the whole-epoch order (the default) and the block order. With workers, the workers' reads
    are counted (they read the shards; the main process only receives batches through pipes)."""
    L, B = 64, 4
    n = 200 if dp == 8 else 60
    train = read_manifest(big)["splits"]["train"]
    index_bytes = max(e["index"]["bytes"] for e in train)
    dl = loader(
        [big], dp_rank=3, dp_size=dp, seq_len=L, micro_batch_size=B, num_workers=workers, window_order=order
    )
    others = {c.pid for c in psutil.Process().children()}  # workers of loaders other tests left behind
    it = iter(dl)
    for _ in range(max(workers, 1)):  # every worker started and delivered once: its first shards are open
        next(it)
    pids = [c.pid for c in psutil.Process().children() if c.pid not in others] if workers else [os.getpid()]
    assert len(pids) == max(workers, 1)
    before = _rchar(pids)
    for _ in range(n):
        next(it)
    read = _rchar(pids) - before
    del it
    delivered = n * B * L * 2  # uint16 ids
    shards = len(train)
    assert read <= 1.25 * delivered + shards * (index_bytes + 4096) * max(workers, 1), (read, delivered)
    assert read >= delivered  # the counter saw the reads


@pytest.mark.parametrize("order", ["epoch", "keyed"])
def test_resume_far_into_a_long_stream_starts_in_under_a_second(big, order):
    t0 = time.perf_counter()
    batches(loader([big], dp_rank=1, dp_size=8, start_sample=8 * 10**6, window_order=order), 1)
    assert time.perf_counter() - t0 < 1.0


def test_remote_shards_are_staged_once_and_read_by_offset(big, tmp_path):
    cache = tmp_path / "cache"
    url = f"pipe:cat {big}/{{}}"
    expected = batches(loader([big], cache_dir=cache), 20)
    assert same(batches(loader([url], cache_dir=cache), 20), expected)
    staged = sorted((cache / "remote").rglob("train-*.tar"))
    assert staged and all(p.stat().st_size == (big / p.name).stat().st_size for p in staged)
    stamps = [p.stat().st_mtime_ns for p in staged]
    assert same(batches(loader([url], cache_dir=cache), 20), expected)
    assert [p.stat().st_mtime_ns for p in staged] == stamps  # not copied again


def test_a_remote_shard_that_does_not_match_the_manifest_is_named(big, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(big, bad)
    name = read_manifest(bad)["splits"]["train"][0]["name"]
    data = bytearray((bad / name).read_bytes())
    data[5000] ^= 0xFF
    (bad / name).write_bytes(bytes(data))
    with pytest.raises(Exception, match=f"{name}.*sha256"):
        batches(loader([f"pipe:cat {bad}/{{}}"], cache_dir=tmp_path / "cache", shuffle_buffer=0, seed=0), 200)


def test_token_ids_outside_the_vocabulary_are_named(big, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(big, bad)
    manifest = read_manifest(bad)
    manifest["vocab_size"] = 1000  # every id >= 1000 is now out of range (uint16 kept)
    manifest["dtype"] = "uint16"
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(Exception, match="vocab_size 1000"):
        batches(loader([bad], cache_dir=tmp_path / "cache"), 20)


def test_inspect_checks_the_index(big, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(big, copy)
    assert inspect_dataset(copy) == []
    train = read_manifest(copy)["splits"]["train"]
    index_path = copy / train[1]["index"]["name"]
    index = np.load(index_path, allow_pickle=False)
    index[3, 0] += 512  # the right size, the wrong offsets
    np.save(index_path, index, allow_pickle=False)
    assert inspect_dataset(copy) == [train[1]["name"]]
    assert "index" in capsys.readouterr().out
    legacy = legacy_copy(big, tmp_path / "legacy")
    assert inspect_dataset(legacy) == []
    assert "without an index" in capsys.readouterr().out


# ---------------------------------------------------------------- the order of windows inside a block


def test_keyed_permutation_is_a_seeded_bijection():
    from goat_dist.data.schedule import KeyedPermutation, stream_key

    for n in (1, 2, 3, 5, 64, 1000, 1024, 1025):
        perm = [KeyedPermutation(n, stream_key(7, 1, 0, 2, 9))(i) for i in range(n)]
        assert sorted(perm) == list(range(n))
    a = [KeyedPermutation(1024, stream_key(7, 1, 0, 2, 9))(i) for i in range(1024)]
    assert a == [KeyedPermutation(1024, stream_key(7, 1, 0, 2, 9))(i) for i in range(1024)]
    b = [KeyedPermutation(1024, stream_key(7, 1, 0, 2, 10))(i) for i in range(1024)]  # the next block
    assert a != b and a != list(range(1024))
    fixed = sum(x == i for i, x in enumerate(a))
    assert fixed < 10  # a random permutation of 1024 has ~1 fixed point


def epoch_windows(ds, L: int, seed: int, order: str = "keyed") -> np.ndarray:
    """Epoch 0's token stream of a one-source data set, decoded front to back in the epoch's shard order."""
    from goat_dist.data.schedule import SourceSchedule
    from goat_dist.data.shards import iter_documents

    train = read_manifest(ds)["splits"]["train"]
    order = SourceSchedule([e["n_tokens"] for e in train], L, seed, 0, 0, window_order=order).shard_order(0)
    return np.concatenate([ids for i in order for _, ids in iter_documents(ds / train[i]["name"])])


def test_window_order_numpy_is_the_stream_of_runs_begun_before_keyed(big):
    """The reference is the formula such streams were read with: window = block start +
    numpy.random.default_rng([seed, 0x626C6B, source, epoch, block]).permutation(block size)[offset]."""
    L, block, seed = 64, 64, 5
    stream = epoch_windows(big, L, seed, "numpy")
    got = torch.cat([b["tokens"] for b in batches(loader([big], window_order="numpy"), 50)]).numpy()
    for p, row in enumerate(got):
        b, i = divmod(p, block)
        w = b * block + np.random.default_rng([seed, 0x626C6B, 0, 0, b]).permutation(block)[i]
        assert np.array_equal(row, stream[w * L : w * L + L])


def test_window_order_keyed_shuffles_inside_each_block(big):
    """Epoch 0's first 4 blocks (64 windows each): block b shows exactly windows b*64 ... b*64+63, not
    in order (windows of this data set differ from each other within the first 1875)."""
    L, block = 64, 64
    stream = epoch_windows(big, L, 5, "keyed")
    windows = np.stack([stream[w * L : w * L + L] for w in range(4 * block)])
    got = torch.cat([b["tokens"] for b in batches(loader([big], window_order="keyed"), 64)]).numpy()
    seen = []
    for row in got:
        (match,) = np.flatnonzero((windows == row).all(axis=1))
        seen.append(int(match))
    for b in range(4):
        assert sorted(seen[b * block : (b + 1) * block]) == list(range(b * block, (b + 1) * block))
    assert seen != sorted(seen)


@pytest.mark.parametrize(
    "recorded,kept",
    [
        ("absent", "numpy"),  # a contract written before the key existed
        (None, "numpy"),  # a checkpoint written before contracts existed
        ("keyed", "keyed"),  # a stream begun before "epoch" became the default
        ("numpy", "numpy"),
        ("epoch", None),
    ],
)
def test_a_resume_keeps_the_window_order_its_stream_began_with(recorded, kept):
    """Under the default config a resume continues in the recorded order (and is no data change); a config
    that asks for another order than the default is taken at its word, and the check names the change."""
    from goat_dist.config import load_config
    from goat_dist.data import contract as data_contract

    cfg = load_config(None, [])
    assert cfg.data.window_order == "epoch"
    old = None if recorded is None else {"seq_len": 64}
    if recorded not in (None, "absent"):
        old["window_order"] = recorded
    assert data_contract.kept_window_order(old, cfg) == kept
    contract = {"seq_len": 64, "window_order": kept or cfg.data.window_order}  # the resolved config's
    assert not data_contract.check(old, contract, "check", "ckpt")
    asked = load_config(None, ["data.window_order=keyed"])
    new = {"seq_len": 64, "window_order": "keyed"}
    assert data_contract.kept_window_order(old, asked) is None
    if recorded not in (None, "keyed"):
        assert data_contract.differences(old, new) == [f"data.window_order: {kept or 'epoch'!r} -> 'keyed'"]


def test_a_remote_shard_is_downloaded_once_per_host(big, tmp_path, monkeypatch):
    """Processes of one host that need the same remote shard at once: one downloads under the file lock,
    the others find its copy (threads stand in for processes: flock locks open files, not processes)."""
    import threading

    entry = read_manifest(big)["splits"]["train"][0]
    url = f"pipe:cat {big}/{entry['name']}"
    opened = []
    from goat_dist.data import remote_cache

    real_open = remote_cache.open_shard

    def slow_open(location):
        opened.append(location)
        time.sleep(0.3)  # the others arrive while this download holds the lock
        return real_open(location)

    monkeypatch.setattr(remote_cache, "open_shard", slow_open)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(shard_index.stage_remote(url, entry, tmp_path)))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(opened) == 1 and len(set(results)) == 1 and len(results) == 4
    assert results[0].read_bytes() == (big / entry["name"]).read_bytes()


def test_open_shards_are_bounded_least_recently_used_first(big, monkeypatch):
    monkeypatch.setattr(shard_index, "OPEN_SHARDS", 2)
    train = read_manifest(big)["splits"]["train"]
    files = shard_index.ShardFiles(None)
    opened = [files.get(str(big / e["name"]), e, e["n_tokens"], VOCAB) for e in train[:2]]
    files.get(str(big / train[0]["name"]), train[0], train[0]["n_tokens"], VOCAB)  # 0 used again
    files.get(str(big / train[2]["name"]), train[2], train[2]["n_tokens"], VOCAB)
    assert opened[1].fd is None and opened[0].fd is not None  # shard 1 was the least recently used
    files.close()
    assert opened[0].fd is None


def test_a_checkpoint_from_before_window_order_resumes_in_its_own_order(
    world1, builtin_cache, tmp_path, capsys
):
    """The trainer's side of kept_window_order: a checkpoint whose data contract has no window_order (as
    written before it existed) resumes reading the numpy order, one that records keyed (begun before epoch
    was the default) reads keyed, and says so; a new run reads epoch. (One test: the trainer's console
    logger keeps the sys.stdout of its first import, which capsys closes after the test.)"""
    import hashlib

    from harness.multiproc import in_process_config

    from goat_dist.trainer.trainer import Trainer

    run_dir = tmp_path / "run"
    first = Trainer(in_process_config(builtin_cache, run_dir, "train.max_steps=2"))
    assert first.contract["window_order"] == "epoch"
    first.fit()
    step_dir = run_dir / "checkpoints" / "step_00000002"
    state_path = step_dir / "trainer_state.json"
    state = json.loads(state_path.read_text())
    messages = []
    for recorded, kept in ((None, "numpy"), ("keyed", "keyed")):
        if recorded is None:
            del state["data_contract"]["window_order"]
        else:
            state["data_contract"]["window_order"] = recorded
        state_path.write_text(json.dumps(state))
        manifest = json.loads((step_dir / "manifest.json").read_text())
        data = state_path.read_bytes()
        manifest["files"]["trainer_state.json"] = {
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
        (step_dir / "manifest.json").write_text(json.dumps(manifest))
        capsys.readouterr()
        again = Trainer(in_process_config(builtin_cache, run_dir, "train.max_steps=4"))
        assert again.cfg.data.window_order == again.contract["window_order"] == kept
        written = yaml.safe_load((run_dir / "config.yaml").read_text())  # the run dir's config: resolved
        assert written["data"]["window_order"] == kept and written == again.cfg.to_dict()
        messages.append((kept, capsys.readouterr().out))
        it = again.start_loop()
        assert again.loop.loader.dataset.schedules[0].window_order == kept
        del it
    assert "data.window_order=numpy" in messages[0][1]
    assert "data.window_order=keyed" in messages[1][1]
