"""The whole-epoch window order (``data.window_order=epoch``, the default for new runs) beside the block
order of streams begun before it ("keyed"): batches from the whole epoch, with every guarantee of the
stream kept (exact resume, DP change without repeats, a new permutation per epoch, one open per shard).

The corpus holds documents of consecutive token values in manifest order (each value once), so a
window's first token names its place in the source, and which shard it starts in."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from harness.batches import batches, consecutive_splits, count_shard_opens, same

from data_tools.shard_format import read_manifest, write_manifest
from goat_dist.data import shard_index
from goat_dist.data.loader import build_train_loader
from goat_dist.data.schedule import WINDOW_ORDERS, Mixture, SourceSchedule

VOCAB = 60_000
ORDERS = pytest.mark.parametrize("order", ["epoch", "keyed"])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """~45k tokens in ~40 shards: more than shard_index.OPEN_SHARDS (32) before the loader raised it."""
    root = tmp_path_factory.mktemp("order")
    rng = np.random.default_rng(0)
    splits, _ = consecutive_splits(root, {"train": 300, "val": 4}, rng, (50, 250), 0.008, VOCAB)
    write_manifest(
        root, {"vocab_size": VOCAB, "dtype": "uint16", "tokenizer_sha256": "0" * 64, "splits": splits}
    )
    assert len(splits["train"]) > 32
    return root


def loader(sources, dp_rank=0, dp_size=1, **kw):
    kw = {"seq_len": 16, "micro_batch_size": 8, "seed": 7, "shuffle_buffer": 1024, **kw}
    return build_train_loader(sources, dp_rank=dp_rank, dp_size=dp_size, **kw)


def shard_ends(root: Path) -> np.ndarray:
    return np.cumsum([e["n_tokens"] for e in read_manifest(root)["splits"]["train"]])


def firsts(bs: list[dict]) -> list[int]:
    return [int(t) for b in bs for t in b["tokens"][:, 0]]


def test_the_config_default_is_the_schedules():
    from goat_dist.config import sections
    from goat_dist.data import schedule

    assert sections.DataConfig().window_order == schedule.DEFAULT_WINDOW_ORDER == "epoch"
    assert sections.WINDOW_ORDERS == WINDOW_ORDERS


def test_every_shard_appears_in_1000_consecutive_samples(corpus):
    """Epoch order: 1,000 consecutive global samples (deep in the stream too) start in every shard; the block
    order's 1,000 are a slice of the epoch (1024-window blocks: ~16k tokens, a few shards)."""
    ends = shard_ends(corpus)
    for start in (0, 10**6):
        got = firsts(batches(loader([corpus], micro_batch_size=100, start_sample=start), 10))
        assert len(got) == 1000
        assert set(np.searchsorted(ends, got, side="right")) == set(range(len(ends)))
    keyed = firsts(batches(loader([corpus], micro_batch_size=100, window_order="keyed"), 10))
    assert len(set(np.searchsorted(ends, keyed, side="right"))) < len(ends) // 2


def test_each_epoch_is_a_new_permutation_of_all_windows(corpus):
    n_tokens = [e["n_tokens"] for e in read_manifest(corpus)["splits"]["train"]]
    sched = SourceSchedule(n_tokens, 16, 7, 0, 1024, window_order="epoch")
    n = sched.windows
    epochs = [[sched.locate(e * n + p)[2] for p in range(n)] for e in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(n))
    assert epochs[0] != epochs[1]
    assert sum(abs(a - b) <= 1 for a, b in zip(epochs[0], epochs[0][1:])) < n // 100  # not runs of a slice
    orders = [sched.shard_order(e) for e in range(2)]
    assert sorted(orders[0]) == list(range(len(n_tokens))) and orders[0] != orders[1]
    again = SourceSchedule(n_tokens, 16, 7, 0, 1024, window_order="epoch")  # a pure function of the seed
    assert [again.locate(j)[2] for j in range(3 * n, 2, -7)] == [
        sched.locate(j)[2] for j in range(3 * n, 2, -7)
    ]
    other_seed = SourceSchedule(n_tokens, 16, 8, 0, 1024, window_order="epoch")
    assert [other_seed.locate(p)[2] for p in range(100)] != epochs[0][:100]


@ORDERS
def test_resume_mid_epoch_and_in_a_later_epoch_is_exact(corpus, order):
    dp, B = 2, 64
    n_tokens = [e["n_tokens"] for e in read_manifest(corpus)["splits"]["train"]]
    windows = SourceSchedule(n_tokens, 16, 7, 0, 1024, window_order=order).windows
    steps = windows // (dp * B) + 6  # crosses into epoch 1
    full = [
        batches(loader([corpus], r, dp, micro_batch_size=B, window_order=order), steps) for r in range(dp)
    ]
    for k in (3, steps - 4):  # mid-epoch 0, then inside epoch 1
        for r in range(dp):
            resumed = batches(
                loader([corpus], r, dp, micro_batch_size=B, window_order=order, start_sample=k * dp * B), 4
            )
            assert same(resumed, full[r][k : k + 4])


