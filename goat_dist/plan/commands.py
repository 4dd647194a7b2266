"""``goat-dist plan``: memory, largest micro-batch and throughput of a layout before any GPU hour is spent.

goat-dist plan --config configs/models/goat_1.3b.yaml --nodes 1 --gpus-per-node 8 --gpu h100-80gb
goat-dist plan --config configs/models/goat_6.7b.yaml --nodes 8 --materialize parallel.tp=8
goat-dist plan --config configs/models/goat_30b.yaml --nodes 64 --rehearse --layers 2
goat-dist plan --config configs/models/goat_30b.yaml --nodes 64 --search
"""

from __future__ import annotations

import json
import sys

from ..config import add_config_arguments


def cmd_plan(args) -> int:
    from ..config import ConfigError, load_config
    from .checkpoint import DEFAULT_FS_GBPS
    from .dry_run import DryRunError, materialize
    from .hardware import gpu as find_gpu
    from .planner import PlanError, format_plan, make_plan
    from .search import format_search, search

    try:
        cfg = load_config(args.config, args.overrides)
        device = find_gpu(args.gpu)
        if args.search:
            print(format_search(search(cfg, args.nodes, args.gpus_per_node, device, top=args.top)))
            return 0
        fs_gbps = DEFAULT_FS_GBPS if args.fs_gbps is None else args.fs_gbps
        plan = make_plan(cfg, args.nodes, args.gpus_per_node, device, fs_gbps=fs_gbps)
    except (ConfigError, PlanError, ValueError) as e:
        print(f"goat-dist plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan, indent=1))
    else:
        print(format_plan(plan))
    if args.materialize:
        print()
        try:
            materialize(cfg, plan["layout"]["world"])
        except (PlanError, DryRunError) as e:
            print(f"goat-dist plan: {e}", file=sys.stderr)
            return 2
    if args.rehearse:
        if args.rehearse_hook is None:
            print("goat-dist plan: --rehearse needs the full command line (goat-dist plan)", file=sys.stderr)
            return 2
        print()
        return args.rehearse_hook(cfg, args, plan["layout"]["world"], device)
    return 0


def register(sub, rehearse=None) -> None:
    """The ``plan`` command; ``rehearse``: what ``--rehearse`` runs (``rehearsal.commands.plan_rehearsal``,
    handed over by ``cli``, a floor above this package)."""
    p = sub.add_parser(
        "plan",
        help="per-GPU memory, largest micro-batch, step time and MFU of a layout (no GPU needed)",
        description=__doc__.split("\n\n")[0],
    )
    add_config_arguments(p)
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--gpu", default="h100-80gb", help="h100-80gb (default), h200, a100-80gb, a100-40gb, b200")
    p.add_argument(
        "--fs-gbps",
        type=float,
        default=None,
        help="aggregate write bandwidth of the job's file system in GB/s, for the checkpoint's save time "
        "(default 10: a parallel file system; measure yours with goat-dist doctor)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument(
        "--search",
        action="store_true",
        help="enumerate every layout the trainer accepts on these GPUs for the config's model, sequence "
        "length and global batch (TP, SP, CP, ZeRO stage, checkpointing, micro-batch) and print the "
        "fastest that fit, the config's own marked",
    )
    p.add_argument("--top", type=int, default=5, help="--search: how many layouts to print (default 5)")
    p.add_argument(
        "--materialize",
        action="store_true",
        help="also build every TP rank's real model and optimizer on the meta device in a fake world",
    )
    p.add_argument(
        "--rehearse",
        action="store_true",
        help="run one rank's real training step at this world size on the CPU, the GPU stood in by the meta "
        "device, and fail on placement faults, host syncs, kernel refusals and rank-conditional collectives",
    )
    p.add_argument(
        "--rank",
        type=int,
        default=None,
        help="the rank to rehearse (default: the last, which holds the most)",
    )
    p.add_argument(
        "--layers", type=int, default=None, help="rehearse a cut model of this many blocks (default: all)"
    )
    p.set_defaults(func=cmd_plan, rehearse_hook=rehearse)
