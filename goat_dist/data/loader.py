"""Training/validation loader: weighted shard sources -> packed windows -> per-rank micro-batches.

Why: the trainer needs batches that are a pure function of (sources, seed, sample index), so that
runs are reproducible, data-parallel ranks never overlap, and a restart continues exactly where
the previous run stopped, whatever the number of DataLoader workers.

The global sample stream (identical on every rank and worker):
  * every source is a packed stream of windows of `seq_len + 1` tokens (stride `seq_len`) over
    its documents; epoch e reads the source's shards in a seeded order and shows its windows in
    the order `window_order` (see `schedule.SourceSchedule`): "epoch" (default), a seeded bijection
    of all the epoch's windows evaluated per sample, so consecutive samples come from anywhere in
    the source; "keyed", the same within blocks of `shuffle_buffer` consecutive windows, and
    "numpy", a numpy shuffle of each such block (streams begun before "epoch"/"keyed" existed; the
    data contract keeps a resume in its order); windows
    never cross an epoch and the tail of an epoch (< one window) is dropped;
  * global sample n comes from source `Mixture.locate(n)`: in every chunk of 4096 samples each
    source has round(4096 * weight) slots, in a seeded random order; each source advances its
    own stream (its own epochs) only when it is picked;
  * sample n gives tokens = window[:-1], labels = window[1:] (next token, across document
    boundaries), position_ids = 0..seq_len-1, or with `document_masking=True` the offset from the
    start of the token's document: positions restart at 0 after every EOS, and a document that
    began in the previous window of the stream continues its count (so positions can exceed
    seq_len). Document boundaries are where position_ids[t] != position_ids[t-1] + 1.
    With `bos_framing=True` (data.bos_framing) windows are `seq_len` tokens at stride `seq_len - 1`,
    tokens = [BOS] + window[:-1] and labels = window (`framing`: the BOS predicts the first corpus
    token, no position predicts a BOS); positions 0..seq_len-1.

Distribution: global sample n belongs to data-parallel rank n % dp_size. A rank's k-th
micro-batch holds its samples [k*B, (k+1)*B) (B = micro_batch_size), in rank order; DataLoader
worker w builds micro-batches w, w+W, w+2W, ..., so the DataLoader's round-robin over workers
returns micro-batches 0, 1, 2, ... in order: the batches are identical for any num_workers.

Exact resume: `start_sample=S` is the number of samples already consumed by all ranks together
(RunState.consumed_samples; a multiple of the global batch size, and S % dp_size == 0 is
required). The rank then yields its samples of the global stream from S on: with the same
dp_size that is exactly the rest of the uninterrupted run, for any num_workers. With another
dp_size the global stream from S on is split anew (sample n >= S to rank n % dp_size): the
union over ranks is still exactly the samples S, S+1, ... of the same stream, so within an
epoch no sample is repeated or skipped. Skipping to S costs O(1) arithmetic: nothing before it is
read. What must stay
the same for this: the sources (order, weights, contents), seed, seq_len, shuffle_buffer, window_order
and document_masking; micro_batch_size, num_workers and (as above) dp_size may change. The trainer
stores only S (all ranks' consumed samples) and passes it back as `start_sample`.

Reads: a rank (and each of its workers) reads only the windows of its own samples, by offset, through
each shard's index (`shard_index`): (L + 1) tokens per sample plus one index read per shard it opens,
whatever dp is. Sample n -> (source, epoch, window) is arithmetic (`schedule`), window -> (shard,
byte offset) a binary search. Tensor- and context-parallel peers read the same windows (a window is a
few KB, served by the page cache of their node), so no broadcast is needed.

Bad data (`on_error`): "raise" stops with a ShardError naming the shard (and the sample key where
known) at the first read of a damaged shard. "skip" logs the shard once per worker (logger
`goat_dist.data`) and treats its unreadable part (the documents past where it was cut, or all of it)
as missing: those tokens become EOS with label -100 on every position whose input or target is
unreadable, so all other samples keep their place (deterministic, resumable). Every batch carries
`skipped`, a 0-d int64 tensor: how many of its samples contain unreadable tokens (0 normally).
The loss must ignore label -100 (megatron's vocab_parallel_cross_entropy does not by itself).

Validation (`build_val_loader`): the "val" split, shards in manifest order, no window shuffle,
mixture seed 0, start 0; infinite (it cycles), so the first `eval_batches` of a fresh iterator
are the same fixed subset at every evaluation.
"""

