"""Load a trained model for evaluation, at any tensor-parallel size, without running checkpoint code.

Accepted: a run directory (its ``checkpoints/latest``), a ``checkpoints/`` directory, one ``step_*``
directory (its universal state, read through ``checkpoint.slices.UniversalReader``), or a ``goat-dist ckpt
export`` directory (``model.safetensors`` + ``config.json``, either format). Nothing is unpickled.

Why in two steps: ``read_checkpoint`` runs before the process groups exist (the model's config decides
the layout) and reads only the config and run state; ``build_model`` builds the model for this rank's
``distributed.Layout`` (the one ``distributed.init`` returned) and reads each parameter's TP slice
straight into it, cut by the split the new model's parameter declares (megatron's ``partition_dim`` /
``partition_stride``), so a checkpoint trained at one TP size evaluates at another. A rank of an N-way
evaluation reads only its slice of a universal state (the files holding it, each opened once, checked as
read against the manifest), and holds its slice plus one tensor on the host; an export directory's whole
tensors are read one at a time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import yaml

from ..config import GoatConfig, ModelConfig

if TYPE_CHECKING:
    from ..distributed import Layout


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


class ExportTensors:
    """An export directory's ``model.safetensors``: whole TP=1 tensors, each read when asked for."""

    def __init__(self, path: Path):
        from ..checkpoint.tensor_file import TensorFile

        self.path, self.file = path, None
        with TensorFile(path, str(path)) as f:  # its header: the step it was exported at
            step = f.metadata.get("step")
        self.step = int(step) if step is not None else None

    def local(self, name: str, p: torch.nn.Parameter, tp: int, tp_rank: int, source: Path) -> torch.Tensor:
        from ..checkpoint import universal
        from ..checkpoint.tensor_file import TensorFile

        if self.file is None:
            self.file = TensorFile(self.path, str(self.path))
        full = self.whole(name, source)
        meta = universal.split_meta(p)
        if meta["tp_split"] and meta["dim"] == 0 and full.shape[0] != p.shape[0] * tp:
            full = _fit_rows(full, p.shape[0] * tp)  # the (padded) vocabulary of embedding / output
        return universal.split(full, meta, tp, tp_rank)

    def whole(self, name: str, source: Path) -> torch.Tensor:
        if name not in self.file:
            raise KeyError(f"{source}: no weights for parameter {name}")
        return self.file.read_whole(name).float()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


class HFExportTensors(ExportTensors):
    """A Hugging Face export's ``model.safetensors`` (``ckpt export --format hf``): its tensors mapped back
    to goat-dist's names and layout (``inference.from_hf_tensors``: q/k/v fused again per KV group, SwiGLU's
    halves stacked). The mapping needs the whole model, read once on first use; an export is a model one
    GPU holds."""

    def __init__(self, path: Path, cfg: ModelConfig):
        super().__init__(path)
        self.cfg = cfg
        self.state: dict[str, torch.Tensor] | None = None

    def whole(self, name: str, source: Path) -> torch.Tensor:
        if self.state is None:
            from safetensors.torch import load_file

            from ..inference import from_hf_tensors

            self.state = from_hf_tensors(self.cfg, load_file(str(self.path)), str(source))
        state = self.state
        if name not in state:
            raise KeyError(f"{source}: no weights for parameter {name}")
        return state[name].float()

    def close(self) -> None:
        self.state = None
        super().close()


