"""``goat-dist doctor`` itself: every check in order on this rank, the summary rank 0 prints, and the
command line (``python -m goat_dist.doctor`` runs it without the CLI's other commands)."""

from __future__ import annotations

import argparse
import importlib
import os
import socket
import sys
import time

from ..config import add_config_arguments
from .datasets import check_data
from .environment import check_devices
from .rendezvous import _agree, check_all_reduce, check_shared_run_dir, init_world
from .report import CHECKS, Report
from .size import check_disk
from .storage import check_run_dir_local, check_write_bandwidth


def run_doctor(
    cfg, nbytes: int, iters: int, timeout_s: float, environ=os.environ, write_bytes: int = 0, rehearse=None
) -> int:
    """All checks on this rank; returns the exit status (0: all passed on every rank). ``write_bytes``:
    the size of rank 0's write-bandwidth probe (0: not measured). ``rehearse``: the rehearsal check
    (``rehearsal.commands.doctor_check(report, cfg, environ)``, run before any process group exists), or
    None to skip it."""
    import torch.distributed as dist

    started = time.perf_counter()
    rank = int(environ.get("RANK", 0))
    local_rank = int(environ.get("LOCAL_RANK", 0))
    local_world = int(environ.get("LOCAL_WORLD_SIZE", 1))
    host = socket.gethostname()
    report = Report(rank, host)
    run_dir = cfg.run_dir.expanduser().resolve()

    device = check_devices(report, environ, local_rank, local_world)
    if rehearse is not None:
        rehearse(report, cfg, environ)
    writable = True
    if local_rank == 0:  # once per node: node-local views of shared file systems
        writable = check_run_dir_local(report, run_dir)
        check_data(report, cfg)
        if writable:
            check_disk(report, cfg, run_dir)
        if writable and rank == 0 and write_bytes > 0:
            check_write_bandwidth(report, run_dir, write_bytes)
    # A rank without a usable device, or outside the process group, cannot join the collectives: it
    # stops here, and the launcher (srun --kill-on-bad-exit, torchrun) ends the other ranks.
    created = not dist.is_initialized()
    if device is None or not init_world(report, device, timeout_s):
        return 1
    world = dist.get_world_size()
    try:
        check_all_reduce(report, device, nbytes, iters)
        check_shared_run_dir(report, device, run_dir, local_rank, writable)
        failed_mask = _agree(device, report.mask())
    finally:
        if created:
            dist.destroy_process_group()
    failed = [c for i, c in enumerate(CHECKS) if failed_mask >> i & 1]
    if rank == 0:
        nodes = environ.get("GROUP_WORLD_SIZE") or environ.get("SLURM_NNODES") or "1"
        print(f"goat-dist doctor: {world} rank(s) on {nodes} node(s); run dir {run_dir}")
        for line in report.lines:
            print(line)
        seconds = time.perf_counter() - started
        if failed:
            print(
                f"goat-dist doctor: FAILED ({', '.join(failed)}); see the FAIL lines above ({seconds:.1f} s)",
                file=sys.stderr,
            )
        else:
            print(f"goat-dist doctor: all checks passed ({seconds:.1f} s)")
        sys.stdout.flush()
    return 1 if failed else 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from ..config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"goat-dist doctor: {e}", file=sys.stderr)
        return 2
    from ..shapes import resolve_key_bias_lanes

    resolve_key_bias_lanes(cfg.model, cfg.train.precision)  # GOAT's lanes as the planner sizes them
    import torch

    cuda = torch.cuda.is_available()
    nbytes = int(args.allreduce_mb * 2**20) if args.allreduce_mb else (256 if cuda else 16) * 2**20
    write_mb = args.write_mb if args.write_mb is not None else (256 if cuda else 64)
    if write_mb < 0:
        print(f"goat-dist doctor: --write-mb must be >= 0, got {write_mb:g}", file=sys.stderr)
        return 2
    rehearse = getattr(args, "rehearse_hook", None)
    if args.rehearse == "off" or (args.rehearse == "auto" and not cuda):
        rehearse = None
    elif rehearse is None and args.rehearse == "on":
        print(
            "goat-dist doctor: --rehearse on needs the full command line (goat-dist doctor)",
            file=sys.stderr,
        )
        return 2
    return run_doctor(
        cfg, nbytes, args.iters, args.timeout, write_bytes=int(write_mb * 2**20), rehearse=rehearse
    )


def register(sub, rehearse=None) -> None:
    """The ``doctor`` command; ``rehearse``: its rehearsal check (``rehearsal.commands.doctor_check``, handed
    over by ``cli``, a floor above this package; ``python -m goat_dist.doctor`` runs without it)."""
    p = sub.add_parser(
        "doctor",
        help="preflight: devices, all-reduce bandwidth, run dir, data, disk, write bandwidth (exit 1 naming "
        "what fails)",
        description=importlib.import_module(__package__).__doc__.split("\n\n")[0],
    )
    add_config_arguments(p)
    p.add_argument(
        "--allreduce-mb", type=float, default=None, help="all-reduce MiB (default 256 on CUDA, 16 on CPU)"
    )
    p.add_argument("--iters", type=int, default=5, help="timed all-reduces (default 5)")
    p.add_argument(
        "--write-mb",
        type=float,
        default=None,
        help="MiB rank 0 writes to time the run dir's file system (default 256 on CUDA, 64 on CPU; 0: skip)",
    )
    p.add_argument(
        "--timeout", type=float, default=300.0, help="seconds to wait for all ranks to join (default 300)"
    )
    p.add_argument(
        "--rehearse",
        choices=("auto", "on", "off"),
        default="auto",
        help="rehearse this node's last rank's training step (goat-dist plan --rehearse, a 2-block cut) "
        "before the other checks: auto (default) on a GPU node, on, off",
    )
    p.set_defaults(func=cmd_doctor, rehearse_hook=rehearse)


def main(argv: list[str] | None = None) -> int:
    """``python -m goat_dist.doctor``: the same as ``goat-dist doctor``, without loading the CLI's other
    commands (their imports of megatron/DeepSpeed take seconds that a preflight need not spend)."""
    parser = argparse.ArgumentParser(prog="goat-dist")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["doctor", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)