from __future__ import annotations

import atexit
import functools
import os
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from goat_dist.data import framing, shard_index
from goat_dist.data.reader import EpochReader, Span, open_files, plan_remote, start_prefetch
from goat_dist.data.schedule import DEFAULT_WINDOW_ORDER, Mixture, SourceSchedule
from goat_dist.data.shard_index import DEFAULT_CACHE_MAX_GB, ShardFiles
from goat_dist.data.sources import SourceSplit, resolve_sources

ON_ERROR = ("raise", "skip")
DEFAULT_CACHE_DIR = "~/.cache/goat-dist"  # data.cache_dir's default
IGNORE_INDEX = -100


class _SourceWindows:
    """Reads the windows of one source's stream; the epoch's reader is kept until the epoch changes."""

    def __init__(
        self, split: SourceSplit, schedule: SourceSchedule, on_error: str, warned: set, files: ShardFiles
    ):
        self.split, self.schedule, self.on_error, self.warned = split, schedule, on_error, warned
        self.files = files
        self.epoch = -1
        self.reader: EpochReader | None = None

    def window(self, epoch: int, w: int) -> Span:
        """Tokens [w * L, w * L + L + 1) of epoch `epoch`."""
        if epoch != self.epoch:
            order = self.schedule.shard_order(epoch)
            if self.reader is None or self.reader.order != order:  # one shard: the same every epoch
                eos = self.split.eos_id
                self.reader = EpochReader(self.split, order, self.on_error, eos, self.warned, self.files)
            self.epoch = epoch
        L = self.schedule.seq_len
        return self.reader.read(w * L, w * L + L + 1)


