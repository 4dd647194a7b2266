"""``goat-dist eval ppl|passkey|harness`` and ``goat-dist study``: the command line over ``evaluation``.

The eval commands run as one process or under torchrun (``--tp``, default: the whole world, so
``torchrun --nproc_per_node=N -m goat_dist eval ...`` evaluates with TP = N). Rank 0 writes
``<out>/ppl_<data set>_<split>.json`` + ``.png`` (one file per data set, see ``data_check``),
``<out>/passkey.json`` + ``passkey.png`` or ``<out>/harness.json`` (lm-evaluation-harness tasks, see
``harness``); ``<out>`` defaults to ``<run_dir>/eval`` (or ``<checkpoint>/eval`` for an export directory).
"""

from __future__ import annotations

import argparse
import os
import sys

from ..config import ATTENTION_BACKENDS, PRECISIONS
from . import EvalError

DEFAULT_DEPTHS = "0.1,0.3,0.5,0.7,0.9"


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or not all(0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"depths must lie in [0, 1], got {text!r}")
    return values


def _say(command: str, error: BaseException) -> None:
    """One line for a user's error; the traceback too under ``GOAT_DEBUG=1``."""
    if os.environ.get("GOAT_DEBUG", "") not in ("", "0"):
        import traceback

        traceback.print_exception(error, file=sys.stderr)
    print(f"goat-dist eval {command}: {error}", file=sys.stderr)


def _run(args, body) -> int:
    """Set up, run ``body(session)`` -> printed lines (rank 0), tear down; exit 2 on a user error."""
    from ..checkpoint import CheckpointError
    from ..distributed import exit_process

    code = 0
    try:
        from .session import Session

        session = Session(args.checkpoint, args.tp, args.backend, args.precision)
        lines = body(session)
        if session.layout.is_main:
            print("\n".join(lines))
    except (ValueError, CheckpointError, FileNotFoundError, KeyError) as e:  # EvalError, LayoutError too
        if int(os.environ.get("RANK", "0")) == 0:
            _say(args.eval, e)
        code = 2
    exit_process(code)
    return code


def _ppl_line(r: dict) -> str:
    return f"{r['length']:>7} tokens | {r['windows']:>5} windows | loss {r['loss']:.4f} | ppl {r['ppl']:.2f}"


def cmd_ppl(args) -> int:
    def body(session) -> list[str]:
        from .reports import ppl_report, write_ppl
        from .session import run_data_sets

        # default: every data set the run trained on (its validation split), never a corpus of our choice
        datasets = [args.data] if args.data else run_data_sets(session.loaded, session.layout.is_main)
        reports, lines = [], []
        for data in datasets:
            report = ppl_report(
                session,
                data,
                args.split,
                args.lengths,
                args.tokens,
                args.batch_tokens,
                allow_other_tokenizer=args.allow_other_tokenizer,
            )
            reports.append(report)
            if len(datasets) > 1:
                lines.append(f"{report['data']} ({args.split}):")
            lines += [_ppl_line(r) for r in report["results"]]
            if not report["tokenizer_check"].startswith("same"):
                lines.append(f"note: tokenizer {report['tokenizer_check']}")
        session.release_model()
        if session.layout.is_main:
            for report in reports:
                *written, note = write_ppl(report, session.out_dir(args.out))
                lines += [f"wrote {p}" for p in written] + ([note] if note else [])
        return lines

    return _run(args, body)


def cmd_passkey(args) -> int:
    def body(session) -> list[str]:
        from .reports import passkey_report, write_passkey

        report = passkey_report(
            session, args.lengths, args.depths, args.samples, args.seed, args.batch_tokens
        )
        lines = [
            f"length {n:>7}: " + " ".join(f"{a:.2f}" for a in row)
            for n, row in zip(args.lengths, report["accuracy"])
        ]
        if not report["trained_on_passkey"]:
            lines.append("note: this checkpoint was not trained with data.synthetic=passkey")
        session.release_model()
        if session.layout.is_main:
            *written, note = write_passkey(report, session.out_dir(args.out))
            lines += [f"wrote {p}" for p in written] + ([note] if note else [])
        return lines

    return _run(args, body)


