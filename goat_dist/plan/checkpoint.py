"""What one checkpoint of a layout costs: its size, the bytes each rank and node writes, the host memory a
save needs, and its time at a given file-system bandwidth.

The checkpoint format: every rank writes only its own share, without a gather. A rank's file holds its
ZeRO partition of the fp32 master weights and both Adam moments of its TP slice (12 bytes per parameter,
in bf16 and fp32 training alike), deduplicated across replicas: under ZeRO-0 each parameter's flat range
is split evenly over the DP x CP ranks; under ZeRO 1-2 a rank writes its optimizer partition of each flat
group, under ZeRO-3 its partition of each parameter (both over DP x CP, where ZeRO partitions). Next to it:
a per-rank RNG file (a few KB) and small JSON files on rank 0.

* size = 12 B x the parameters of every TP slice;
* per rank = 12 B x the rank's share (the busiest rank: partitions are rounded up); per node = the
  ranks of a node together;
* host memory of a save: a synchronous save streams one tensor at a time (per rank: 4 B x the largest
  single piece of its share), an asynchronous save stages the rank's whole share in pinned host memory
  (12 B x the share); per node, the ranks of a node together;
* time = size / the job's aggregate file-system write bandwidth (``--fs-gbps``) + a fixed overhead
  (directories, manifest, fsyncs, barriers).
"""

from __future__ import annotations

from ..config import Config
from .memory import _ceil_div, _cp, _flat_partition, _groups, param_inventory

BYTES_PER_PARAM = 12  # fp32 master + exp_avg + exp_avg_sq
MASTER_BYTES = 4  # one of the three, the unit a synchronous save streams
RNG_BYTES_PER_RANK = 16_000  # torch CPU + CUDA generator states, numpy and Python's (a few KB), rounded up
METADATA_BYTES = 1_000_000  # rank 0's manifest, trainer state, config copy: well under a megabyte
SAVE_OVERHEAD_S = 5.0  # as trainer/deadline.py: directories, manifest, fsyncs, barriers
DEFAULT_FS_GBPS = 10.0  # a parallel file system's aggregate write bandwidth for a job (GB/s)


def rank_share(cfg: Config, replicas: int) -> dict[str, int]:
    """Elements of the busiest rank's share of its TP slice, and its largest single piece."""
    inv = param_inventory(cfg.model, cfg.parallel.tp)
    stage = cfg.parallel.zero_stage
    if stage in (1, 2):
        parts = {g: _flat_partition(sum(sizes), replicas) for g, sizes in _groups(inv).items()}
        share = sum(parts.values())
        piece = max(min(p.numel, parts[p.group]) for p in inv)
    else:  # ZeRO-0: each parameter's range split over the replicas; ZeRO-3 partitions each parameter
        share = sum(_ceil_div(p.numel, replicas) for p in inv)
        piece = max(_ceil_div(p.numel, replicas) for p in inv)
    return {"share": share, "largest_piece": piece}


def checkpoint_cost(cfg: Config, world: int, gpus_per_node: int, fs_gbps: float = DEFAULT_FS_GBPS) -> dict:
    """Bytes, host memory and seconds of one save of ``cfg`` on ``world`` ranks (see the module doc)."""
    if fs_gbps <= 0:
        raise ValueError(f"--fs-gbps must be > 0 (GB/s of the job's file system), got {fs_gbps}")
    tp, cp = cfg.parallel.tp, _cp(cfg)
    replicas = world // (tp * cp) * cp
    per_tp_slice = sum(p.numel for p in param_inventory(cfg.model, tp))
    total = BYTES_PER_PARAM * per_tp_slice * tp + RNG_BYTES_PER_RANK * world + METADATA_BYTES
    share = rank_share(cfg, replicas)
    per_rank = BYTES_PER_PARAM * share["share"] + RNG_BYTES_PER_RANK
    ranks_per_node = min(gpus_per_node, world)
    sync_rank = MASTER_BYTES * share["largest_piece"]
    async_rank = BYTES_PER_PARAM * share["share"]
    return {
        "bytes": total,
        "bytes_per_rank": per_rank,
        "bytes_per_node": per_rank * ranks_per_node,
        "host_sync_per_node": sync_rank * ranks_per_node,
        "host_async_per_node": async_rank * ranks_per_node,
        "fs_gbps": fs_gbps,
        "save_s": total / (fs_gbps * 1e9) + SAVE_OVERHEAD_S,
    }
