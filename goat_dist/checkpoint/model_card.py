"""The model card ``goat-dist ckpt export`` writes into an export as ``README.md`` (what the Hugging Face hub
shows for a model directory), unless the directory already holds the user's own.

It says what the model is (architecture, position scheme and GOAT's settings, sizes), how long it trained
(steps, tokens), on what data with which tokenizer, the evaluation results ``goat-dist eval`` left in the
run directory (``<run_dir>/eval/*.json``: perplexity by length, passkey retrieval, lm-evaluation-harness
tasks), and how to load it. Everything comes from the checkpoint's own config and state and those
reports: nothing is measured here.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from ..shapes import ffn_size, goat_lane_count, head_dims, key_bias_lanes, non_embedding_params

CARD = "README.md"

POSITIONS = {
    "goat": "GOAT: attention as entropic optimal transport toward a learned prior, "
    "softmax_j(q_c,i . k_c,j / sqrt(d_c) + K_ij), with K_ij = sum_r [a_r cos(w_r (t_i - t_j)) + "
    "b_r sin(w_r (t_i - t_j))] + u(t_j) (fixed geometric frequencies w_r, learned per-head a, b, and a "
    "key-only sink/recency term u(j)), folded into q and k so that one unmodified attention kernel computes "
    "content and prior",
    "rope": "RoPE (rotary position embeddings, rotate-half)",
    "alibi": "ALiBi (a per-head linear distance bias)",
    "none": "none (no position information: NoPE)",
    "learned": "a learned absolute position table (stops at its length)",
}


def run_dir_of(step_dir: Path) -> Path | None:
    """The run directory a step directory sits in (``<run>/checkpoints/step_*``), else None."""
    return step_dir.parent.parent if step_dir.parent.name == "checkpoints" else None


def _number(value) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if not math.isfinite(value):
        return str(value)
    return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"


def _cfg(model: dict):
    from ..config import GoatConfig, ModelConfig

    raw = dict(model)
    raw["goat"] = GoatConfig(**raw.get("goat", {}))
    return ModelConfig(**raw)


def parameters(shapes: dict[str, list[int]], vocab_size: int) -> int:
    """The model's parameters, the TP padding of the vocabulary not counted (it gets no probability)."""
    total = 0
    for name, shape in shapes.items():
        if name in ("embedding.weight", "output.weight"):
            total += min(shape[0], vocab_size) * math.prod(shape[1:])
        else:
            total += math.prod(shape)
    return total


def _model_section(model: dict, shapes: dict[str, list[int]] | None) -> list[str]:
    cfg = _cfg(model)
    heads, kv, head_dim, content = head_dims(cfg)
    rows = [
        ("layers", cfg.num_layers),
        ("hidden size", cfg.hidden_size),
        (
            "attention heads",
            f"{heads} of dim {head_dim}, {kv} key/value heads" + (" (GQA)" if kv < heads else ""),
        ),
        ("MLP", f"{'SwiGLU' if cfg.activation == 'swiglu' else 'GELU'}, hidden {ffn_size(cfg)}"),
        ("norm", f"{'RMSNorm' if cfg.norm == 'rmsnorm' else 'LayerNorm'} (eps {cfg.norm_eps:g})"),
        ("biases", "yes" if cfg.bias else "no"),
        ("vocabulary", cfg.vocab_size),
        ("training context", f"{cfg.seq_len} tokens"),
        ("tied input/output embeddings", "yes" if cfg.tie_embeddings else "no"),
        ("position scheme", f"`{cfg.position}`"),
    ]
    if shapes:
        params = parameters(shapes, cfg.vocab_size)
        rows.append(("parameters", f"{params:,} ({non_embedding_params(cfg):,} non-embedding)"))
    lines = ["## Model", "", "| | |", "|---|---|"]
    lines += [f"| {name} | {_number(value)} |" for name, value in rows]
    lines += ["", f"Positions: {POSITIONS.get(cfg.position, cfg.position)}."]
    if cfg.position == "goat":
        g = cfg.goat
        lanes = goat_lane_count(cfg)
        lines += [
            "",
            "GOAT's prior (`model.goat`):",
            "",
            f"- relative Fourier terms: R = {g.pos_rank} (`pos_rank`), frequencies w_r = "
            f"{g.pos_base:g}^(-r / (R - 1)) (`pos_base`)",
            f"- sink/recency term u(j): {'on' if g.key_bias else 'off'} (`key_bias`), "
            f"{key_bias_lanes(g) if g.key_bias else 0} lane(s); its sink MLP over M = {g.abs_rank} absolute "
            f"Fourier features (`abs_rank`, base {g.abs_base:g}), normalised by L_train = "
            f"{g.train_len or cfg.seq_len}",
            f"- the prior takes {lanes} of each q/k head's {head_dim} dims; content attention uses the other "
            f"{content}",
        ]
    elif cfg.position == "rope":
        lines += ["", f"RoPE base (theta): {cfg.rope_base:g}."]
    return lines


