"""``goat-dist eval harness``: lm-evaluation-harness tasks on a goat-dist checkpoint.

lm-eval asks a model three kinds of question through its ``LM`` API: the log-likelihood of a continuation
given a context (multiple choice and cloze tasks), the rolling log-likelihood of a whole text (perplexity
tasks) and greedy generation until a stop string (generative tasks). ``Scorer`` answers them with the
model a ``Session`` loaded (the checkpoint forms of ``eval ppl``) and the tokenizer of the data the run
trained on; ``lm_class`` wraps it in lm-eval's ``TemplateLM``, so every lm-eval task, built in or a local
YAML file (``--include-path``), scores a checkpoint the way it scores a Hugging Face model.

Offline, lm-eval's built-in tasks read their data from a datasets cache copied from a machine that ran
them (``--datasets-cache``, see ``datasets_cache_env``).

lm-eval is optional (``goat-dist[eval]``) and imported only when the command runs.

Tensor parallelism: lm-eval sees one process; every rank runs every request (the TP ranks each hold a
vocabulary slice, gathered before the softmax) and rank 0 writes the report.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from . import EvalError

MISSING = "lm-eval is not installed: pip install 'goat-dist[eval]'"
DEFAULT_MAX_GEN_TOKS = 256


def require_lm_eval():
    """The ``lm_eval`` module, or the error that says how to install it."""
    try:
        import lm_eval
    except ImportError:
        raise EvalError(MISSING) from None
    return lm_eval


def find_tokenizer(loaded, is_main: bool, explicit: str | None = None) -> tuple[Path, int]:
    """(tokenizer.json, end-of-text id) of the data the checkpoint's run trained on: an export's own copy,
    the builtin corpus (prepared again if its cache is gone) or the prepared data directory of
    ``data.source`` / ``data.sources``. The id is the data manifest's ``eos_id`` when there is one."""
    from data_tools.shard_format import MANIFEST_NAME, TOKENIZER_NAME
    from data_tools.tokenizer import choose_eos, load_tokenizer

    candidates = []  # (tokenizer file, manifest file or None)
    if explicit:
        candidates.append((Path(explicit).expanduser(), None))
    else:
        candidates.append((Path(loaded.source) / TOKENIZER_NAME, None))
        from .session import run_data_sets

        for d in (Path(d).expanduser() for d in run_data_sets(loaded, is_main, required=False)):
            manifest = d / MANIFEST_NAME
            name = TOKENIZER_NAME
            if manifest.is_file():
                name = json.loads(manifest.read_text()).get("tokenizer") or TOKENIZER_NAME
            candidates.append((d / name, manifest if manifest.is_file() else None))
    for path, manifest in candidates:
        if not path.is_file():
            continue
        tok = load_tokenizer(path)
        eos = json.loads(manifest.read_text()).get("eos_id") if manifest else None
        return path, int(eos) if eos is not None else choose_eos(tok, path)[1]
    looked = ", ".join(str(p) for p, _ in candidates)
    raise EvalError(
        f"{loaded.source}: no tokenizer file found (looked at {looked}); pass --tokenizer "
        "PATH/tokenizer.json (the tokenizer the run's data was prepared with)"
    )


