"""The data command line, defined once: `python -m data_tools ...` and `goat-dist data ...`.

Subcommands: `tokenizer train`, `prepare`, `inspect`. Why here: a CPU data-preparation node runs
them without torch (`python -m data_tools`); `goat_dist.cli` mounts the same parser under `data`
with `register(subparsers)`. Exit codes: 0 ok, 1 `inspect` found corrupt shards (named), 2 a user
error as everywhere in goat-dist: bad input data (named by file and line), arguments or output dir.
Every command sets `func(args) -> int`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from data_tools.inputs import check_text_field, expand_inputs, iter_inputs

PROG = "python -m data_tools"


def _error(args: argparse.Namespace, cmd: str, exn: BaseException | str, code: int) -> int:
    print(f"{args.data_prog} {cmd}: error: {exn}", file=sys.stderr)
    return code


def cmd_tokenizer_train(args: argparse.Namespace) -> int:
    from data_tools.tokenizer import train_bpe

    try:
        files = expand_inputs(args.input)
        check_text_field(files, args.text_field)
        texts = (text for text, _ in iter_inputs(files, args.text_field))
        tok = train_bpe(texts, args.vocab_size, args.out, overwrite=args.force)
    except FileExistsError as exn:
        return _error(args, "tokenizer train", f"{exn}; pass --force to replace it", 2)
    except (ValueError, OSError) as exn:  # InputError (bad data) is one; OSError: --out can't be written
        return _error(args, "tokenizer train", exn, 2)
    print(f"[data] tokenizer with {tok.get_vocab_size():,} tokens from {len(files)} file(s) -> {args.out}")
    return 0


def _command_line(args: argparse.Namespace) -> str:
    """The prepare command as a shell line (recorded in the manifest; --workers left out: no effect)."""
    parts = [*shlex.split(args.data_prog), "prepare", "--input", *args.input, "--tokenizer", args.tokenizer]
    parts += ["--out", args.out, "--text-field", args.text_field, "--shard-size", str(args.shard_size)]
    if args.val_docs is not None:
        parts += ["--val-docs", str(args.val_docs)]
    else:
        parts += ["--val-fraction", str(args.val_fraction)]
    parts += ["--prefix", args.prefix, "--val-prefix", args.val_prefix]
    if args.eos_token is not None:
        parts += ["--eos-token", args.eos_token]
    return shlex.join(parts)


def cmd_prepare(args: argparse.Namespace) -> int:
    from data_tools.prepare import PrepareError, prepare

    try:
        prepare(
            args.input,
            args.tokenizer,
            args.out,
            text_field=args.text_field,
            workers=args.workers,
            shard_size_mb=args.shard_size,
            val_fraction=0.01 if args.val_fraction is None else args.val_fraction,
            val_docs=args.val_docs,
            prefix=args.prefix,
            val_prefix=args.val_prefix,
            eos_token=args.eos_token,
            command=_command_line(args),
            show_progress=not args.no_progress,
            overwrite=args.overwrite,
            restart=args.restart,
        )
    except (PrepareError, ValueError, FileNotFoundError) as exn:  # InputError: a ValueError
        return _error(args, "prepare", exn, 2)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from data_tools.inspection import inspect_dataset

    try:
        corrupt = inspect_dataset(args.dir, decode=args.decode, tokenizer=args.tokenizer)
    except (ValueError, FileNotFoundError) as exn:
        return _error(args, "inspect", exn, 2)
    return 1 if corrupt else 0


def _add_tokenizer(sub) -> None:
    p = sub.add_parser("tokenizer", help="tokenizer tools")
    tsub = p.add_subparsers(dest="tokenizer_command", required=True)
    t = tsub.add_parser("train", help="train a byte-level BPE tokenizer on text/JSONL/Parquet inputs")
    t.add_argument("--input", nargs="+", required=True, help="files, directories or globs")
    t.add_argument("--vocab-size", type=int, required=True)
    t.add_argument("--out", required=True, help="tokenizer.json to write (its directory is created)")
    t.add_argument("--text-field", default="text", help="JSONL field / Parquet, Arrow column (default: text)")
    t.add_argument("--force", action="store_true", help="replace --out if it exists (default: refuse)")
    t.set_defaults(func=cmd_tokenizer_train)


def _add_prepare(sub) -> None:
    p = sub.add_parser("prepare", help="tokenize a corpus into train/val shards with a manifest")
    p.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="files, directories or globs: text, JSONL, Parquet (.gz/.zst ok), .arrow files, a datasets "
        "save_to_disk directory (a DatasetDict: its train split)",
    )
    p.add_argument("--tokenizer", required=True, help="tokenizer.json (copied into the output)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument(
        "--text-field", default="text", help="JSONL field / Parquet or Arrow column (default: text)"
    )
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizer processes (0: inline)")
    p.add_argument("--shard-size", type=float, default=64.0, metavar="MB", help="shard size (default 64)")
    val = p.add_mutually_exclusive_group()
    val.add_argument("--val-fraction", type=float, default=None, help="val share of documents (default 0.01)")
    val.add_argument("--val-docs", type=int, default=None, help="exactly this many val documents")
    p.add_argument("--prefix", default="train", help="train shard name prefix (default: train)")
    p.add_argument("--val-prefix", default="val", help="val shard name prefix (default: val)")
    p.add_argument(
        "--eos-token",
        default=None,
        metavar="TOKEN",
        help="token appended to every document (default: the tokenizer's own end-of-text token, e.g. "
        "<|endoftext|>, <|end_of_text|> or </s>)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a data set prepared in --out with other arguments (only the files its manifest lists)",
    )
    p.add_argument(
        "--restart",
        action="store_true",
        help="drop an interrupted prepare in --out that had other arguments (only the files its "
        ".prepare-progress.json lists) and start over",
    )
    p.set_defaults(func=cmd_prepare)


def _add_inspect(sub) -> None:
    p = sub.add_parser("inspect", help="counts, length histogram, samples; verify every shard")
    p.add_argument("dir", help="data set directory (with manifest.json)")
    p.add_argument("--decode", type=int, default=0, metavar="N", help="decode N sample documents")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the data set's own)")
    p.set_defaults(func=cmd_inspect)


def add_commands(parser: argparse.ArgumentParser, prog: str) -> None:
    """Add the data subcommands to `parser`; `prog` is how messages and manifests name the command."""
    parser.set_defaults(data_prog=prog)
    sub = parser.add_subparsers(dest="data_command", required=True)
    _add_tokenizer(sub)
    _add_prepare(sub)
    _add_inspect(sub)


def register(subparsers, prog: str = "goat-dist data") -> argparse.ArgumentParser:
    """Add the `data` command group to an argparse subparsers object; returns its parser."""
    data = subparsers.add_parser("data", help="prepare and inspect tokenized data sets")
    add_commands(data, prog)
    return data


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Prepare and inspect tokenized data sets.")
    add_commands(parser, PROG)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
