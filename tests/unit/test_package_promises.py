"""Promises the package docstrings make about what importing or running a module touches:
``goat_dist.engine`` and ``goat_dist.shapes`` load lightly (a subprocess looks at ``sys.modules``), and the
model's forward reads no global process state (its megatron ``parallel_state`` handle is swapped for one
that fails on any use, after construction)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from multiproc import ROOT, one_layer_config


def _loaded_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(','.join(sorted(m.split('.')[0] for m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(out.stdout.strip().split(","))


def test_importing_the_engine_loads_neither_deepspeed_nor_megatron():
    loaded = _loaded_after("import goat_dist.engine")
    assert "deepspeed" not in loaded and "megatron" not in loaded


def test_shapes_and_config_import_without_torch():
    loaded = _loaded_after("import goat_dist.shapes, goat_dist.config")
    assert "torch" not in loaded and "megatron" not in loaded


class _NoProcessState:
    def __getattr__(self, name):
        raise AssertionError(f"forward read parallel_state.{name}")


@pytest.mark.parametrize("position", ["goat", "rope", "alibi", "none"])
@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
def test_the_forward_reads_no_process_state(world1, monkeypatch, position, checkpointing):
    from goat_dist.model import GPT, attention, gpt

    cfg = one_layer_config(f"model.position={position}")
    model = GPT(cfg.model, activation_checkpointing=checkpointing).train()
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 17))
    positions = torch.arange(16).expand(2, -1)
    monkeypatch.setattr(gpt, "parallel_state", _NoProcessState())
    monkeypatch.setattr(attention, "parallel_state", _NoProcessState())
    loss = model(tokens[:, :-1], positions, tokens[:, 1:])
    loss.backward()
    assert torch.isfinite(loss)