class Scorer:
    """Log-likelihoods and greedy continuations of token sequences under the loaded model, in fp32 (or the
    session's autocast), batched ``batch_size`` sequences at a time, right-padded (the model is causal, so
    padding after a sequence changes none of its logits)."""

    def __init__(self, session, tokenizer_path: Path, eos_id: int, max_length: int, batch_size: int):
        from data_tools.tokenizer import load_tokenizer

        from .perplexity import check_length

        check_length(session.loaded.cfg, max_length)
        if batch_size < 1:
            raise EvalError(f"--batch-size must be >= 1, got {batch_size}")
        self.session, self.model = session, session.model
        self.tokenizer_path = Path(tokenizer_path)
        self.tokenizer = load_tokenizer(tokenizer_path)
        self.eos_id, self.max_length, self.batch_size = eos_id, max_length, batch_size
        if self.tokenizer.get_vocab_size() > self.model.vocab_size:
            raise EvalError(
                f"tokenizer {tokenizer_path} has {self.tokenizer.get_vocab_size()} tokens, the model "
                f"{self.model.vocab_size}: not the tokenizer this checkpoint was trained with"
            )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    @torch.no_grad()
    def log_probs(self, rows: list[list[int]]) -> torch.Tensor:
        """(len(rows), longest, vocab) log-probabilities on the CPU; rows past their length are padding."""
        from .passkey import full_vocab

        width = max(len(r) for r in rows)
        tokens = torch.zeros(len(rows), width, dtype=torch.long)
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        positions = torch.arange(width).expand_as(tokens)
        device = self.session.device
        with self.session.autocast():
            logits = self.model(tokens.to(device), positions.to(device))
        logits = full_vocab(logits.float(), self.model.tp_group)[..., : self.model.vocab_size]
        return torch.log_softmax(logits, dim=-1).cpu()

    def score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether greedy decoding yields the continuation) per
        (context ids, continuation ids). Context beyond ``max_length`` is cut from the left."""
        out: list[tuple[float, bool] | None] = [None] * len(pairs)
        order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
        order = [i for i in order if pairs[i][1]]
        for i in range(len(pairs)):
            if not pairs[i][1]:
                out[i] = (0.0, True)  # an empty continuation has probability one
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            rows = []
            for i in batch:
                context, continuation = pairs[i]
                whole = ((context or [self.eos_id]) + continuation)[-(self.max_length + 1) :]
                rows.append(whole[:-1])
            lp = self.log_probs(rows)
            for k, i in enumerate(batch):
                n = len(rows[k])
                continuation = pairs[i][1][-n:]
                target = torch.tensor(continuation, dtype=torch.long)
                window = lp[k, n - len(continuation) : n]
                logprob = float(window.gather(-1, target[:, None]).sum())
                out[i] = (logprob, bool((window.argmax(-1) == target).all()))
        return out

    def rolling(self, text: str) -> float:
        """Log-likelihood of all of ``text``: disjoint windows of ``max_length`` tokens, the first after the
        end-of-text token (lm-eval's ``get_rolling_token_windows`` with one token of context)."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        windows = get_rolling_token_windows(self.encode(text), self.eos_id, self.max_length, 1)
        return sum(lp for lp, _ in self.score([make_disjoint_window(w) for w in windows]))

    def generate(self, context: str, gen_kwargs: dict) -> str:
        """Greedy continuation of ``context`` up to the first ``until`` string (cut before it), the
        end-of-text token or ``max_gen_toks`` tokens. Re-runs the whole window per token: no KV cache."""
        kwargs = dict(gen_kwargs or {})
        if kwargs.get("do_sample"):
            raise EvalError(f"eval harness decodes greedily only; the task asks for sampling: {gen_kwargs}")
        until = kwargs.get("until") or [self.decode([self.eos_id])]
        until = [until] if isinstance(until, str) else [s for s in until if s]
        max_gen = int(kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
        ids = self.encode(context) or [self.eos_id]
        new: list[int] = []
        text = ""
        for _ in range(max_gen):
            window = (ids + new)[-self.max_length :]
            token = int(self.log_probs([window])[0, -1].argmax())
            if token == self.eos_id:
                break
            new.append(token)
            text = self.decode(new)
            hits = [text.index(s) for s in until if s in text]
            if hits:
                return text[: min(hits)]
        return text


@functools.cache
def lm_class():
    """lm-eval's model API over a ``Scorer`` (a function, so that lm-eval is imported only when used)."""
    from lm_eval.api.model import TemplateLM

    class GoatHarnessLM(TemplateLM):
        """A goat-dist checkpoint as an lm-eval model: ``TemplateLM`` tokenizes (context, continuation)
        pairs the Hugging Face way, ``Scorer`` computes."""

        def __init__(self, scorer: Scorer):
            super().__init__()
            self.scorer = scorer

        @property
        def eot_token_id(self) -> int:
            return self.scorer.eos_id

        @property
        def max_length(self) -> int:
            return self.scorer.max_length

        @property
        def tokenizer_name(self) -> str:
            return str(self.scorer.tokenizer_path)

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
            return self.scorer.encode(string)

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
            answers = self.scorer.score([(context, continuation) for _, context, continuation in requests])
            for (strings, _, _), answer in zip(requests, answers):
                self.cache_hook.add_partial("loglikelihood", strings, answer)
            return answers

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            answers = [self.scorer.rolling(r.args[0]) for r in requests]
            for r, answer in zip(requests, answers):
                self.cache_hook.add_partial("loglikelihood_rolling", (r.args[0],), answer)
            return answers

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            answers = [self.scorer.generate(*r.args) for r in requests]
            for r, answer in zip(requests, answers):
                self.cache_hook.add_partial("generate_until", r.args, answer)
            return answers

    return GoatHarnessLM


def parse_limit(text: str | None) -> int | float | None:
    """lm-eval's --limit: a count of examples per task, or a fraction of each task below 1."""
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        raise EvalError(f"--limit must be a number, got {text!r}") from None
    if value <= 0:
        raise EvalError(f"--limit must be > 0, got {text!r}")
    return value if value < 1 else int(value)


def load_tasks(
    tasks: list[str], include_path: str | None = None, datasets_cache: str | None = None
) -> tuple[object, list]:
    """(lm-eval's TaskManager, every task built with its data loaded), before any model is: an unknown
    name or a data set that cannot be had (a built-in task offline) is an EvalError naming the task and
    how to get it, not a traceback after the model load. The built tasks go to ``simple_evaluate`` as
    they are: their data is loaded once. ``datasets_cache``: the ``--datasets-cache`` in effect (its
    environment already set), named when a data set is not in it."""
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    if include_path and not Path(include_path).is_dir():
        raise EvalError(f"--include-path {include_path}: not a directory of lm-eval task YAML files")
    manager = TaskManager(include_path=include_path)
    known = set(manager.all_tasks)
    unknown = [t for t in tasks if t not in known and not Path(t).is_file() and not manager.match_tasks([t])]
    if unknown:
        where = f" in {include_path} or" if include_path else ""
        raise EvalError(
            f"unknown lm-eval task(s) {', '.join(unknown)}: not found{where} among lm-eval's own tasks "
            "(--include-path DIR adds a directory of task YAML files)"
        )
    built: list = []
    for name in tasks:
        try:
            got = manager.load([name])
        except Exception as e:  # lm-eval and datasets raise many kinds; each is this task's to fix
            raise EvalError(unloadable(name, e, datasets_cache)) from e
        inside = {child for group in got["groups"].values() for child in group.child_names}
        built += [g for n, g in got["groups"].items() if n not in inside]
        built += [t for n, t in got["tasks"].items() if n not in inside]
    return manager, built


OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def datasets_cache_env(path: str) -> dict[str, str]:
    """The environment under which lm-eval's ``datasets.load_dataset`` reads a copied datasets cache and
    never the hub. Offline, datasets answers a hub name (``EleutherAI/lambada_openai``) with the newest
    copy under ``<cache>/<namespace>___<name>/<config>/<version>/<hash>/``, which is what a run with
    network leaves in ``~/.cache/huggingface/datasets``. ``path`` is that directory or the
    ``~/.cache/huggingface`` (HF_HOME) above it. datasets reads these variables when it is imported:
    set them before."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise EvalError(
            f"--datasets-cache {path}: not a directory; pass the datasets cache copied from a machine where "
            "the tasks ran (its ~/.cache/huggingface/datasets, or ~/.cache/huggingface)"
        )
    cache = root / "datasets" if (root / "datasets").is_dir() else root
    return {"HF_DATASETS_CACHE": str(cache.resolve()), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


def unloadable(task: str, error: BaseException, datasets_cache: str | None = None) -> str:
    """Why ``task`` could not be built, and how to run it: a data set the hub would serve (a network or
    file error, offline mode, or not in the datasets cache) gets the ways to evaluate offline."""
    import os

    detail = f"{type(error).__name__}: {error}".splitlines()[0]
    offline = [v for v in OFFLINE_VARS if os.environ.get(v, "").lower() in ("1", "true", "yes", "on")]
    words = ("hub", "offline", "couldn't find cache")
    if not (isinstance(error, OSError) or any(w in detail.lower() for w in words)):
        return f"lm-eval task {task} could not be built ({detail}); fix the task or its YAML file"
    if datasets_cache:
        return (
            f"lm-eval task {task}: its data set is not in --datasets-cache {datasets_cache} ({detail}). "
            "datasets keeps a hub data set NAMESPACE/NAME there as NAMESPACE___NAME/CONFIG/VERSION/HASH/: "
            "run the task once where the hub is reachable and copy that directory (or the whole "
            "~/.cache/huggingface/datasets) into it, or describe the task in a YAML file over local data "
            "files and pass --include-path DIR"
        )
    why = f" ({', '.join(offline)} set)" if offline else ""
    return (
        f"lm-eval task {task}: its data set could not be loaded ({detail}). lm-eval's built-in tasks "
        f"download their data from the Hugging Face hub, which this machine cannot reach{why}. To run it "
        "offline: run the task once where the hub is reachable, copy its datasets cache "
        "(~/.cache/huggingface/datasets) here and pass --datasets-cache DIR (or set HF_DATASETS_CACHE), or "
        "describe the task in a YAML file over local data files and pass --include-path DIR (e.g. --tasks "
        "goat_python_choice --include-path tests/data/harness)"
    )


def check_tokenizer(loaded, path: Path, allow_other: bool) -> str:
    """The harness tokenizer against the one training recorded (``data_check.trained_tokenizers``):
    another one is refused unless ``allow_other``. Returns what the report says about it."""
    from ..atomic import sha256_file
    from .data_check import ALLOW_FLAG, trained_tokenizers

    trained, where = trained_tokenizers(loaded)
    if trained is None:
        return f"unverified: {where}"
    sha = sha256_file(path)
    if sha in trained:
        return "same as training"
    if allow_other:
        return f"other than training ({ALLOW_FLAG})"
    raise EvalError(
        f"tokenizer {path} (sha256 {sha[:16]}...) is not the one the model was trained with "
        f"({', '.join(t[:16] + '...' for t in trained)} from {where}): the model would read other tokens "
        f"than the text says. Pass the run's tokenizer with --tokenizer, or {ALLOW_FLAG} to score anyway"
    )


def harness_report(
    session,
    tasks: list[str],
    limit: int | float | None = None,
    batch_size: int = 8,
    include_path: str | None = None,
    num_fewshot: int | None = None,
    max_length: int | None = None,
    tokenizer: str | None = None,
    seed: int = 0,
    allow_other_tokenizer: bool = False,
    loaded_tasks: tuple[object, list] | None = None,
    datasets_cache: str | None = None,
) -> dict | None:
    """Run lm-eval's ``simple_evaluate`` on ``tasks`` with the session's model; a JSON-ready dict on rank 0
    (None elsewhere: every rank runs the model, lm-eval aggregates on rank 0). ``loaded_tasks``: what
    ``load_tasks`` returned for them, when the caller built them before the model; ``datasets_cache``:
    the ``--datasets-cache`` they were read from, for the report."""
    lm_eval = require_lm_eval()
    from lm_eval.utils import handle_non_serializable

    manager, built = loaded_tasks or load_tasks(tasks, include_path, datasets_cache)
    path, eos = find_tokenizer(session.loaded, session.layout.is_main, tokenizer)
    checked = check_tokenizer(session.loaded, path, allow_other_tokenizer)
    scorer = Scorer(session, path, eos, max_length or session.loaded.cfg.seq_len, batch_size)
    results = lm_eval.simple_evaluate(
        model=lm_class()(scorer),
        tasks=built,
        num_fewshot=num_fewshot,
        limit=limit,
        task_manager=manager,
        log_samples=False,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
    )
    if results is None:  # lm-eval aggregates on global rank 0 only
        return None
    keep = ("results", "groups", "group_subtasks", "versions", "n-shot", "higher_is_better", "n-samples")
    report = {
        "task": "harness",
        **session.describe(),
        "tokenizer": str(path),
        "tokenizer_check": checked,
        "eos_id": eos,
        "max_length": scorer.max_length,
        "lm_eval_version": getattr(lm_eval, "__version__", None),
        "tasks": tasks,
        "limit": limit,
        "num_fewshot": num_fewshot,
        "include_path": include_path,
        "datasets_cache": datasets_cache,
        **{k: results[k] for k in keep if k in results},
        "configs": results.get("configs"),
    }
    return json.loads(json.dumps(report, default=handle_non_serializable))


def table(report: dict) -> str:
    """lm-eval's own results table (markdown), groups after tasks."""
    from lm_eval.utils import make_table

    text = make_table(report)
    if report.get("groups"):
        text += "\n" + make_table(report, "groups")
    return text.rstrip()


def write_harness(report: dict, out: Path) -> tuple[Path, str | None]:
    """(path, note): the report in ``<out>/harness.json``; an earlier one of another checkpoint is kept
    beside it (``reports.keep_earlier``)."""
    from ..atomic import atomic_write_text
    from .reports import keep_earlier

    out.mkdir(parents=True, exist_ok=True)
    path = out / "harness.json"
    note = keep_earlier(path, report)
    atomic_write_text(path, json.dumps(report, indent=1))
    return path, note
