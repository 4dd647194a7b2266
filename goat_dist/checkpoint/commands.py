"""``goat-dist ckpt inspect|verify|export`` and ``goat-dist generate``."""

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
            kind = {
                0: "DeepSpeed shards only, not readable",
                1: "one file per TP rank",
                2: "one file per rank",
                3: "one file per rank, index by rules",
            }
            name = kind.get(info["format"], "unknown")
            print(f"files {info['files']} | {size:.1f} MiB | format {info['format']} ({name})")
        print("valid" if info["valid"] else f"INVALID: {info['error']}")
    return 0 if info["valid"] else 1


def cmd_verify(args) -> int:
    """Every file of the checkpoint against its manifest (size and sha256); a problem is a CheckpointError
    naming the file (exit 2)."""
    from .export import resolve_step_dir
    from .manager import verify

    step_dir = resolve_step_dir(args.path)
    manifest = verify(step_dir, checksums=True)
    files = manifest["files"]
    size = sum(int(f["bytes"]) for f in files.values())
    print(
        f"OK: checkpoint {step_dir} (step {manifest.get('step')}): {len(files)} files, {size:,} bytes; "
        "every size and sha256 matches its manifest"
    )
    return 0


def cmd_export(args) -> int:
    from .export import export

    out = export(args.path, args.out, dtype=args.dtype, fmt=args.format, force=args.force)
    print(f"exported {args.path} -> {out} ({args.dtype}, {args.format} format)")
    return 0


def _prompts(args) -> list[str]:
    """The --prompt, or the non-blank lines of --prompts-file (ValueError naming the flag)."""
    from pathlib import Path

    if args.prompts_file is None:
        return [args.prompt]
    try:
        lines = Path(args.prompts_file).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"--prompts-file {args.prompts_file}: {e.strerror or e}") from e
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise ValueError(f"--prompts-file {args.prompts_file} has no prompt (one per line)")
    return prompts


def cmd_generate(args) -> int:
    """Prompts run one after another, each with its own KV cache (no padding, so a batch of one gives
    the same tokens as a lone prompt); tokens/s (new tokens / generation seconds) goes to stderr."""
    import torch

    from ..generation import check_sampling
    from ..inference import generate, load_exported

    try:
        check_sampling(args.temperature, args.top_k, args.top_p, args.max_new_tokens)
        prompts = _prompts(args)
    except ValueError as e:
        print(f"goat-dist generate: {e}", file=sys.stderr)
        return 2
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model, tokenizer = load_exported(args.model, dtype=dtype)
    if tokenizer is None:
        print(f"goat-dist generate: {args.model} has no tokenizer.json", file=sys.stderr)
        return 2
    generator = torch.Generator().manual_seed(args.seed) if args.seed is not None else None
    new_tokens, seconds = 0, 0.0
    for prompt in prompts:
        try:
            text, out = generate(
                model,
                tokenizer,
                prompt,
                args.max_new_tokens,
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
                generator=generator,
                use_cache=not args.no_cache,
                result=True,
            )
        except ValueError as e:
            print(f"goat-dist generate: {e}", file=sys.stderr)
            return 2
        new_tokens, seconds = new_tokens + len(out.new), seconds + out.seconds
        if args.prompts_file is None:
            print(text)
        else:  # one line per prompt, whatever newlines the text holds
            print(json.dumps({"prompt": prompt, "text": text}), flush=True)
    mode = "no cache" if args.no_cache else "KV cache"
    print(
        f"goat-dist generate: {new_tokens} new tokens in {seconds:.2f} s: "
        f"{new_tokens / max(seconds, 1e-9):.1f} tokens/s ({mode}, {args.dtype})",
        file=sys.stderr,
    )
    return 0


def register(sub) -> None:
    ckpt = sub.add_parser("ckpt", help="inspect, verify or export checkpoints").add_subparsers(
        dest="ckpt", required=True
    )
    p = ckpt.add_parser("inspect", help="step, layout, tokens, sizes and validity of a checkpoint")
    p.add_argument("path", help="a run dir, its checkpoints/ dir, or one step_* dir")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-checksums", action="store_true", help="check sizes only (fast)")
    p.set_defaults(func=cmd_inspect)
    p = ckpt.add_parser(
        "verify", help="check every file's size and sha256 against the manifest: OK, or the corrupt file"
    )
    p.add_argument("path", help="a run dir (its latest checkpoint), its checkpoints/ dir, or one step_* dir")
    p.set_defaults(func=cmd_verify)
    p = ckpt.add_parser(
        "export", help="consolidated weights: model.safetensors + config.json, and a model card (README.md)"
    )
    p.add_argument("path")
    p.add_argument(
        "out", help="a new or empty directory, or one holding only your README.md (else refused; see --force)"
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace OUT if it is a previous export: its own files only, yours beside them (a README.md, "
        "notes) are kept; a run dir or any other directory is refused",
    )
    p.add_argument("--dtype", choices=EXPORT_DTYPES, default="fp32")
    p.add_argument(
        "--format",
        choices=("goat", "hf"),
        default="goat",
        help="goat: goat-dist's own layout (generate, eval); hf: a Hugging Face transformers directory "
        "(generate reads it too)",
    )
    p.set_defaults(func=cmd_export)
    p = sub.add_parser(
        "generate", help="text from an exported model: KV-cached, greedy or sampled (one process)"
    )
    p.add_argument(
        "--model", required=True, help="a `goat-dist ckpt export` output directory (--format goat or hf)"
    )
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt")
    prompt.add_argument(
        "--prompts-file",
        help="one prompt per line (blank lines skipped), run one after another; prints one JSON line "
        '{"prompt", "text"} per prompt',
    )
    p.add_argument("--max-new-tokens", type=int, default=50)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="sample from the smallest set of this mass")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling generator (reproducible)")
    p.add_argument("--dtype", choices=EXPORT_DTYPES, default="fp32", help="compute dtype")
    p.add_argument(
        "--no-cache", action="store_true", help="re-run the whole sequence per token (slow; for checks)"
    )
    p.set_defaults(func=cmd_generate)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args()
    sys.exit(args.func(args))
