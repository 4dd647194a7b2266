"""``goat-dist`` command line: ``goat-dist train [--config FILE] [section.key=value ...]``.

``torchrun --nproc_per_node=N -m goat_dist train ...`` (or ``goat-dist train --nproc N ...``) is the
distributed form of the same command.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from .config import add_config_arguments


def _quiet_third_party() -> None:
    """Silence import-time noise from megatron-core and DeepSpeed that says nothing the user can act on
    (optional GPU packages absent on purpose, deprecations inside those libraries)."""
    warnings.filterwarnings("ignore", module="megatron")
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex")
    warnings.filterwarnings("ignore", category=FutureWarning)


def _select_accelerator() -> None:
    """DeepSpeed picks its accelerator when first imported; name it, so it neither guesses nor warns."""
    import torch

    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")


def cmd_train(args: argparse.Namespace) -> int:
    """Train; errors of the user's (config, data, checkpoint, layout) print once, from rank 0, and exit 2
    (``trainer.entry.report_user_error``). ``--nproc N`` starts the local torchrun world itself."""
    from .config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        from .trainer.entry import report_user_error

        return report_user_error(e)
    if args.nproc > 1 and "RANK" not in os.environ:
        from .launcher import run_world

        given = ["--config", args.config] if args.config else []
        return run_world(args.nproc, ["-m", "goat_dist", "train", *given, *args.overrides])
    from .distributed import exit_process
    from .trainer import run
    from .trainer.entry import USER_ERRORS, process_exit_code, report_user_error
    from .trainer.signals import EXIT_ABORTED

    try:
        state = run(cfg)
    except USER_ERRORS as e:
        exit_process(report_user_error(e, cfg.run_dir))
    except KeyboardInterrupt:  # a second Ctrl-C: abort at once, without a checkpoint
        if os.environ.get("RANK", "0") == "0":
            print("goat-dist train: aborted (a second Ctrl-C): no checkpoint of this step", file=sys.stderr)
        exit_process(EXIT_ABORTED)
    # deterministic teardown; never returns. After a stop by a signal rank 0 exits EXIT_CHECKPOINTED (75)
    exit_process(process_exit_code(state))


def _plan_rehearsal(*args) -> int:
    """``goat-dist plan --rehearse`` (``rehearsal`` sits above ``plan``: handed over, imported when run)."""
    from .rehearsal.commands import plan_rehearsal

    return plan_rehearsal(*args)


def _doctor_rehearsal(*args) -> None:
    """``goat-dist doctor``'s rehearsal check (``rehearsal.commands.doctor_check``), imported when run."""
    from .rehearsal.commands import doctor_check

    doctor_check(*args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="goat-dist", description="Pretrain decoder LMs with GOAT attention priors."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model (default: the tiny GOAT model on the builtin corpus)")
    add_config_arguments(train)
    train.add_argument(
        "--nproc", type=int, default=1, help="processes on this machine (goat-dist starts torchrun itself)"
    )
    train.set_defaults(func=cmd_train)
    from data_tools.cli import register as register_data

    register_data(sub)
    from .checkpoint.commands import register as register_ckpt

    register_ckpt(sub)
    from .doctor import register as register_doctor

    register_doctor(sub, rehearse=_doctor_rehearsal)
    from .evaluation.commands import register as register_eval

    register_eval(sub)  # eval ppl | eval passkey | study
    from .plan.commands import register as register_plan

    register_plan(sub, rehearse=_plan_rehearsal)
    from .kernels.warm import register as register_kernels

    register_kernels(sub)  # kernels warm
    return parser


def main(argv: list[str] | None = None) -> int:
    if "RANK" in os.environ:  # a worker of torchrun, srun or --nproc: it ends with its launcher
        from .lifeline import watch_launcher

        watch_launcher()
    _quiet_third_party()
    args = build_parser().parse_args(argv)
    if args.command == "data":  # data preparation never loads torch or DeepSpeed
        return args.func(args)
    _select_accelerator()
    from .checkpoint import CheckpointError
    from .inference import ExportDirError

    try:
        return args.func(args)
    except (CheckpointError, ExportDirError) as e:
        print(f"goat-dist {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
