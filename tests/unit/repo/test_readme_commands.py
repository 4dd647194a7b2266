"""Every training command in the README and in docs/*.md passes the layout and batch checks as written:
its world size (``--nproc``, ``--nproc_per_node`` x ``--nnodes``), config file and overrides, on top of the
defaults. (The README keeps the quick start; the other examples moved to docs/ by topic.)"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from goat_dist.config import load_config
from goat_dist.distributed import check_batch, check_layout

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]


def training_commands() -> list[str]:
    """The shell lines of the README and docs/*.md that run ``goat_dist train`` / ``goat-dist train``
    (continuations joined)."""
    blocks = [block for doc in DOCS for block in re.findall(r"```bash\n(.*?)```", doc.read_text(), re.S)]
    commands = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0].strip()
            if re.search(r"goat[-_]dist train\b", line) or re.search(r"goat_dist train\b", line):
                commands.append(line)
    return commands


def world_and_arguments(command: str) -> tuple[int, str | None, list[str]]:
    words = shlex.split(command.replace("$HEAD", "head"))
    options = dict(
        re.fullmatch(r"--([\w-]+)=(.*)", w).groups() for w in words if re.fullmatch(r"--[\w-]+=.*", w)
    )
    nproc = int(options.get("nproc_per_node", 1)) * int(options.get("nnodes", 1))
    if "--nproc" in words:
        nproc = int(words[words.index("--nproc") + 1])
    after = words[words.index("train") + 1 :]
    config = after[after.index("--config") + 1] if "--config" in after else None
    overrides = [w for w in after if "=" in w and not w.startswith("-")]
    return nproc, config, overrides


@pytest.mark.parametrize("command", training_commands())
def test_readme_training_command_passes_the_layout_checks(command):
    world, config, overrides = world_and_arguments(command)
    cfg = load_config(config, overrides)
    p, m, t = cfg.parallel, cfg.model, cfg.train
    check_layout(world, p.tp, m.num_heads, m.num_kv_heads or m.num_heads, m.seq_len, p.sp, cp=p.cp)
    check_batch(t.global_batch_size, t.micro_batch_size, world // (p.tp * p.cp))


def test_the_scale_out_examples_are_found():
    found = training_commands()
    assert any("--nproc_per_node=4" in c for c in found) and any("--nnodes=2" in c for c in found)
    assert len(found) >= 8