def _data_lines(config: dict) -> list[str]:
    data = config.get("data") or {}
    if data.get("synthetic"):
        return [f"- data: the synthetic `{data['synthetic']}` task (`data.synthetic`), generated in training"]
    sources = data.get("sources") or []
    if sources:
        lines = ["- data: a mixture (`data.sources`):"]
        for src in sources:
            if isinstance(src, dict):
                lines.append(f"  - `{src.get('path')}`, weight {_number(src.get('weight'))}")
        return lines
    source = data.get("source", "builtin")
    if source == "builtin":
        size = data.get("builtin_max_bytes")
        return [
            "- data: goat-dist's builtin corpus, the Python standard library's own docstrings and source"
            + (f" ({size:,} bytes)" if isinstance(size, int) else "")
        ]
    return [f"- data: `{source}` (`goat-dist data` shards)"]


def _training_section(config: dict, state: dict, step_dir: Path) -> list[str]:
    run = state.get("run_state") or {}
    train = config.get("train") or {}
    tokens = run.get("consumed_tokens")
    samples = run.get("consumed_samples")
    lines = [
        "## Training",
        "",
        f"- checkpoint: `{step_dir.name}` (step {state.get('step')})",
        "- tokens trained: "
        + (f"{tokens:,}" if isinstance(tokens, int) else "not recorded")
        + (f" ({samples:,} sequences)" if isinstance(samples, int) and samples else ""),
    ]
    if train:
        lines.append(
            f"- global batch {train.get('global_batch_size')} sequences, peak learning rate "
            f"{_number(train.get('lr'))} ({train.get('lr_schedule')}), precision {train.get('precision')}"
        )
    lines += _data_lines(config)
    contract = state.get("data_contract") or {}
    for key, what in (("document_masking", "document masking"), ("bos_framing", "BOS-framed windows")):
        if contract.get(key):
            lines.append(f"- {what} (`data.{key}`)")
    return lines


def _tokenizer_lines(tokenizer: Path | None, vocab_size: int) -> list[str]:
    if tokenizer is None:
        return [
            "- tokenizer: none found beside the training data, so none is shipped: encode with the tokenizer "
            "the data was prepared with"
        ]
    from ..atomic import sha256_file

    return [
        f"- tokenizer: `tokenizer.json` (shipped here; the one training used, sha256 "
        f"{sha256_file(tokenizer)[:12]}), {vocab_size:,} tokens; texts are encoded without added special "
        "tokens, as `goat-dist data prepare` encoded the training data"
    ]


# ---- evaluation ---------------------------------------------------------------------------------------


def _measured_at(report: dict, step) -> str:
    at = report.get("step")
    return "" if at == step else f" (measured at step {at}, not this export's step {step})"


