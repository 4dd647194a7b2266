"""Connections one rank opens for its process groups, by world size: a fake world of up to 512 ranks.

Why: a gloo group connects every pair of its ranks when it is created (a full mesh: size - 1 sockets on
each rank), so a gloo side on the world group costs every rank world - 1 sockets at start (511 at 512
ranks, each a file descriptor, all opened in one burst). An NCCL communicator connects a rank to a few
neighbours (its ring and tree peers; a bootstrap ring of 2), whatever the group's size, and only when the
group is first used. The CUDA run's world backend is ``distributed.backend_for(True)``; this bench builds
one rank's groups as ``distributed.init`` does (megatron's TP, CP, DP groups and the rest, in torch's fake
world, recording each ``new_group`` call) and counts what each would open:

* gloo full-mesh sockets: for each group with a gloo side that holds the rank, its size - 1;
* NCCL communicators: the groups that hold the rank (each O(1) connections, created lazily).

    python bench/world_sockets.py [--worlds 8 64 512] [--tp 8] [--cp 1]

The last line compares the project's backend with the mixed ``cpu:gloo,cuda:nccl`` world it replaced.
"""

from __future__ import annotations

import argparse
import contextlib

MIXED = "cpu:gloo,cuda:nccl"  # the world backend with a gloo side (host tensors on the world group)
NCCL_ONLY_GROUPS = "nccl"  # every other group of a CUDA run


@contextlib.contextmanager
def recorded_groups(calls: list):
    """Record ``(ranks, backend)`` of every ``torch.distributed.new_group`` call made meanwhile."""
    import torch.distributed as dist

    original = dist.new_group

    def new_group(ranks=None, *args, **kwargs):
        calls.append((None if ranks is None else sorted(ranks), kwargs.get("backend")))
        return original(ranks, *args, **kwargs)

    dist.new_group = new_group
    try:
        yield calls
    finally:
        dist.new_group = original


def rank_connections(world: int, rank: int, tp: int, cp: int, world_backend: str) -> dict[str, int]:
    """What global ``rank`` opens in a world of ``world`` ranks whose world group has ``world_backend`` and
    whose other groups get NCCL (or the backend they were created with)."""
    from goat_dist import distributed

    calls: list = []
    with recorded_groups(calls):
        distributed.init_fake(rank, world, tp, cp)
    distributed.teardown_fake()
    groups = [(list(range(world)), world_backend)]
    groups += [(ranks or list(range(world)), backend or NCCL_ONLY_GROUPS) for ranks, backend in calls]
    mine = [(ranks, backend) for ranks, backend in groups if rank in ranks]
    gloo = [len(ranks) - 1 for ranks, backend in mine if "gloo" in backend and len(ranks) > 1]
    nccl = [ranks for ranks, backend in mine if "nccl" in backend and len(ranks) > 1]
    return {"groups": len(mine), "gloo_sockets": sum(gloo), "nccl_communicators": len(nccl)}


def main() -> None:
    import warnings

    from goat_dist.distributed import backend_for

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 512])
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--cp", type=int, default=1)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    ours = backend_for(True)
    print(f"one rank's process-group connections on CUDA, TP {args.tp} x CP {args.cp}, last rank")
    print(f"{'world':>6} {'world backend':>20} {'groups':>7} {'gloo sockets':>13} {'NCCL comms':>11}")
    last = {}
    for world in args.worlds:
        for backend in (MIXED, ours):
            got = rank_connections(world, world - 1, args.tp, args.cp, backend)
            last[backend] = got
            print(f"{world:>6} {backend:>20} {got['groups']:>7} {got['gloo_sockets']:>13} "
                  f"{got['nccl_communicators']:>11}")  # fmt: skip
    world = args.worlds[-1]
    print(f"gloo sockets per rank at world {world}: {last[MIXED]['gloo_sockets']} with {MIXED}, "
          f"{last[ours]['gloo_sockets']} with {ours}; NCCL communicators per rank: "
          f"{last[ours]['nccl_communicators']} (each connects O(1) peers, on first use)")  # fmt: skip


if __name__ == "__main__":
    main()
