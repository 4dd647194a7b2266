"""Tests of the training loader: determinism, worker/rank independence, exact resume, document
masking, mixtures and bad shards.

Synthetic data sets hold documents of consecutive token values (each value is used once in a
data set, and sources use disjoint ranges), so a window's first token names its place in the
source and its source.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from harness.batches import batches, consecutive_splits, count_shard_opens, same

from data_tools.shard_format import ShardError, read_manifest, write_manifest
from goat_dist.data.loader import PackedBatches, build_train_loader, build_val_loader
from goat_dist.data.sources import resolve_sources

VOCAB = 60_000
# The tests that exercise the window order run under both the whole-epoch order (the default) and the block
# order of streams begun before it; the multi-process ones under the default only.
ORDERS = pytest.mark.parametrize("order", ["epoch", "keyed"])


def make_dataset(root: Path, base: int, n_docs: int, seed: int = 0, shard_mb: float = 0.004) -> Path:
    """Documents of consecutive values base, base+1, ...; train and val splits; ~4 KB shards."""
    rng = np.random.default_rng(seed)
    counts = {"train": n_docs, "val": max(2, n_docs // 10)}
    splits, start = consecutive_splits(root, counts, rng, (1, 120), shard_mb, VOCAB, first=base)
    assert start < VOCAB
    write_manifest(
        root, {"vocab_size": VOCAB, "dtype": "uint16", "tokenizer_sha256": "0" * 64, "splits": splits}
    )
    return root


@pytest.fixture(scope="module")
def data_a(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("a"), 0, 300, seed=1)


@pytest.fixture(scope="module")
def data_b(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("b"), 30_000, 150, seed=2)


def firsts(bs: list[dict]) -> set[int]:
    """First tokens of all samples: each names one window."""
    return {int(t) for b in bs for t in b["tokens"][:, 0]}


def loader(sources, dp_rank=0, dp_size=1, **kw):
    kw = {"seq_len": 16, "micro_batch_size": 4, "seed": 7, "shuffle_buffer": 8, **kw}
    return build_train_loader(sources, dp_rank=dp_rank, dp_size=dp_size, **kw)


def test_batches_are_stream_windows(data_a):
    b = batches(loader([data_a]), 3)
    for batch in b:
        assert batch["tokens"].shape == (4, 16) and batch["tokens"].dtype == torch.long
        assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])
        assert torch.equal(batch["position_ids"], torch.arange(16).expand(4, 16))
        assert batch["skipped"].dtype == torch.int64 and int(batch["skipped"]) == 0
        # consecutive values: every window is a slice of the stream (documents concatenated in order)
        diffs = torch.diff(torch.cat([batch["tokens"], batch["labels"][:, -1:]], dim=1), dim=1)
        assert (diffs >= 1).all()


@ORDERS
def test_same_seed_same_batches_on_every_rank(data_a, data_b, order):
    sources = [{"path": str(data_a), "weight": 2}, {"path": str(data_b), "weight": 1}]
    for rank in (0, 1):
        a = batches(loader(sources, rank, 2, window_order=order), 12)
        b = batches(loader(sources, rank, 2, window_order=order), 12)
        assert same(a, b)
    r0, r1 = (batches(loader(sources, r, 2, window_order=order), 12) for r in (0, 1))
    assert not firsts(r0) & firsts(r1)
    other_seed = batches(loader(sources, 0, 2, seed=8, window_order=order), 12)
    assert not same(batches(loader(sources, 0, 2, window_order=order), 12), other_seed)


def test_workers_and_ranks_do_not_change_the_global_stream(data_a):
    """DP=1 micro-batches, re-cut per sample, equal DP=2's samples interleaved; workers change nothing."""
    single = batches(loader([data_a], micro_batch_size=2), 8)
    flat = [row for b in single for row in b["tokens"]]
    for workers in (0, 2):
        ranks = [batches(loader([data_a], r, 2, micro_batch_size=2, num_workers=workers), 4) for r in (0, 1)]
        per_rank = [[row for b in rb for row in b["tokens"]] for rb in ranks]
        interleaved = [row for pair in zip(*per_rank) for row in pair]
        assert all(torch.equal(x, y) for x, y in zip(flat, interleaved))


def test_resume_is_exact_per_rank_for_any_worker_count(data_a, data_b):
    sources = [{"path": str(data_a), "weight": 3}, {"path": str(data_b), "weight": 1}]
    dp, B, steps, k = 2, 4, 14, 5
    full = [batches(loader(sources, r, dp, micro_batch_size=B, num_workers=2), steps) for r in range(dp)]
    start = k * B * dp  # k optimizer steps of one micro-batch per rank consumed
    for workers in (2, 1):
        for r in range(dp):
            resumed = batches(
                loader(sources, r, dp, micro_batch_size=B, num_workers=workers, start_sample=start), 9
            )
            assert same(resumed, full[r][k:])