def _ppl(name: str, report: dict, step) -> list[str]:
    lines = [
        f"Perplexity on `{report.get('data')}` ({report.get('split')} split; `{name}`)"
        f"{_measured_at(report, step)}:",
        "",
        "| length | x training length | loss (nats) | perplexity |",
        "|---:|---:|---:|---:|",
    ]
    for r in report.get("results") or []:
        lines.append(
            f"| {_number(r.get('length'))} | {_number(r.get('multiple'))} | {_number(r.get('loss'))} "
            f"| {_number(r.get('ppl'))} |"
        )
    return lines


def _passkey(name: str, report: dict, step) -> list[str]:
    depths = report.get("depths") or []
    lines = [
        f"Passkey retrieval, exact-match accuracy by length and depth (`{name}`)"
        f"{_measured_at(report, step)}:",
        "",
        "| length | " + " | ".join(f"depth {_number(d)}" for d in depths) + " |",
        "|---:|" + "---:|" * len(depths),
    ]
    for length, row in zip(report.get("lengths") or [], report.get("accuracy") or []):
        lines.append(f"| {_number(length)} | " + " | ".join(_number(a) for a in row) + " |")
    return lines


def _harness(name: str, report: dict, step) -> list[str]:
    lines = [
        f"lm-evaluation-harness (`{name}`, lm-eval {report.get('lm_eval_version')}, limit "
        f"{report.get('limit')}){_measured_at(report, step)}:",
        "",
        "| task | metric | value | stderr |",
        "|---|---|---:|---:|",
    ]
    for task, metrics in sorted((report.get("results") or {}).items()):
        if not isinstance(metrics, dict):
            continue
        for key, value in metrics.items():
            if key == "alias" or "_stderr" in key:
                continue
            metric, _, flt = key.partition(",")
            stderr = metrics.get(f"{metric}_stderr,{flt}" if flt else f"{metric}_stderr")
            shown = "" if stderr is None else _number(stderr)
            lines.append(f"| {task} | {metric} | {_number(value)} | {shown} |")
    return lines


KINDS = {"ppl": _ppl, "passkey": _passkey, "harness": _harness}
EARLIER = re.compile(r"^(passkey|harness)\.step[^/]*\.json$")  # earlier checkpoints' (reports.keep_earlier)


def _evaluation_section(run_dir: Path | None, step) -> list[str]:
    if run_dir is None:
        return [
            "## Evaluation",
            "",
            "Not evaluated here: the checkpoint is a step directory outside `<run>/checkpoints/`, so "
            "there is no run directory to find `goat-dist eval` results in.",
        ]
    eval_dir = run_dir / "eval"
    files = sorted(eval_dir.glob("*.json")) if eval_dir.is_dir() else []
    blocks: list[str] = []
    shown = 0
    for path in files:
        if EARLIER.match(path.name):
            continue
        try:
            report = json.loads(path.read_text())
            render = KINDS.get(str(report.get("task"))) if isinstance(report, dict) else None
            if render is None:
                continue
            block = render(path.name, report, step)
        except (OSError, ValueError, TypeError, AttributeError) as e:
            blocks += ["", f"`{path.name}`: not read ({type(e).__name__}: {e})."]
            continue
        blocks += ["", *block]
        shown += 1
    if shown:
        head = f"From `goat-dist eval` in the run directory (`{run_dir.name}/eval/`, {shown} reports):"
    else:
        head = (
            f"Not evaluated yet: no `goat-dist eval` results in `{run_dir.name}/eval/`. `goat-dist eval "
            "ppl|passkey|harness --checkpoint RUN_DIR` writes them there; a later export carries them here."
        )
    return ["## Evaluation", "", head, *blocks]


# ---- loading -----------------------------------------------------------------------------------------


