"""``goat-dist`` command line: ``goat-dist train [--config FILE] [section.key=value ...]``.

``torchrun --nproc_per_node=N -m goat_dist train ...`` is the distributed form of the same command.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings


def _quiet_third_party() -> None:
    """Silence import-time noise from megatron/deepspeed that says nothing about the run."""
    warnings.filterwarnings("ignore", module="megatron")
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex")
    warnings.filterwarnings("ignore", category=FutureWarning)
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not _cuda() else "cuda")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def cmd_train(args: argparse.Namespace) -> int:
    from .config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"goat-dist train: {e}", file=sys.stderr)
        return 2
    _quiet_third_party()
    from .checkpoint import CheckpointError
    from .distributed import LayoutError, exit_process
    from .trainer import run
    from .trainer.signals import EXIT_CHECKPOINTED

    try:
        state = run(cfg)
    except (LayoutError, CheckpointError) as e:
        print(f"goat-dist train: {e}", file=sys.stderr)
        exit_process(2)
    # deterministic teardown; never returns. A run stopped by a signal exits EXIT_CHECKPOINTED (75).
    exit_process(EXIT_CHECKPOINTED if state.stop_requested else 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="goat-dist", description="Pretrain decoder LMs with GOAT attention priors."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model (default: the tiny GOAT model on the builtin corpus)")
    train.add_argument("--config", help="YAML config file (default: the built-in tiny config)")
    train.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=50 run.dir=runs/x"
    )
    train.set_defaults(func=cmd_train)
    from .data.commands import register as register_data

    register_data(sub)
    from .checkpoint.commands import register as register_ckpt

    register_ckpt(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _quiet_third_party()
    from .checkpoint import CheckpointError

    try:
        return args.func(args)
    except CheckpointError as e:
        print(f"goat-dist {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