def cmd_harness(args) -> int:
    from .harness import datasets_cache_env, load_tasks, require_lm_eval

    try:  # before loading the model: what a user can fix without it (lm-eval, the tasks and their data)
        if args.datasets_cache:  # before lm-eval imports datasets, which reads it once
            os.environ.update(datasets_cache_env(args.datasets_cache))
        require_lm_eval()
        tasks = load_tasks(args.tasks, args.include_path, args.datasets_cache)
    except EvalError as e:
        if int(os.environ.get("RANK", "0")) == 0:
            _say("harness", e)
        return 2

    def body(session) -> list[str]:
        from .harness import harness_report, parse_limit, table, write_harness

        report = harness_report(
            session,
            args.tasks,
            limit=parse_limit(args.limit),
            batch_size=args.batch_size,
            include_path=args.include_path,
            num_fewshot=args.num_fewshot,
            max_length=args.max_length,
            tokenizer=args.tokenizer,
            seed=args.seed,
            allow_other_tokenizer=args.allow_other_tokenizer,
            loaded_tasks=tasks,
            datasets_cache=args.datasets_cache,
        )
        if report is None:  # not rank 0
            return []
        path, note = write_harness(report, session.out_dir(args.out))
        return [table(report), f"wrote {path}", *([note] if note else [])]

    return _run(args, body)


def _names(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated task names, got {text!r}")
    return names


def cmd_study(args) -> int:
    from .study import StudyError, run_study

    try:
        return run_study(args.config, force=args.force, quick=args.quick)
    except (StudyError, EvalError) as e:
        print(f"goat-dist study: {e}", file=sys.stderr)
        return 2


def _model(p) -> None:
    p.add_argument(
        "--checkpoint", required=True, help="a run dir, checkpoints/ dir, step_* dir or export dir"
    )
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: the world size)")
    p.add_argument(
        "--backend", choices=ATTENTION_BACKENDS, default=None, help="override the attention kernel"
    )
    p.add_argument("--precision", choices=PRECISIONS, default="auto", help="auto: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--out", default=None, help="output directory (default: <run_dir>/eval)")


def _allow_other_tokenizer(p) -> None:
    p.add_argument(
        "--allow-other-tokenizer",
        action="store_true",
        help="evaluate data of another tokenizer than the model was trained with (refused by default)",
    )


def _common(p) -> None:
    _model(p)
    p.add_argument("--lengths", type=_ints, required=True, help="comma-separated evaluation lengths")
    p.add_argument("--batch-tokens", type=int, default=16384, help="tokens per forward pass (>= one window)")


def register(sub) -> None:
    ev = sub.add_parser(
        "eval", help="evaluate a checkpoint: perplexity vs length, passkey retrieval, lm-eval tasks"
    )
    tasks = ev.add_subparsers(dest="eval", required=True)
    p = tasks.add_parser("ppl", help="perplexity at each length, non-overlapping fresh windows; JSON + PNG")
    _common(p)
    p.add_argument(
        "--data",
        default=None,
        help="a `goat-dist data prepare` directory, or builtin (default: the data sets the run trained on, "
        "from its config; an export directory needs --data)",
    )
    p.add_argument("--split", default="val")
    p.add_argument("--tokens", type=int, default=65536, help="tokens of the stream read at every length")
    _allow_other_tokenizer(p)
    p.set_defaults(func=cmd_ppl)
    p = tasks.add_parser("passkey", help="passkey retrieval accuracy over length x depth; JSON + PNG heatmap")
    _common(p)
    p.add_argument("--depths", type=_floats, default=_floats(DEFAULT_DEPTHS), help="key depths in [0, 1]")
    p.add_argument("--samples", type=int, default=20, help="samples per (length, depth) cell")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_passkey)
    p = tasks.add_parser("harness", help="lm-evaluation-harness tasks (needs goat-dist[eval]); JSON + table")
    _model(p)
    p.add_argument("--tasks", type=_names, required=True, help="comma-separated lm-eval task names")
    p.add_argument("--limit", default=None, help="examples per task (a fraction of each task if < 1)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass")
    p.add_argument("--include-path", default=None, help="a directory of extra lm-eval task YAML files")
    p.add_argument(
        "--datasets-cache",
        default=None,
        metavar="DIR",
        help="offline: read the built-in tasks' data from this Hugging Face datasets cache, copied from a "
        "machine where they ran (its ~/.cache/huggingface/datasets); sets HF_DATASETS_CACHE and offline mode",
    )
    p.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: the task's)")
    p.add_argument(
        "--max-length", type=int, default=None, help="context in tokens (default: training length)"
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the run's data set's)")
    p.add_argument("--seed", type=int, default=0, help="lm-eval's seeds (few-shot sampling)")
    _allow_other_tokenizer(p)
    p.set_defaults(func=cmd_harness)
    p = sub.add_parser(
        "study", help="train and evaluate the position schemes of a study config over its seeds"
    )
    p.add_argument("config", help="e.g. configs/study/extrapolation.yaml")
    p.add_argument(
        "--force",
        action="store_true",
        help="retrain runs this study created, deleting their run dirs (a dir it did not create, or one a "
        "trainer holds, is refused)",
    )
    p.add_argument(
        "--quick", action="store_true", help="the config's 'quick' section: one seed, minutes (a smoke run)"
    )
    p.set_defaults(func=cmd_study)