@ORDERS
def test_resume_deep_in_the_stream_is_exact_and_opens_only_needed_shards(data_a, monkeypatch, order):
    n_windows = PackedBatches(resolve_sources([data_a], "train"), 16, 4).windows_per_epoch[0]
    steps = n_windows // 4 + 30  # crosses into epoch 1
    full = batches(loader([data_a], window_order=order), steps)
    k = steps - 20
    assert same(batches(loader([data_a], start_sample=4 * k, window_order=order), 20), full[k:])

    opened = count_shard_opens(monkeypatch)
    t0 = time.perf_counter()
    batches(loader([data_a], start_sample=4 * 10**8, window_order=order), 1)  # ~200k epochs ahead
    assert time.perf_counter() - t0 < 2.0
    assert 1 <= len(opened) <= 4 < len(list(data_a.glob("train-*.tar")))


@ORDERS
def test_dp_change_on_resume_neither_repeats_nor_skips(data_a, order):
    """Epoch 0 consumed first with DP=2, then resumed with DP=1: every window exactly once."""
    ds = PackedBatches(resolve_sources([data_a], "train"), 16, 2, seed=3, shuffle_buffer=8)
    n_windows = ds.windows_per_epoch[0]
    B, start = 2, 2 * 2 * 9  # 9 steps at DP=2, micro-batch 2
    kw = {"micro_batch_size": B, "seed": 3, "window_order": order}
    first = [batches(loader([data_a], r, 2, **kw), 9) for r in (0, 1)]
    rest_batches = -(-(n_windows - start) // B)
    rest = batches(loader([data_a], 0, 1, start_sample=start, **kw), rest_batches)
    seen = [int(t) for part in (*first, rest) for b in part for t in b["tokens"][:, 0]][:n_windows]
    assert len(seen) == len(set(seen)) == n_windows
    uninterrupted = batches(loader([data_a], 0, 1, **kw), -(-n_windows // B))
    assert set(seen) == firsts(uninterrupted)


@ORDERS
def test_epochs_cover_every_window_then_reshuffle(data_a, order):
    ds = PackedBatches(
        resolve_sources([data_a], "train"), 16, 1, seed=3, shuffle_buffer=8, window_order=order
    )
    n = ds.windows_per_epoch[0]
    it = iter(ds)
    epochs = [[int(next(it)["tokens"][0, 0]) for _ in range(n)] for _ in range(2)]
    assert len(set(epochs[0])) == len(set(epochs[1])) == n  # each epoch: every window once
    assert epochs[0] != epochs[1]  # another shard order and window shuffle


def _doc_starts(root: Path) -> np.ndarray:
    from goat_dist.data import iter_documents, split_shard_paths

    return np.sort([int(ids[0]) for _, ids in iter_documents(split_shard_paths(root, "train"))])


@ORDERS
def test_document_masking_positions(data_a, order):
    starts = _doc_starts(data_a)
    got = batches(loader([data_a], document_masking=True, seq_len=32, window_order=order), 20)
    restarts = continued = 0
    for b in got:
        tok, pos = b["tokens"].numpy(), b["position_ids"].numpy()
        doc_start = starts[np.searchsorted(starts, tok, side="right") - 1]
        np.testing.assert_array_equal(pos, tok - doc_start)  # offset from the token's document start
        restarts += int((pos[:, 1:] == 0).sum())
        continued += int((pos[:, 0] > 0).sum())
        boundary = pos[:, 1:] != pos[:, :-1] + 1
        np.testing.assert_array_equal(boundary, pos[:, 1:] == 0)  # the rule the model uses
        assert torch.equal(b["tokens"][:, 1:], b["labels"][:, :-1])  # labels stay next-token
    assert restarts > 0 and continued > 0


@ORDERS
def test_mixture_proportions(data_a, data_b, tmp_path, order):
    data_c = make_dataset(tmp_path / "c", 45_000, 100, seed=3)
    weights = {0: 0.6, 30_000: 0.3, 45_000: 0.1}
    sources = [{"path": str(p), "weight": w} for p, w in zip((data_a, data_b, data_c), weights.values())]
    ds = PackedBatches(
        resolve_sources(sources, "train"), 8, 100, seed=5, shuffle_buffer=4, window_order=order
    )
    it = iter(ds)
    first = np.concatenate([next(it)["tokens"][:, 0].numpy() for _ in range(100)])  # 10k samples
    source = np.searchsorted(np.array(list(weights)), first, side="right") - 1
    share = np.bincount(source, minlength=3) / first.size
    np.testing.assert_allclose(share, list(weights.values()), atol=0.02)
    assert len(np.unique(first)) < first.size  # the small sources went round more than one epoch


def test_val_loader_is_fixed_and_infinite(data_a):
    val = build_val_loader([data_a], 16, 2, 0, 1)
    a, b = batches(val, 3), batches(val, 3)
    assert same(a, b)
    firsts = [int(t) for x in a for t in x["tokens"][:, 0]]
    assert firsts == sorted(firsts)  # manifest order, no shuffle
    assert len(batches(val, 200)) == 200  # cycles


def test_url_sources_read_through_gopen(data_a, tmp_path):
    url = f"pipe:cat {data_a}/{{}}"
    assert same(batches(loader([url], cache_dir=tmp_path), 4), batches(loader([data_a]), 4))


def test_bad_arguments(data_a, tmp_path):
    with pytest.raises(ValueError, match="multiple of dp_size"):
        loader([data_a], 0, 2, start_sample=3)
    with pytest.raises(ValueError, match="weight"):
        loader([{"path": str(data_a), "weight": 0}])
    with pytest.raises(ValueError, match="unknown keys"):
        loader([{"path": str(data_a), "wieght": 1}])
    with pytest.raises(ValueError, match="on_error"):
        loader([data_a], on_error="ignore")
    with pytest.raises(ValueError, match="seq_len"):
        loader([data_a], seq_len=10**6)
    with pytest.raises(FileNotFoundError):
        loader([tmp_path / "nope"])


# ---------------------------------------------------------------- bad shards


@pytest.fixture()
def corrupt_copy(data_a, tmp_path) -> tuple[Path, str]:
    """A copy of data_a with one train shard truncated inside its third sample: the second shard epoch 0
    reads (loader()'s seed), so the tests below reach it early."""
    from goat_dist.data.schedule import SourceSchedule

    root = tmp_path / "bad"
    shutil.copytree(data_a, root)
    train = read_manifest(root)["splits"]["train"]
    order = SourceSchedule([e["n_tokens"] for e in train], 16, 7, 0, 8).shard_order(0)
    name = train[order[1]]["name"]
    with open(root / name, "r+b") as f:
        f.truncate(2 * 1024 + 512 + 10)
    return root, name


def test_corrupt_shard_raises_naming_shard_and_sample(corrupt_copy):
    root, name = corrupt_copy
    for workers in (0, 1):
        with pytest.raises(Exception) as info:
            batches(loader([root], shuffle_buffer=0, num_workers=workers), 200)
        assert name in str(info.value) and "doc-" in str(info.value)
        if workers == 0:
            assert isinstance(info.value, ShardError)


def test_corrupt_shard_skip_masks_counts_and_keeps_everything_else(corrupt_copy, data_a):
    root, name = corrupt_copy
    n = 60
    clean = batches(loader([data_a]), n)
    got = batches(loader([root], on_error="skip", num_workers=2), n)
    skipped = sum(int(b["skipped"]) for b in got)
    assert skipped > 0
    rows_masked = 0
    for g, c in zip(got, clean):
        masked = (g["labels"] == -100).any(dim=1)
        rows_masked += int(masked.sum())
        assert torch.equal(g["tokens"][~masked], c["tokens"][~masked])  # all other samples unchanged
        ok = g["labels"] != -100
        assert torch.equal(g["labels"][ok], c["labels"][ok])
    assert rows_masked == skipped
    resumed = batches(loader([root], on_error="skip", start_sample=4 * 20), n - 20)
    assert same(resumed, got[20:])


def test_skip_logs_the_shard(corrupt_copy, caplog):
    root, name = corrupt_copy
    with caplog.at_level(logging.WARNING, logger="goat_dist.data"):
        batches(loader([root], on_error="skip", shuffle_buffer=0), 150)
    assert any(name in r.getMessage() for r in caplog.records)


LEAKED_LOADER = """
import itertools, sys, torch
from torch.utils.data import IterableDataset
from goat_dist.data.loader import _loader

class Endless(IterableDataset):
    def __iter__(self):
        return (torch.tensor([i]) for i in itertools.count())

it = iter(_loader(Endless(), num_workers=2, pin_memory=False))
next(it)
LEAK = it  # never shut down: still referenced when the interpreter exits
print("exiting", flush=True)
"""


def test_a_process_with_a_loader_never_shut_down_still_exits():
    """Workers ignore SIGTERM (preemption safety), and multiprocessing's exit hook ends daemonic children with
    SIGTERM, then joins them: without the loader's own exit hook this process would wait forever."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", LEAKED_LOADER], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0 and "exiting" in out.stdout, out.stderr[-2000:]
    assert "Exception ignored in atexit" not in out.stderr, out.stderr[-2000:]