class PackedBatches(IterableDataset):
    """Infinite stream of this rank's micro-batches; use with ``DataLoader(ds, batch_size=None)``.

    Yields dicts: "tokens", "labels", "position_ids" (LongTensors (B, seq_len)) and "skipped"
    (0-d int64). See the module docstring for the order, resume and error guarantees.
    """

    def __init__(
        self,
        sources: Sequence[SourceSplit],
        seq_len: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        start_sample: int = 0,
        document_masking: bool = False,
        shuffle_buffer: int = 1024,
        on_error: str = "raise",
        shuffle: bool = True,
        cache_dir: str | os.PathLike | None = DEFAULT_CACHE_DIR,
        cache_max_gb: float | None = DEFAULT_CACHE_MAX_GB,
        remote_cache_dir: str | os.PathLike | None = None,
        window_order: str = DEFAULT_WINDOW_ORDER,
        bos_framing: bool = False,
    ):
        super().__init__()
        if seq_len < 1 or micro_batch_size < 1:
            raise ValueError(f"need seq_len, micro_batch_size >= 1, got {seq_len}, {micro_batch_size}")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank} dp_size={dp_size}")
        if start_sample < 0 or start_sample % dp_size:
            raise ValueError(f"start_sample must be >= 0 and a multiple of dp_size={dp_size}: {start_sample}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
        self.sources = list(sources)
        self.seq_len, self.micro_batch_size = seq_len, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.start_sample = seed, start_sample
        self.document_masking, self.on_error = document_masking, on_error
        self.cache_dir = cache_dir  # indexes of shards without one, and copies of remote shards
        if bos_framing and document_masking:
            raise ValueError("bos_framing and document_masking cannot be combined (data.bos_framing)")
        # BOS framing (data/framing.py): windows advance by seq_len - 1 corpus tokens, BOS first
        self.bos = [framing.bos_id(s) for s in self.sources] if bos_framing else None
        step = framing.stride(seq_len, bos_framing)
        self.schedules = [
            SourceSchedule(s.n_tokens, step, seed, i, shuffle_buffer, shuffle, window_order)
            for i, s in enumerate(self.sources)
        ]
        for s, sched in zip(self.sources, self.schedules):
            if sched.windows < 1:
                raise ValueError(
                    f"data source {s.path} holds {s.total_tokens} tokens, fewer than seq_len + 1 = "
                    f"{seq_len + 1}; no training sequence can be formed"
                )
        Mixture([s.weight for s in self.sources], seed)  # validates the weights now, not in a worker
        # remote sources: staged within data.cache_max_gb and prefetched (reader.plan_remote; checked now)
        self.remote = plan_remote(self.sources, self.schedules, cache_dir, cache_max_gb, remote_cache_dir)

    @property
    def windows_per_epoch(self) -> list[int]:
        """Samples in one epoch of each source."""
        return [s.windows for s in self.schedules]

    def global_samples(self, k: int) -> list[int]:
        """Global sample indices of this rank's micro-batch k (counted from start_sample)."""
        first = self.start_sample // self.dp_size + k * self.micro_batch_size
        return [(first + t) * self.dp_size + self.dp_rank for t in range(self.micro_batch_size)]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        worker, n_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        mixture = Mixture([s.weight for s in self.sources], self.seed)
        warned: set = set()
        _keep_open(self.sources)
        files = open_files(self.remote, self.cache_dir)  # this process's: workers never share descriptors
        prefetch = start_prefetch(
            self.remote, files, self.sources, self.schedules, mixture, self.global_samples, worker, n_workers
        )
        windows = [
            _SourceWindows(src, sched, self.on_error, warned, files)
            for src, sched in zip(self.sources, self.schedules)
        ]
        try:
            k = worker
            while True:
                prefetch.advance(k)
                yield self._batch(k, mixture, windows)
                k += n_workers
        finally:
            prefetch.close()
            files.close()

    def _batch(self, k: int, mixture: Mixture, windows: list[_SourceWindows]) -> dict[str, torch.Tensor]:
        L, B = self.seq_len, self.micro_batch_size
        # One storage for the whole batch: a DataLoader worker then ships one shared-memory
        # segment per batch instead of one per tensor.
        storage = torch.empty(3 * B * L + 1, dtype=torch.int64)
        out = storage[:-1].view(3, B, L)
        tokens, labels, positions = out.numpy()
        holes = []
        for t, n in enumerate(self.global_samples(k)):
            s, j = mixture.locate(n)
            epoch, _, w = self.schedules[s].locate(j)
            span = windows[s].window(epoch, w)
            framing.cut(span.tokens, tokens[t], labels[t], None if self.bos is None else self.bos[s])
            if self.document_masking:
                offsets = np.arange(w * L, w * L + L)
                idx = np.searchsorted(span.doc_starts, offsets, side="right") - 1
                positions[t] = offsets - span.doc_starts[idx]
            if span.missing is not None and span.missing.any():
                m = span.missing
                labels[t, framing.unreadable(m, self.bos is not None)] = IGNORE_INDEX
                holes.append(t)
        if not self.document_masking:
            positions[:] = np.arange(L)
        storage[-1] = len(holes)
        return {"tokens": out[0], "labels": out[1], "position_ids": out[2], "skipped": storage[-1]}


def _keep_open(sources: Sequence[SourceSplit]) -> None:
    """Let this process (a rank, or one of its workers) keep every shard of its sources open, within a
    quarter of its file descriptor limit (an open shard holds two: the file and its index's map).

    Why: under window_order=epoch (and under any order at a large dp) consecutive samples of a rank come
    from anywhere in a source, so a least-recently-used cap below the number of shards would reopen a
    shard for most samples, and a reopening reads the index's header twice (up to 16 KB, four times a
    2048-token window) and costs ~0.5 ms. Raises ``shard_index.OPEN_SHARDS`` (never lowers it)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = sum(len(s.shards) for s in sources)
    if soft != resource.RLIM_INFINITY:
        want = min(want, soft // 4)
    shard_index.OPEN_SHARDS = max(shard_index.OPEN_SHARDS, want)


def _ignore_stop_signals(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: workers ignore SIGTERM, SIGUSR1, SIGINT and SIGUSR2.

    Why: a signal sent to the whole process group (Slurm signals every process of a step; torchrun uses
    killpg) also reaches the workers, which are forked before the trainer installs its handlers. A worker
    killed by it makes the main process raise "DataLoader worker ... killed" instead of saving at the next
    step boundary; SIGUSR2 (``scancel --signal=USR2``: print the trainer's stacks) would kill it by default.
    The trainer (main process) decides; workers end when the loader shuts them down."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)


def _kill_leftover_workers() -> None:
    """atexit: end this process's daemonic children (DataLoader workers) still alive at interpreter exit.

    Why: workers ignore SIGTERM (above), and multiprocessing's own exit hook ends daemonic children with
    SIGTERM and then joins them, so a loader never shut down (an iterator still referenced at exit) would
    make the process wait forever after its last line. This does what that hook does (daemonic children die
    with their parent), with SIGKILL after a grace period; it is registered later, so it runs first."""
    import multiprocessing
    import signal

    children = [p for p in multiprocessing.active_children() if p.daemon]
    if not children:
        return
    # torch's SIGCHLD handler raises "DataLoader worker ... is killed" at the first death: not an error here
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for proc in children:
        proc.terminate()
    for proc in children:
        proc.join(timeout=1)
        if proc.is_alive():
            proc.kill()
    for proc in children:
        proc.join(timeout=10)


@functools.cache
def _register_worker_reaper() -> None:
    atexit.register(_kill_leftover_workers)


def _loader(dataset: PackedBatches, num_workers: int, pin_memory: bool) -> DataLoader:
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    if num_workers:
        _register_worker_reaper()
    return DataLoader(
        dataset,
        batch_size=None,
        num_workers=num_workers,
        pin_memory=pin_memory,
        worker_init_fn=_ignore_stop_signals if num_workers else None,
    )


def build_train_loader(
    sources: Sequence[dict | str | os.PathLike] | str | os.PathLike,
    seq_len: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    start_sample: int = 0,
    num_workers: int = 0,
    document_masking: bool = False,
    shuffle_buffer: int = 1024,
    on_error: str = "raise",
    split: str = "train",
    pin_memory: bool = False,
    cache_dir: str | os.PathLike | None = DEFAULT_CACHE_DIR,
    cache_max_gb: float | None = DEFAULT_CACHE_MAX_GB,
    remote_cache_dir: str | os.PathLike | None = None,
    window_order: str = DEFAULT_WINDOW_ORDER,
    bos_framing: bool = False,
) -> DataLoader:
    """DataLoader of this rank's training micro-batches, resumed at global sample `start_sample`.

    `sources`: `[{"path": dir_or_url_prefix, "weight": w}, ...]` (a bare path means weight 1).
    """
    dataset = PackedBatches(
        resolve_sources(sources, split),
        seq_len,
        micro_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=seed,
        start_sample=start_sample,
        document_masking=document_masking,
        shuffle_buffer=shuffle_buffer,
        on_error=on_error,
        cache_dir=cache_dir,
        cache_max_gb=cache_max_gb,
        remote_cache_dir=remote_cache_dir,
        window_order=window_order,
        bos_framing=bos_framing,
    )
    return _loader(dataset, num_workers, pin_memory)


def build_val_loader(
    sources: Sequence[dict | str | os.PathLike] | str | os.PathLike,
    seq_len: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    num_workers: int = 0,
    document_masking: bool = False,
    on_error: str = "raise",
    split: str = "val",
    pin_memory: bool = False,
    cache_dir: str | os.PathLike | None = DEFAULT_CACHE_DIR,
    cache_max_gb: float | None = DEFAULT_CACHE_MAX_GB,
    remote_cache_dir: str | os.PathLike | None = None,
    bos_framing: bool = False,
) -> DataLoader:
    """DataLoader of this rank's validation micro-batches: fixed order, infinite (see module doc)."""
    dataset = PackedBatches(
        resolve_sources(sources, split),
        seq_len,
        micro_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=0,
        document_masking=document_masking,
        on_error=on_error,
        shuffle=False,
        cache_dir=cache_dir,
        cache_max_gb=cache_max_gb,
        remote_cache_dir=remote_cache_dir,
        bos_framing=bos_framing,
    )
    return _loader(dataset, num_workers, pin_memory)
