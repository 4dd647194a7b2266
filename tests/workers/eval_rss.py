"""Peak host RSS of ``goat-dist eval`` (under torchrun, per rank) and of ``goat-dist ckpt export``.

    torchrun --nproc_per_node=2 eval_rss.py OUT_DIR eval ppl --checkpoint STEP --tp 2 ...
    python eval_rss.py OUT_DIR ckpt export STEP EXPORT_DIR [--format hf]

The command runs in this process through ``goat_dist.cli.main``, after everything it imports is imported
and torch has run its first operations; for eval, once the process groups exist, a tiny model of the same
kind is built and run once before the baseline is taken (the libraries' one-time setup is not the
command's memory: thread pools, ~12 MiB, and the code pages of the kernels and layers the command runs,
file-backed and shared by the ranks of a node: 0.07 x the test's model on one machine). Written to
``OUT_DIR/rank<R>.json`` when the process ends: the peak RSS above that baseline (``extra_bytes``), and
for eval the peak above the RSS just before ``build_model`` while it builds this rank's model and reads
its weights (``load_extra_bytes``; of which the model as built, before any weight is read:
``built_bytes``).
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import json
import os
import re
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")


def _kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def _reset_peak() -> int:
    """Peak RSS := current RSS (after returning freed heap memory); the current RSS in bytes."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return _kib("VmRSS") * 1024


def warm_up() -> None:
    import torch

    x = torch.randn(64, 64)
    torch.nn.init.normal_(x @ x)


TINY = ["model.num_layers=1", "model.hidden_size=64", "model.num_heads=4", "model.vocab_size=4096"]
TINY += ["model.seq_len=64", "model.position=goat", "model.attention_backend=sdpa"]


def warm_up_model(layout, gpt) -> None:
    import torch

    from goat_dist.config import load_config

    cfg = load_config(None, TINY)
    model = gpt(cfg.model, layout).eval()
    tokens = torch.randint(0, 4096, (2, 64))
    with torch.no_grad():
        model(tokens, torch.arange(64).expand(2, 64), labels=tokens)
    del model


def main(out: Path, argv: list[str]) -> None:
    # everything the command imports, imported before the baseline: its imports are not its memory
    import goat_dist.checkpoint.export  # noqa: F401
    import goat_dist.checkpoint.hf_export  # noqa: F401
    import goat_dist.distributed
    import goat_dist.evaluation.perplexity  # noqa: F401
    import goat_dist.evaluation.plots  # noqa: F401
    import goat_dist.evaluation.reports  # noqa: F401
    import goat_dist.evaluation.session  # noqa: F401
    import goat_dist.model  # noqa: F401
    from goat_dist import cli
    from goat_dist.evaluation import checkpoint

    record: dict = {"rank": int(os.environ.get("RANK", "0"))}
    real_build, real_gpt = checkpoint.build_model, goat_dist.model.GPT

    def build_model(cfg, read, layout):
        before = record["load_before"] = _reset_peak()
        loaded = real_build(cfg, read, layout)
        record["load_extra_bytes"] = _kib("VmHWM") * 1024 - before
        record["params"] = sum(p.numel() for p in loaded.model.parameters())
        return loaded

    def gpt(cfg, *args, **kwargs):  # the model as built, before its weights are read
        model = real_gpt(cfg, *args, **kwargs)
        record["built_bytes"] = _kib("VmHWM") * 1024 - record["load_before"]
        return model

    checkpoint.build_model, goat_dist.model.GPT = build_model, gpt
    real_init = goat_dist.distributed.init

    def init(*args, **kwargs):
        """The process groups exist: a tiny model of the same kind is built and run once, so that the code
        the command runs (torch's kernels, megatron's layers: file-backed pages, shared by the ranks of a
        node) and the thread pools are in memory before the baselines; then the whole-command baseline."""
        layout = real_init(*args, **kwargs)
        warm_up_model(layout, real_gpt)
        record["before"] = _reset_peak()
        return layout

    goat_dist.distributed.init = init

    def finish() -> None:
        record["extra_bytes"] = _kib("VmHWM") * 1024 - record["before"]
        (out / f"rank{record['rank']}.json").write_text(json.dumps(record))

    atexit.register(finish)
    warm_up()
    record["before"] = _reset_peak()
    record["code"] = cli.main(argv)


if __name__ == "__main__":
    target = Path(sys.argv[1])
    target.mkdir(parents=True, exist_ok=True)
    main(target, sys.argv[2:])