@ORDERS
def test_a_dp_change_on_resume_neither_repeats_nor_skips(corpus, order):
    """Samples [0, S) at dp=4, then the rest of epoch 0 at dp=6: every window once, and each global sample
    is the window the uninterrupted dp=1 stream shows at that index."""
    n_tokens = [e["n_tokens"] for e in read_manifest(corpus)["splits"]["train"]]
    n = SourceSchedule(n_tokens, 16, 7, 0, 1024, window_order=order).windows
    B, S = 8, 4 * 8 * 9  # 9 steps at dp=4; S is a multiple of 6 too
    by_index: dict[int, int] = {}
    for r in range(4):
        for t, tok in enumerate(firsts(batches(loader([corpus], r, 4, window_order=order), 9))):
            by_index[t * 4 + r] = tok
    per_rank = -(-(n - S) // 6)
    for r in range(6):
        got = firsts(batches(loader([corpus], r, 6, window_order=order, start_sample=S), -(-per_rank // B)))
        for t, tok in enumerate(got):
            by_index[S + t * 6 + r] = tok
    seen = [by_index[i] for i in range(n)]
    assert len(set(seen)) == n
    reference = firsts(batches(loader([corpus], micro_batch_size=n, window_order=order), 1))
    assert seen == reference


@ORDERS
def test_a_mixture_advances_each_sources_own_epochs(corpus, tmp_path, order):
    """Two sources over the same shards: sample n is the window that its source's own stream shows at the
    index Mixture.locate(n) gives, epoch after epoch (source 0 goes round more than once here)."""
    ends = shard_ends(corpus)
    sources = [{"path": str(corpus), "weight": 3}, {"path": str(corpus), "weight": 1}]
    got = firsts(batches(loader(sources, micro_batch_size=500, window_order=order), 8))
    mixture = Mixture([3, 1], 7)
    n_tokens = [e["n_tokens"] for e in read_manifest(corpus)["splits"]["train"]]
    scheds = [SourceSchedule(n_tokens, 16, 7, s, 1024, window_order=order) for s in range(2)]
    for n, tok in enumerate(got):
        s, j = mixture.locate(n)
        epoch, _, w = scheds[s].locate(j)
        order_e = scheds[s].shard_order(epoch)
        starts = np.concatenate([[0], np.cumsum([n_tokens[i] for i in order_e])])
        k = int(np.searchsorted(starts, w * 16, side="right")) - 1  # the shard holding the window's start
        shard = order_e[k]
        shard_first = int(ends[shard] - n_tokens[shard])
        assert tok == shard_first + w * 16 - int(starts[k])


@ORDERS
def test_each_shard_is_opened_once_by_a_rank_of_a_large_dp(corpus, monkeypatch, order):
    """Rank 5 of dp=64 reads from every shard in turn (more shards than the 32 a process kept open before):
    each is opened once, and the bytes read stay within 1.25x the delivered tokens' plus one index read per
    shard."""
    opened = count_shard_opens(monkeypatch)
    monkeypatch.setattr(shard_index, "OPEN_SHARDS", 32)
    train = read_manifest(corpus)["splits"]["train"]
    it = iter(loader([corpus], 5, 64, window_order=order))
    with open("/proc/self/io") as f:
        before = int(next(line for line in f if line.startswith("rchar:")).split()[1])
    n = 150
    for _ in range(n):
        next(it)
    with open("/proc/self/io") as f:
        read = int(next(line for line in f if line.startswith("rchar:")).split()[1]) - before
    del it
    assert len(opened) == len(set(opened)) and len(set(opened)) > 32
    index_bytes = max(e["index"]["bytes"] for e in train)
    delivered = n * 8 * 16 * 2
    assert delivered <= read <= 1.25 * delivered + len(train) * (2 * index_bytes + 4096), (read, delivered)


@ORDERS
def test_a_resume_far_into_the_stream_starts_at_once(corpus, order):
    import time

    t0 = time.perf_counter()
    got = batches(loader([corpus], 3, 512, window_order=order, start_sample=512 * 10**7), 1)
    assert time.perf_counter() - t0 < 1.0 and got[0]["tokens"].shape == torch.Size([8, 16])


def test_the_epoch_order_is_fixed_by_this_code():
    """A stream's order is part of every checkpoint's meaning: these values must never change (no numpy RNG
    in it, so no numpy upgrade can change them either)."""
    sched = SourceSchedule([1000] * 7 + [333], 16, 1234, 1, 1024, window_order="epoch")
    assert sched.windows == 458
    assert sched.shard_order(0) == [4, 1, 5, 3, 2, 0, 6, 7] and sched.shard_order(1) == [
        5,
        0,
        2,
        7,
        6,
        1,
        3,
        4,
    ]
    assert [sched.locate(j)[2] for j in range(8)] == [312, 200, 155, 124, 183, 358, 26, 175]
    assert [sched.locate(458 + j)[2] for j in range(4)] == [82, 326, 385, 74]
