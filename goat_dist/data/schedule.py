"""Index arithmetic of the sample stream: which source, epoch, shard order and window feed sample n.

Why: exact resume and worker/rank independence need the answer to "where does global sample n
come from" to be a pure function of (seed, n, manifest token counts), computable without reading
any data. Nothing in this module touches a file.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Mixture assignment is stratified per chunk of this many global samples: each chunk holds
# round(MIX_CHUNK * weight) samples of every source, in a seeded random order.
MIX_CHUNK = 4096
# Windows read together when the stream is not shuffled (reading granularity only).
READ_BLOCK = 256
_MIX_TAG, _SHARD_TAG, _BLOCK_TAG = 0x6D6978, 0x736872, 0x626C6B  # separate the RNG streams
_EPOCH_TAG = 0x657063
# How an epoch's windows are ordered (data.window_order): "epoch" (the default) applies one seeded
# bijection to all windows of the epoch, so consecutive samples come from anywhere in the source; "keyed"
# (streams begun before "epoch" existed) applies one per shuffle block of consecutive windows, so a large
# step is a contiguous slice of a shard or two; "numpy" (streams begun before "keyed" existed) shuffles a
# whole block with numpy's RNG. A stream keeps the order it began with (data.contract).
WINDOW_ORDERS = ("epoch", "keyed", "numpy")
DEFAULT_WINDOW_ORDER = "epoch"
_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix64(x: int) -> int:
    """SplitMix64's finalizer: a bijective, well-mixing hash of a 64-bit integer."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _mix64_array(x: np.ndarray) -> np.ndarray:
    """`_mix64` of every element of a uint64 array (numpy's uint64 products wrap modulo 2**64)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def keyed_shuffle(n: int, key: int) -> list[int]:
    """A seeded permutation of range(n), all at once: range(n) sorted by a keyed bijective hash.

    Why: where every position is wanted (a shard order), this costs a few vectorized passes (~20 us for
    tens of shards) instead of n `KeyedPermutation` evaluations (~6 us each), which a rank of a large dp
    on a small corpus (a new epoch every few samples) would pay every epoch; and unlike numpy's RNG its
    values are fixed by this code, not by the numpy version."""
    hashes = _mix64_array(np.arange(n, dtype=np.uint64) ^ np.uint64(key & _M64))
    return np.argsort(hashes, kind="stable").tolist()


def stream_key(*parts: int) -> int:
    """One 64-bit key from a tuple of integers (seed, tag, source, epoch, block, ...)."""
    k = 0
    for part in parts:
        k = _mix64(((k ^ (int(part) & _M64)) + _GOLDEN) & _M64)
    return k


class KeyedPermutation:
    """A seeded bijection of range(n), evaluated at one index in O(1): a 4-round Feistel network over the
    smallest even number of bits that covers n (round function SplitMix64 of the half and a round key),
    with cycle walking back into range (at most 4x the range, so few rounds on average).

    Why: a rank of a dp-way job reads ~block/dp positions of each block. Shuffling the whole block to
    find them (numpy's permutation: O(block) work and an RNG construction per block) costs each rank of a
    large dp a block's shuffle per two samples; this costs a few microseconds per sample, whatever dp."""

    def __init__(self, n: int, key: int):
        if n < 1:
            raise ValueError(f"need n >= 1, got {n}")
        bits = max(2, (n - 1).bit_length())
        bits += bits & 1
        self.n, self.half, self.mask = n, bits // 2, (1 << (bits // 2)) - 1
        self.keys = tuple(key ^ c for c in _ROUND_CONSTANTS)

    def __call__(self, i: int) -> int:
        h, m, keys = self.half, self.mask, self.keys
        while True:
            left, right = i >> h, i & m
            for k in keys:
                left, right = right, left ^ (_mix64(right ^ k) & m)
            i = (left << h) | right
            if i < self.n:
                return i


_ROUND_CONSTANTS = (0x243F6A8885A308D3, 0x13198A2E03707344, 0xA4093822299F31D0, 0x082EFA98EC4E6C89)


def _quotas(weights: Sequence[float], total: int) -> np.ndarray:
    """Integer counts summing to `total`, proportional to `weights` (largest remainder, ties by index)."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * total
    q = np.floor(exact).astype(np.int64)
    rest = total - int(q.sum())
    order = sorted(range(len(w)), key=lambda i: (-(exact[i] - q[i]), i))
    q[order[:rest]] += 1
    return q


class Mixture:
    """Source of every global sample: global sample n -> (source s, index j in source s's stream).

    Chunk c (samples [c*C, (c+1)*C)) is a permutation, seeded by (seed, c), of a fixed multiset
    with quota_s samples of source s. So j = c * quota_s + (rank of n among chunk c's s-samples),
    an O(1) computation for any n, and observed proportions deviate from the weights by at most
    ~1/C at chunk boundaries and by random-permutation noise inside a chunk.
    """

    def __init__(self, weights: Sequence[float], seed: int):
        self.n_sources = len(weights)
        self.seed = seed
        self.quota = _quotas(weights, MIX_CHUNK)
        if (self.quota == 0).any():
            small = [i for i, q in enumerate(self.quota) if q == 0]
            raise ValueError(f"source weights {small} are below 1/{MIX_CHUNK} of the total; raise them")
        self._starts = np.concatenate([[0], np.cumsum(self.quota)[:-1]])
        self._chunk = -1

    def _load(self, c: int) -> None:
        base = np.repeat(np.arange(self.n_sources), self.quota)
        src = base[np.random.default_rng([self.seed, _MIX_TAG, c]).permutation(MIX_CHUNK)]
        order = np.argsort(src, kind="stable")
        rank = np.empty(MIX_CHUNK, dtype=np.int64)
        rank[order] = np.arange(MIX_CHUNK) - self._starts[src[order]]
        self._src, self._j = src, rank + c * self.quota[src]
        self._chunk = c

    def locate(self, n: int) -> tuple[int, int]:
        if self.n_sources == 1:
            return 0, n
        c, i = divmod(n, MIX_CHUNK)
        if c != self._chunk:
            self._load(c)
        return int(self._src[i]), int(self._j[i])


class SourceSchedule:
    """Window layout of one source's stream, epoch after epoch.

    Epoch e reads the shards in `shard_order(e)` (seeded permutation, or manifest order when not
    shuffled) and concatenates their documents into one token stream of T tokens (T from the
    manifest, the same every epoch). Window w covers tokens [w*L, w*L + L + 1) of that stream, so
    an epoch has N = (T - 1) // L windows; the tail is dropped. Stream index j is position
    p = j % N of epoch j // N, which shows:

    * `window_order="epoch"` (the default): window `perm_e(p)`, perm_e a `KeyedPermutation` of all N
      windows keyed by (seed, source, epoch), and the shard order a `keyed_shuffle` keyed by the
      same. Why: consecutive samples (so a step's batch) come from anywhere in the source instead of a
      slice of one shard; the cost is that a rank reads from every shard of the source in turn, so its
      process keeps them open (see ``loader``). `shuffle_buffer` then only switches shuffling off
      (0 or 1: stream order).
    * "keyed" (streams begun before "epoch" existed): positions are grouped into blocks of `block`
      (= shuffle_buffer) positions; p shows window `block_start + perm_b[p - block_start]` with perm_b a
      `KeyedPermutation` of the block keyed by (seed, source, epoch, block); the shard order a
      `KeyedPermutation` keyed by (seed, source, epoch).
    * "numpy" (streams begun before "keyed" existed): as "keyed", with numpy permutations seeded by
      the same (shard order too).

    Not shuffled (validation, or shuffle_buffer <= 1): window p, every order alike.
    """

    def __init__(
        self,
        n_tokens: Sequence[int],
        seq_len: int,
        seed: int,
        source_index: int,
        shuffle_buffer: int,
        shuffle: bool = True,
        window_order: str = DEFAULT_WINDOW_ORDER,
    ):
        if window_order not in WINDOW_ORDERS:
            raise ValueError(f"window_order must be one of {WINDOW_ORDERS}, got {window_order!r}")
        self.window_order = window_order
        self.n_tokens = tuple(int(n) for n in n_tokens)
        self.seq_len = seq_len
        self.total_tokens = sum(self.n_tokens)
        self.windows = (self.total_tokens - 1) // seq_len if self.total_tokens > 0 else 0
        self.seed = seed
        self.source_index = source_index
        self.shuffle = shuffle
        self.shuffle_windows = shuffle and shuffle_buffer > 1
        self.block = shuffle_buffer if self.shuffle_windows else READ_BLOCK
        self._perm_key: tuple[int, int] | None = None
        self._epoch_key: tuple[int, int] = (-1, 0)

    def shard_order(self, epoch: int) -> list[int]:
        """Indices of the shards (manifest order) in the order epoch `epoch` reads them."""
        n = len(self.n_tokens)
        if not self.shuffle or n == 1:
            return list(range(n))
        key = (self.seed, _SHARD_TAG, self.source_index, epoch)
        if self.window_order == "keyed":
            perm = KeyedPermutation(n, stream_key(*key))
            return [perm(i) for i in range(n)]
        if self.window_order == "epoch":
            return keyed_shuffle(n, stream_key(*key, _EPOCH_TAG))
        return np.random.default_rng(list(key)).permutation(n).tolist()

    def block_span(self, b: int) -> tuple[int, int]:
        """First window and number of windows of block b."""
        first = b * self.block
        return first, min(self.block, self.windows - first)

    def locate(self, j: int) -> tuple[int, int, int]:
        """(epoch, block, window) of stream index j."""
        epoch, p = divmod(j, self.windows)
        b, i = divmod(p, self.block)
        if not self.shuffle_windows:
            return epoch, b, p
        if self.window_order == "epoch":  # one block: the whole epoch
            if self._epoch_key[0] != epoch:
                key = stream_key(self.seed, _EPOCH_TAG, self.source_index, epoch)
                self._epoch_key, self._perm = (epoch, key), KeyedPermutation(self.windows, key)
            return epoch, 0, self._perm(p)
        if self._perm_key != (epoch, b):
            first, count = self.block_span(b)
            if self.window_order == "keyed":
                if self._epoch_key[0] != epoch:  # the per-epoch part of the key, mixed once per epoch
                    self._epoch_key = (epoch, stream_key(self.seed, _BLOCK_TAG, self.source_index, epoch))
                self._perm = KeyedPermutation(count, _mix64(self._epoch_key[1] ^ b))
            else:
                key = [self.seed, _BLOCK_TAG, self.source_index, epoch, b]
                self._perm = np.random.default_rng(key).permutation(count)
            self._first = first
            self._perm_key = (epoch, b)
        return epoch, b, self._first + int(self._perm(i) if self.window_order == "keyed" else self._perm[i])
