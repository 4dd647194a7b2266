"""Promises the package docstrings make about what importing or running a module touches:
``goat_dist.engine`` and ``goat_dist.shapes`` load lightly (a subprocess looks at ``sys.modules``), the
model's forward reads no global process state (every group, size and rank in megatron's ``parallel_state``
registry is swapped for a tripwire after construction), and no object outside ``goat_dist.engine`` holds
DeepSpeed's
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


class _Tripwire:
    """Stands for a value of megatron's process-global registry: any use of it fails the test."""

    def __init__(self, name: str):
        self.name = name

    def _fail(self, *args, **kwargs):
        raise AssertionError(f"the forward read megatron's parallel_state.{self.name}")

    __getattr__ = __call__ = __int__ = __index__ = __bool__ = __iter__ = __len__ = __eq__ = __hash__ = _fail


def registry_tripped(monkeypatch) -> list[str]:
    """Replace every process group, size and rank megatron's ``parallel_state`` holds (its module globals
    ``_TENSOR_MODEL_PARALLEL_GROUP``, ``_MPU_*`` ... ) with tripwires: megatron's own getters, which its
    layers, mappings and cross-entropy call when not handed a group, then fail on the first use."""
    from megatron.core import parallel_state

    names = [n for n in vars(parallel_state) if n.startswith("_") and n[1:2].isupper() and n.isupper()]
    for name in names:
        monkeypatch.setattr(parallel_state, name, _Tripwire(name))
    return names


@pytest.mark.parametrize("position", ["goat", "rope", "alibi", "none"])
@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
def test_the_forward_reads_no_process_state(world1, monkeypatch, position, checkpointing):
    """Built for its layout and set up by ``parallel.model_parallel.apply``, the model runs a training
    forward and backward with megatron's registry and goat-dist's own names for it gone."""
    from megatron.core import parallel_state, tensor_parallel

    from goat_dist.model import GPT, attention, gpt
    from goat_dist.parallel import model_parallel

    cfg = one_layer_config(f"model.position={position}")
    model = model_parallel.apply(GPT(cfg.model, world1), activation_checkpointing=checkpointing).train()
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 17))
    positions = torch.arange(16).expand(2, -1)
    names = registry_tripped(monkeypatch)
    assert "_TENSOR_MODEL_PARALLEL_GROUP" in names and "_DATA_PARALLEL_GROUP" in names
    with pytest.raises(AssertionError, match="parallel_state"):  # the tripwires work
        tensor_parallel.gather_from_tensor_model_parallel_region(torch.ones(1))
    for module in (gpt, attention):
        assert not hasattr(module, "parallel_state")
    loss = model(tokens[:, :-1], positions, tokens[:, 1:])
    loss.backward()
    assert torch.isfinite(loss)
    assert parallel_state._TENSOR_MODEL_PARALLEL_GROUP is not world1.tp_group  # swapped during the run


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