def _loading_section(fmt: str, position: str, name: str) -> list[str]:
    lines = ["## How to load", ""]
    if fmt == "hf":
        remote = position != "rope"
        kw = ", trust_remote_code=True" if remote else ""
        what = (
            "a `LlamaForCausalLM` (no remote code)"
            if not remote
            else "its own model code, shipped here (`modeling_goat.py`, `configuration_goat.py`): "
            "`trust_remote_code=True`"
        )
        lines += [
            f"With Hugging Face `transformers` (>= 4.45) alone; {what}:",
            "",
            "```python",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            f'model = AutoModelForCausalLM.from_pretrained("{name}"{kw})',
            f'tok = AutoTokenizer.from_pretrained("{name}")',
            'ids = tok("def read_lines(path):", return_tensors="pt").input_ids',
            "print(tok.decode(model.generate(ids, max_new_tokens=40, do_sample=False)[0]))",
            "```",
            "",
            "With lm-evaluation-harness (its `hf` model needs `transformers` and `accelerate`):",
            "",
            "```bash",
            f"lm_eval --model hf --model_args pretrained={name}{',trust_remote_code=True' if remote else ''} "
            "--tasks lambada_openai",
            "```",
            "",
            "With goat-dist (the same model, KV-cached, greedy or sampled):",
        ]
    else:
        lines += [
            "goat-dist's own layout (`model.safetensors`, `config.json`: the run's model section). "
            "With goat-dist:"
        ]
    lines += [
        "",
        "```bash",
        f'goat-dist generate --model {name} --prompt "def fibonacci(n):" --max-new-tokens 64',
        "```",
        "",
        "```python",
        "from goat_dist.inference import generate, load_exported",
        f'model, tokenizer = load_exported("{name}")',
        'print(generate(model, tokenizer, "def fibonacci(n):", max_new_tokens=40))',
        "```",
    ]
    if fmt != "hf":
        lines += [
            "",
            f"`goat-dist eval ppl|passkey|harness --checkpoint {name}` evaluates it; "
            "`goat-dist ckpt export --format hf` writes a directory `transformers` loads.",
        ]
    return lines


def render(
    config: dict,
    state: dict,
    step_dir: Path,
    *,
    fmt: str,
    dtype: str,
    name: str,
    shapes: dict[str, list[int]] | None = None,
    tokenizer: Path | None = None,
) -> str:
    """The card's Markdown. ``config``: the checkpoint's run config; ``state``: its trainer state;
    ``name``: the export directory's name (what the loading examples open); ``shapes``: the exported
    tensors' (TP=1) shapes; ``tokenizer``: the tokenizer file shipped, if any."""
    model = config["model"]
    position = model.get("position", "goat")
    run_dir = run_dir_of(step_dir)
    title = (config.get("run") or {}).get("name") or (run_dir.name if run_dir else name)
    tags = ["goat-dist", f"position-{position}"] + (["goat-attention"] if position == "goat" else [])
    front = ["---", "pipeline_tag: text-generation"]
    if fmt == "hf":
        front.append("library_name: transformers")
    front += ["tags:", *[f"- {t}" for t in tags], "---", ""]
    lines = [
        *front,
        f"# {title}",
        "",
        f"A decoder-only language model pretrained with goat-dist, position scheme `{position}`. Exported by "
        f"`goat-dist ckpt export` ({'Hugging Face' if fmt == 'hf' else 'goat-dist'} format, {dtype} weights"
        + (", GOAT's prior kept in fp32" if dtype == "bf16" and position == "goat" else "")
        + f") from step {state.get('step')}.",
        "",
        *_model_section(model, shapes),
        "",
        *_training_section(config, state, step_dir),
        *_tokenizer_lines(tokenizer, _cfg(model).vocab_size),
        "",
        *_evaluation_section(run_dir, state.get("step")),
        "",
        *_loading_section(fmt, position, name),
        "",
        "Files: `goat_export.json` lists what the export wrote (and what `goat-dist ckpt export --force` may "
        "replace); this card is one of them until you edit it, and an edited card is kept.",
    ]
    return "\n".join(lines) + "\n"
