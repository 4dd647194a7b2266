"""Promises the package docstrings make about what importing or running a module touches:
``goat_dist.engine`` and ``goat_dist.shapes`` load lightly (a subprocess looks at ``sys.modules``), the
model's forward reads no global process state (its megatron ``parallel_state`` handle is swapped for one
that fails on any use, after construction), and no object outside ``goat_dist.engine`` holds DeepSpeed's
engine (the trainer, its callbacks' API, its callbacks and checkpoint manager after a one-step run)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from harness.multiproc import ROOT, in_process_config, one_layer_config


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


def _held(obj, path: str, depth: int = 0, seen: set | None = None):
    """``(path, value)`` of what ``obj`` holds, through goat_dist objects (not the engine package's, whose
    ``Engine`` holds DeepSpeed's engine by design), containers and bound methods' owners, a few levels."""
    seen = set() if seen is None else seen
    if depth > 4 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        items = [(f"{path}[{k!r}]", v) for k, v in obj.items()]
    elif isinstance(obj, (list, tuple, set)):
        items = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
    elif getattr(obj, "__self__", None) is not None and hasattr(obj, "__func__"):  # a bound method
        items = [(f"{path}.__self__", obj.__self__)]
    else:
        module = type(obj).__module__
        if (
            not module.startswith("goat_dist")
            or module.startswith("goat_dist.engine")
            or not hasattr(obj, "__dict__")
        ):
            return
        items = [(f"{path}.{k}", v) for k, v in vars(obj).items()]
    for where, value in items:
        yield where, value
        yield from _held(value, where, depth + 1, seen)


def test_no_object_outside_the_engine_holds_deepspeeds_engine(world1, builtin_cache, tmp_path):
    from deepspeed import DeepSpeedEngine

    from goat_dist.engine import Engine
    from goat_dist.trainer import Trainer

    trainer = Trainer(in_process_config(builtin_cache, tmp_path, "train.max_steps=1"))
    trainer.fit()
    assert isinstance(trainer.engine, Engine)
    roots = {"trainer": trainer, "api": trainer.api, "checkpoints": trainer.checkpoints}
    roots.update({f"callback {type(cb).__name__}": cb for cb in trainer.callbacks})
    found = [
        where
        for name, root in roots.items()
        for where, value in _held(root, name)
        if isinstance(value, DeepSpeedEngine)
    ]
    assert found == []
    assert all(cb.trainer is trainer.api for cb in trainer.callbacks if hasattr(cb, "trainer"))
