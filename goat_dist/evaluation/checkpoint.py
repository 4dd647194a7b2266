"""Load a trained model for evaluation, at any tensor-parallel size, without running checkpoint code.

Accepted: a run directory (its ``checkpoints/latest``), a ``checkpoints/`` directory, one ``step_*``
directory (read through ``checkpoint.universal.read_full``: the TP-merged fp32 weights in safetensors,
after the manifest check), or a ``goat-dist ckpt export`` directory (``model.safetensors`` +
``config.json``). Nothing is unpickled. The model is built for the current ``parallel_state`` and every
full tensor is cut for this TP rank by the split the new model's parameter declares (megatron's
``partition_dim`` / ``partition_stride``), so a checkpoint trained at one TP size evaluates at another.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from megatron.core import parallel_state
from safetensors import safe_open

from ..config import GoatConfig, ModelConfig


@dataclass
class Loaded:
    model: torch.nn.Module
    cfg: ModelConfig
    step: int | None
    source: Path  # the step or export directory read
    run_dir: Path | None  # the run directory, when the checkpoint sits in one
    run_config: dict | None  # the run's whole config.yaml (None for an export)


def _model_config(raw: dict, backend: str | None) -> ModelConfig:
    raw = dict(raw)
    raw["goat"] = GoatConfig(**raw.get("goat", {}))
    cfg = ModelConfig(**raw)
    if backend:
        cfg.attention_backend = backend
    return cfg


def _read(path: Path):
    """(model config dict, {name: full tensor}, step, source dir, run dir, run config)."""
    if (path / "model.safetensors").is_file() and (path / "config.json").is_file():
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
            step = (f.metadata() or {}).get("step")
        raw = json.loads((path / "config.json").read_text())
        return raw, tensors, int(step) if step is not None else None, path, None, None
    from ..checkpoint import universal
    from ..checkpoint.export import resolve_step_dir
    from ..checkpoint.manager import STATE, verify

    step_dir = resolve_step_dir(path)
    verify(step_dir)
    universal.require_state(step_dir, "evaluate it")
    config = yaml.safe_load((step_dir / "config.yaml").read_text())
    full, _ = universal.read_full(step_dir, ("",))
    step = json.loads((step_dir / STATE).read_text()).get("step")
    run_dir = step_dir.parent.parent if step_dir.parent.name == "checkpoints" else None
    return config["model"], {n: t[""] for n, t in full.items()}, step, step_dir, run_dir, config


def _fit_rows(full: torch.Tensor, rows: int) -> torch.Tensor:
    """Vocabulary padding can differ between TP sizes: padded rows carry no probability, cut or add them."""
    if full.shape[0] >= rows:
        return full[:rows]
    return torch.cat([full, full.new_zeros(rows - full.shape[0], *full.shape[1:])])


def read_checkpoint(path: str | Path, backend: str | None = None) -> tuple[ModelConfig, dict]:
    """(model config, everything else ``build_model`` needs); reads files only, no process group needed."""
    raw, tensors, step, source, run_dir, run_config = _read(Path(path))
    cfg = _model_config(raw, backend)
    return cfg, {
        "tensors": tensors,
        "step": step,
        "source": source,
        "run_dir": run_dir,
        "run_config": run_config,
    }


@torch.no_grad()
def build_model(cfg: ModelConfig, read: dict) -> Loaded:
    """Build the model for this rank's ``parallel_state`` (eval mode, fp32) and load the weights into it."""
    from ..checkpoint import universal
    from ..model import GPT

    tensors, source = read["tensors"], read["source"]
    model = GPT(cfg)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    for name, p in model.named_parameters():
        if name not in tensors:
            raise KeyError(f"{source}: no weights for parameter {name}")
        full = tensors[name].float()
        meta = universal.split_meta(p)
        if meta["tp_split"] and full.shape[meta["dim"]] != p.shape[meta["dim"]] * tp and meta["dim"] == 0:
            full = _fit_rows(full, p.shape[0] * tp)  # the (padded) vocabulary of embedding / output
        local = universal.split(full, meta, tp, tp_rank)
        if local.shape != p.shape:
            raise ValueError(
                f"{source}: {name} has shape {tuple(local.shape)} here, model wants {tuple(p.shape)}"
            )
        p.copy_(local)
    return Loaded(model.eval(), cfg, read["step"], source, read["run_dir"], read["run_config"])


def load_model(path: str | Path, backend: str | None = None) -> Loaded:
    """``read_checkpoint`` then ``build_model`` (process groups must exist)."""
    return build_model(*read_checkpoint(path, backend))
