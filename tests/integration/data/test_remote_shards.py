"""Remote shards read by DataLoader workers (separate processes) sharing one host cache within a budget:
the batches are those of the local data set, the cache never holds more than its budget, and each shard is
downloaded once per host for both workers, not once per worker."""

from __future__ import annotations

import numpy as np
import pytest
from harness.batches import same

from data_tools.shard_format import read_manifest, write_manifest
from data_tools.writer import ShardWriter
from goat_dist.data.loader import build_train_loader
from goat_dist.data.shard_index import RECORD_NAME, RemoteCache

VOCAB = 60_000


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote-workers")
    splits, pos = {}, 0
    for split, count in (("train", 90), ("val", 2)):
        with ShardWriter(root, split, 0.03, vocab_size=VOCAB) as w:
            for d in range(count):
                w.write(f"doc-{d:05d}", np.arange(pos, pos + 1500) % VOCAB)
                pos += 1500
        splits[split] = w.shards
    write_manifest(
        root, {"vocab_size": VOCAB, "dtype": "uint16", "tokenizer_sha256": "0" * 64, "splits": splits}
    )
    return root


def staged_bytes(root) -> int:
    total = 0
    for path in root.rglob("*"):
        try:
            total += path.stat().st_size if path.is_file() and RECORD_NAME not in path.name else 0
        except FileNotFoundError:  # a temporary file renamed or deleted meanwhile
            pass
    return total


def test_workers_share_the_host_cache_within_its_budget(data, tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    train = read_manifest(data)["splits"]["train"]
    budget = 4 * max(RemoteCache("unused").need(e) for e in train) + 1000
    kw = dict(seq_len=64, micro_batch_size=8, dp_rank=0, dp_size=1, seed=3, shuffle_buffer=8)
    kw["window_order"] = "keyed"
    n = (sum(e["n_tokens"] for e in train) - 1) // 64 // 8
    root = tmp_path / "cache" / "remote"
    remote = build_train_loader(
        [f"pipe:cat {data}/{{}}"],
        num_workers=2,
        cache_dir=tmp_path / "cache",
        cache_max_gb=budget / 1e9,
        **kw,
    )
    got, sizes = [], []
    it = iter(remote)
    for _ in range(n):
        got.append(next(it))
        sizes.append(staged_bytes(root))
    del it
    local = iter(build_train_loader([str(data)], cache_dir=None, **kw))
    assert same(got, [next(local) for _ in range(n)])
    assert max(sizes) <= budget
    record = RemoteCache(root).record()
    assert len(train) <= record["downloads"] <= len(train) + 4, record  # not once per worker
    assert record["evictions"] >= record["downloads"] - 4
