"""``goat-dist doctor``: a preflight that fails fast, naming what is wrong, before hours of queueing are
spent on a job that cannot train.

Run it alone (``goat-dist doctor --config cfg.yaml [overrides]``), under ``torchrun``, or as every rank of a
Slurm job (``slurm/train.sbatch`` runs it first). It checks, in this order:

* devices: CUDA devices are visible to every rank (``LOCAL_RANK`` has a device, a small allocation works),
  and GPUs that Slurm allocated are not invisible to torch; on a CPU-only machine: CPU with gloo;
* all-reduce: a correctness check and a timed all-reduce across all ranks (device tensors with NCCL on
  CUDA, gloo on CPU), printing the measured algorithm and bus bandwidth (nccl-tests' definitions);
* run dir: writable from every node, and the same directory on all of them (a file rank 0 writes is
  visible to every node's first rank);
* data: the configured source(s) are reachable (manifest readable, shard files present), or for the
  builtin corpus, its cache is ready or can be built; a local data set's shards (every split) have the
  size its manifest records (a stat per shard, no reads: a truncated copy fails here, not hours into
  training);
* disk: free space on the run dir's file system for the next checkpoint, estimated from the model's
  parameter count (``checkpoint_bytes``);
* write: rank 0 times one process writing a temporary file in the run dir (``--write-mb``, at most a
  quarter of the free space; fsync'd, then deleted) and records the bandwidth in
  ``<run_dir>/checkpoints/write_bandwidth.json``, which the trainer's deadline uses for the first save's
  time until a save has been measured (``trainer/deadline.py``).

Exit status 0 when every check passed on every rank, 1 otherwise (2 for a bad config). Every failing rank
prints its own ``FAIL`` lines with its rank and host; rank 0 prints the summary.

The checks live by concern: ``environment`` (devices), ``rendezvous`` (process group, all-reduce, the
shared run dir), ``storage`` (run dir writable, write bandwidth), ``datasets`` (data sources), ``size``
(parameter count, checkpoint size, disk); ``report`` holds the per-rank report and ``command`` runs them
all and parses the command line.

May import: torch, ``goat_dist.atomic``, ``goat_dist.collectives``, ``goat_dist.config``,
``goat_dist.shapes``, ``goat_dist.distributed`` and ``goat_dist.data`` (the sources it checks); never the
model or the trainer (the trainer reads the bandwidth it records).
"""

from __future__ import annotations

from .command import cmd_doctor, main, register, run_doctor
from .datasets import SHARDS_NAMED, check_data, shard_size_problems
from .environment import check_devices
from .rendezvous import check_all_reduce, check_shared_run_dir, init_world
from .report import CHECKS, Report
from .size import BYTES_PER_PARAM, DISK_HEADROOM, check_disk, checkpoint_bytes, parameter_count
from .storage import (
    MIN_WRITE_BYTES,
    WRITE_BANDWIDTH,
    WRITE_CHUNK,
    check_run_dir_local,
    check_write_bandwidth,
    measure_write_bandwidth,
    recorded_write_bandwidth,
    write_bandwidth_path,
)

__all__ = [
    "BYTES_PER_PARAM",
    "CHECKS",
    "DISK_HEADROOM",
    "MIN_WRITE_BYTES",
    "SHARDS_NAMED",
    "WRITE_BANDWIDTH",
    "WRITE_CHUNK",
    "Report",
    "check_all_reduce",
    "check_data",
    "check_devices",
    "check_disk",
    "check_run_dir_local",
    "check_shared_run_dir",
    "check_write_bandwidth",
    "checkpoint_bytes",
    "cmd_doctor",
    "init_world",
    "main",
    "measure_write_bandwidth",
    "parameter_count",
    "recorded_write_bandwidth",
    "register",
    "run_doctor",
    "shard_size_problems",
    "write_bandwidth_path",
]
