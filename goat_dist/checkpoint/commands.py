"""``goat-dist ckpt inspect|export`` and ``goat-dist generate``."""

from __future__ import annotations

import argparse
import json
import sys

from ..config import EXPORT_DTYPES


def cmd_inspect(args) -> int:
    from .export import inspect

    info = inspect(args.path, checksums=not args.no_checksums)
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        print(f"checkpoint: {info['path']}")
        if "step" in info:
            print(
                f"step {info['step']} | layout {info['layout']} | samples {info['consumed_samples']:,} | "
                f"tokens {info['consumed_tokens']:,}"
            )
        if info.get("bytes") is not None:
            size = info["bytes"] / 2**20
            print(f"files {info['files']} | {size:.1f} MiB | universal state: {info['universal']}")
        print("valid" if info["valid"] else f"INVALID: {info['error']}")
    return 0 if info["valid"] else 1


def cmd_export(args) -> int:
    from .export import export

    out = export(args.path, args.out, dtype=args.dtype, fmt=args.format)
    print(f"exported {args.path} -> {out} ({args.dtype}, {args.format} format)")
    return 0


def cmd_generate(args) -> int:
    from ..inference import generate, load_exported

    model, tokenizer = load_exported(args.model)
    if tokenizer is None:
        print(f"goat-dist generate: {args.model} has no tokenizer.json", file=sys.stderr)
        return 2
    print(generate(model, tokenizer, args.prompt, args.max_new_tokens))
    return 0


def register(sub) -> None:
    ckpt = sub.add_parser("ckpt", help="inspect or export checkpoints").add_subparsers(
        dest="ckpt", required=True
    )
    p = ckpt.add_parser("inspect", help="step, layout, tokens, sizes and validity of a checkpoint")
    p.add_argument("path", help="a run dir, its checkpoints/ dir, or one step_* dir")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-checksums", action="store_true", help="check sizes only (fast)")
    p.set_defaults(func=cmd_inspect)
    p = ckpt.add_parser("export", help="consolidated weights: model.safetensors + config.json")
    p.add_argument("path")
    p.add_argument("out")
    p.add_argument("--dtype", choices=EXPORT_DTYPES, default="fp32")
    p.add_argument(
        "--format",
        choices=("goat", "hf"),
        default="goat",
        help="goat: goat-dist's own layout (generate, eval); hf: a Hugging Face transformers directory",
    )
    p.set_defaults(func=cmd_export)
    p = sub.add_parser("generate", help="greedy generation from an exported model (CPU smoke path)")
    p.add_argument("--model", required=True, help="a `goat-dist ckpt export` output directory")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=50)
    p.set_defaults(func=cmd_generate)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args()
    sys.exit(args.func(args))