class UniversalTensors:
    """A checkpoint's universal state, read as this rank's TP slices (the reader opens on first use, for
    the TP layout the process groups have by then)."""

    def __init__(self, step_dir: Path, manifest: dict):
        self.step_dir, self.manifest = step_dir, manifest
        self.reader = None

    def local(self, name: str, p: torch.nn.Parameter, tp: int, tp_rank: int, source: Path) -> torch.Tensor:
        from ..checkpoint import universal
        from ..checkpoint.slices import UniversalReader

        if self.reader is None:
            self.reader = UniversalReader(self.step_dir, tp, tp_rank, self.manifest)
        reader = self.reader
        if name not in reader.meta["params"]:
            raise KeyError(f"{source}: no weights for parameter {name}")
        meta = universal.split_meta(p)
        rows = reader.saved_tp * reader.saved_shape(name)[0] if meta["tp_split"] else None
        if meta["dim"] == 0 and rows is not None and rows != p.shape[0] * tp:
            return self._vocab_rows(name, p, tp, tp_rank)
        return reader.read_local(name)

    def _vocab_rows(self, name: str, p, tp: int, tp_rank: int) -> torch.Tensor:
        """This rank's rows of a tensor whose padded vocabulary differs between the TP sizes: padded rows
        carry no probability, so rows past the saved ones are zeros (as ``_fit_rows``)."""
        rows = p.shape[0]
        full = self.reader.with_layout(1, 0)
        saved = full.local_shape(name)[0]
        lo, hi = tp_rank * rows, min((tp_rank + 1) * rows, saved)
        out = torch.zeros(rows, *p.shape[1:])
        if hi > lo:
            out[: hi - lo] = full.read_rows(name, "", lo, hi)
        return out

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None


def _read(path: Path):
    """(model config dict, tensor source, step, source dir, run dir, run config): the config and run state
    only; the tensors are read by ``build_model``."""
    if (path / "model.safetensors").is_file() and (path / "config.json").is_file():
        from ..inference import export_config

        raw, fmt = export_config(path)  # either export format; another program's model is refused by name
        tensors: ExportTensors
        if fmt == "hf":
            tensors = HFExportTensors(path / "model.safetensors", _model_config(raw, None))
        else:
            tensors = ExportTensors(path / "model.safetensors")
        return raw, tensors, tensors.step, path, None, None
    from ..checkpoint import universal
    from ..checkpoint.digests import read_checked, read_manifest
    from ..checkpoint.export import resolve_step_dir
    from ..checkpoint.names import STATE

    step_dir = resolve_step_dir(path)
    manifest = read_manifest(step_dir)
    universal.require_state(step_dir, "evaluate it", manifest)
    config = yaml.safe_load(read_checked(step_dir, "config.yaml", manifest))
    step = json.loads(read_checked(step_dir, STATE, manifest)).get("step")
    run_dir = step_dir.parent.parent if step_dir.parent.name == "checkpoints" else None
    return config["model"], UniversalTensors(step_dir, manifest), step, step_dir, run_dir, config


def _fit_rows(full: torch.Tensor, rows: int) -> torch.Tensor:
    """Vocabulary padding can differ between TP sizes: padded rows carry no probability, cut or add them."""
    if full.shape[0] >= rows:
        return full[:rows]
    return torch.cat([full, full.new_zeros(rows - full.shape[0], *full.shape[1:])])


def read_checkpoint(path: str | Path, backend: str | None = None) -> tuple[ModelConfig, dict]:
    """(model config, everything else ``build_model`` needs); reads the config and run state only (the
    weights are read by ``build_model``), no process group needed."""
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
def build_model(cfg: ModelConfig, read: dict, layout: Layout) -> Loaded:
    """Build the model for this rank's ``layout`` (eval mode, fp32) and load its weights into it, one
    tensor at a time: this rank's TP slice of each."""
    from ..model import GPT

    tensors, source = read["tensors"], read["source"]
    model = GPT(cfg, layout)
    tp, tp_rank = layout.tp, layout.tp_rank
    try:
        for name, p in model.named_parameters():
            local = tensors.local(name, p, tp, tp_rank, source)
            if local.shape != p.shape:
                raise ValueError(
                    f"{source}: {name} has shape {tuple(local.shape)} here, model wants {tuple(p.shape)}"
                )
            p.copy_(local)
            del local
    finally:
        tensors.close()
    return Loaded(model.eval(), cfg, read["step"], source, read["run_dir"], read["run_config"])


def load_model(path: str | Path, backend: str | None = None, layout: Layout | None = None) -> Loaded:
    """``read_checkpoint`` then ``build_model`` for ``layout`` (None: the process groups'
    ``distributed.current_layout()``; they must exist)."""
    from .. import distributed

    cfg, read = read_checkpoint(path, backend)
    return build_model(cfg, read, layout if layout is not None else distributed.current_layout())
