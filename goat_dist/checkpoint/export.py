"""Checkpoint inspection and export of consolidated weights (safetensors + config.json).

An export streams: the output file's header is computed from the checkpoint's shapes, then each tensor is
read (its TP slices merged from the files that hold them, each file opened once), converted, written and
dropped before the next; only the files read are checked (their block checksums against the manifest's
record), so neither memory nor hashing scales with the checkpoint, only with its largest tensor."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from data_tools.shard_format import TOKENIZER_NAME

from ..atomic import sha256_file
from ..optim import is_prior
from . import tensor_file, universal
from .digests import read_checked, read_manifest
from .index import INDEX
from .manager import MANIFEST, STATE, CheckpointError, verify
from .model_card import CARD
from .slices import META, UniversalReader


def resolve_step_dir(path: str | Path) -> Path:
    """A step directory from a run dir, its checkpoints/ dir (their ``latest``) or the step dir itself."""
    path = Path(path)
    for candidate in (path, path / "checkpoints"):
        if (candidate / "latest").is_file():
            return candidate / (candidate / "latest").read_text().strip()
    if (path / STATE).is_file() or (path / MANIFEST).is_file():
        return path
    raise CheckpointError(f"{path}: not a checkpoint, a checkpoints/ directory or a run directory")


def inspect(path: str | Path, checksums: bool = True) -> dict:
    step_dir = resolve_step_dir(path)
    info = {"path": str(step_dir), "valid": True, "error": None}
    try:
        manifest = verify(step_dir, checksums=checksums)
        info["files"] = len(manifest["files"])
        info["bytes"] = sum(f["bytes"] for f in manifest["files"].values())
    except CheckpointError as e:
        info.update(valid=False, error=str(e))
    state_path = step_dir / STATE
    if state_path.is_file():
        state = json.loads(state_path.read_text())
        run = state.get("run_state", {})
        info.update(
            step=state.get("step"),
            layout={k: state.get(k) for k in ("world", "tp", "dp", "zero_stage")},
            consumed_samples=run.get("consumed_samples"),
            consumed_tokens=run.get("consumed_tokens"),
        )
    # the universal state's index: index.json, or meta.json in a checkpoint of an earlier release
    found = [step_dir / "universal" / name for name in (INDEX, META)]
    index_path = next((path for path in found if path.is_file()), None)
    info["universal"] = index_path is not None
    info["format"] = 0  # DeepSpeed's own shards only (an earlier release, checkpoint.universal=false)
    if index_path is not None:
        try:
            info["format"] = int(json.loads(index_path.read_text()).get("format", 1))
        except (ValueError, TypeError, AttributeError) as e:
            info.update(valid=False, error=f"{index_path}: not a valid universal index: {e}")
    return info


def _tokenizer_of(config: dict) -> Path | None:
    """The tokenizer file of the run's data set (a mixture's first source: every source shares one)."""
    data = config.get("data", {})
    sources = data.get("sources") or []
    if sources:
        first = sources[0].get("path", "") if isinstance(sources[0], dict) else ""
        candidate = Path(str(first)).expanduser()
    elif data.get("source") == "builtin":
        from data_tools.builtin import builtin_dataset_dir

        candidate = builtin_dataset_dir(
            Path(data["cache_dir"]).expanduser(),
            config["model"]["vocab_size"],
            *([data["builtin_max_bytes"]] if "builtin_max_bytes" in data else []),
        )
    else:
        candidate = Path(data.get("source", "")).expanduser()
    path = candidate / TOKENIZER_NAME
    return path if path.is_file() else None


def _check_tokenizer(tokenizer: Path, state: dict) -> None:
    """The tokenizer file found must be the one training used (the data contract's ``tokenizer_sha256``):
    a data set re-prepared in place since would otherwise ship another tokenizer with these weights."""
    trained = (state.get("data_contract") or {}).get("tokenizer_sha256")
    if not trained:
        return
    trained = [trained] if isinstance(trained, str) else list(trained)
    found = sha256_file(tokenizer)
    if found not in trained:
        raise CheckpointError(
            f"{tokenizer} (sha256 {found[:12]}) is not the tokenizer this checkpoint was trained with "
            f"(sha256 {', '.join(t[:12] for t in trained)}, recorded in its data contract): the data set was "
            "re-prepared since. Restore that data set's tokenizer.json, then export again"
        )


MARKER = "goat_export.json"  # written into every export: what ``--force`` may replace


def _entries(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _stamps(root: Path) -> dict[str, list[int]]:
    """Every file's [size, mtime in ns] under ``root``: what tells the export's own file from one written
    over it under the same name (``save_pretrained`` into the export writes model.safetensors too)."""
    stamps = {}
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink():
            st = p.stat()
            stamps[str(p.relative_to(root))] = [st.st_size, st.st_mtime_ns]
    return stamps


def _inside(name: str) -> bool:
    """Whether ``name`` is a path relative to the export directory that stays inside it."""
    parts = Path(name).parts
    return bool(parts) and not Path(name).is_absolute() and ".." not in parts


def _written(out: Path) -> tuple[set[str], dict | None] | None:
    """(the entries a previous export wrote into ``out``, their [size, mtime] when recorded: exports before
    stamps were recorded have names only), or None when ``out`` holds no readable ``goat_export.json``."""
    try:
        marker = json.loads((out / MARKER).read_text())
        # only names inside ``out``: a marker edited to name "../x" or "/x" never reaches outside it
        written = {str(name) for name in marker["files"] if _inside(str(name))}
        stamps = marker.get("stamps")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return written, stamps if isinstance(stamps, dict) else None


def _previous_export(out: Path) -> tuple[bool, list[str], list[str]]:
    """(whether ``out`` is an export this command wrote, the top-level entries of it that are the user's,
    the entries it cannot replace). The user's: names the export never wrote (a README.md, notes,
    ``goat-dist eval``'s eval/) and its own model card once edited. Not replaceable: files of its other
    names changed since, by size or modification time (weights saved over it), and entries added inside a
    directory it wrote."""
    found = _written(out)
    if found is None:
        return False, [], []
    written, stamps = found
    kept = [p.name for p in out.iterdir() if p.name != MARKER and p.name not in written]
    blocked = [e for e in _entries(out) if "/" in e and e.split("/", 1)[0] in written and e not in written]
    if stamps is not None:
        now = _stamps(out)
        for name in sorted(written):
            path = out / name
            changed = path.is_symlink() or (path.exists() and stamps.get(name) != now.get(name))
            if changed and name == CARD:
                kept.append(name)  # the user's card now: kept, and no new one is written
            elif changed:
                blocked.append(f"{name} (changed since the export)")
    return True, sorted(kept), blocked


def check_out(out: Path, force: bool) -> list[str]:
    """Refuse an ``out`` the export would destroy; return the entries in it that the export keeps (the
    user's). ``out`` may be new or empty, or hold nothing but a model card (``README.md``); with ``force``
    it may also be a previous export: its own files are replaced, the user's files beside them kept
    (``_previous_export``). Anything else is refused, before anything is written."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise CheckpointError(f"export: {out} exists and is not a directory; choose a new or empty directory")
    if not out.exists():
        return []
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return []
    export, kept, blocked = _previous_export(out)
    shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
    if not export:
        if entries == [CARD]:
            return entries  # a model card written ahead of the export: kept, and none written over it
        raise CheckpointError(
            f"export: {out} is not empty ({shown}) and is not a `goat-dist ckpt export` directory (it has no "
            f"{MARKER}); nothing was written. Choose a new or empty directory (--force replaces only a "
            "previous export)"
        )
    if blocked:
        raise CheckpointError(
            f"export: {out} is a previous export but also holds {', '.join(blocked[:5])}, which the export "
            "did not write; nothing was written. Move those out, or choose a new directory"
        )
    if not force:
        yours = f" (the export's own files only; {', '.join(kept[:5])} kept)" if kept else ""
        raise CheckpointError(
            f"export: {out} holds a previous export; pass --force to replace it{yours}, or choose a new "
            "directory"
        )
    return kept


def _remove_export(old: Path) -> None:
    """Remove what the export renamed aside at ``old`` wrote (its ``goat_export.json`` lists it), then
    ``old`` itself if nothing else is left: anything else found there stays."""
    found = _written(old)
    for name in sorted(found[0] if found else (), reverse=True):  # a directory's entries before it
        path = old / name
        try:
            if path.is_dir() and not path.is_symlink():
                path.rmdir()
            else:
                path.unlink(missing_ok=True)
        except OSError:
            pass
    (old / MARKER).unlink(missing_ok=True)
    try:
        old.rmdir()
    except OSError:
        pass


def _put_in_place(tmp: Path, out: Path, force: bool) -> None:
    """Rename the finished ``tmp`` to ``out``: over nothing or an empty directory, or over a previous
    export (``force``) or a model card: ``out`` is renamed aside, the user's entries in it moved into
    ``tmp``, ``tmp`` renamed to ``out``, and only then what the previous export wrote removed."""
    keep = check_out(out, force)  # again: something may have been put there while the export was written
    clash = sorted(set(keep) & {p.name for p in tmp.iterdir()})
    if clash:
        raise CheckpointError(
            f"export: {out} holds {', '.join(clash)}, which the export did not write and writes now; "
            "nothing was written. Move it out, or choose a new directory"
        )
    if not out.exists() or not any(out.iterdir()):
        os.replace(tmp, out)  # an empty directory is replaced by the rename
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.replaced.", dir=out.parent))
    os.replace(out, old)  # ``old`` is an empty directory: replaced by the rename
    moved: list[str] = []
    try:
        for name in keep:
            os.replace(old / name, tmp / name)
            moved.append(name)
        os.replace(tmp, out)
    except BaseException:
        for name in reversed(moved):
            os.replace(tmp / name, old / name)
        os.replace(old, out)
        raise
    _remove_export(old)


def _discard(tmp: Path, ours: set[str] | None) -> None:
    """Remove an unfinished export's temporary directory, unless it holds entries it did not write (the
    user's, had moving them back failed): those are never removed."""
    if ours is not None and tmp.is_dir() and {p.name for p in tmp.iterdir()} - ours:
        return
    shutil.rmtree(tmp, ignore_errors=True)


def export_dtype(name: str, target: torch.dtype) -> torch.dtype:
    """GOAT's prior parameters stay fp32 in a bf16 export: rounding them loses the small lambda values and
    recency slopes (the same reason the prior stays fp32 in training and under ``model.to(bfloat16)``)."""
    return torch.float32 if is_prior(name) else target


FORMATS = ("goat", "hf")


@dataclass
class Tensors:
    """A checkpoint's whole (TP-merged) tensors, read one at a time: names, shapes and export dtypes
    known up front, ``fetch(name)`` reads one. An export holds about one tensor on the host."""

    shapes: dict[str, list[int]]
    dtypes: dict[str, torch.dtype]
    fetch: Callable[[str], torch.Tensor]

    @classmethod
    def of(cls, reader, target: torch.dtype) -> Tensors:
        names = list(reader.meta["params"])
        dtypes = {name: export_dtype(name, target) for name in names}
        return cls(
            {name: reader.local_shape(name) for name in names},
            dtypes,
            lambda name: reader.read_local(name).to(dtypes[name]),
        )

    def entries(self) -> list[tensor_file.Entry]:
        return [
            tensor_file.Entry(name, self.dtypes[name], shape, lambda n=name: self.fetch(n))
            for name, shape in self.shapes.items()
        ]


def _umask() -> int:
    """The process umask; read from /proc where it can be, since setting it to read it races other threads."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _readable(root: Path) -> None:
    """Give ``root`` and everything in it the modes a plain mkdir / open would have (the process umask):
    ``mkdtemp`` makes the directory 0700 for everyone, and an exported model is meant to be shared."""
    mask = _umask()
    for path in [root, *root.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def export(
    path: str | Path, out: str | Path, dtype: str = "fp32", fmt: str = "goat", force: bool = False
) -> Path:
    """Write the consolidated weights of a checkpoint to ``out``. Atomic: built in a temp dir beside
    ``out``, then renamed into place.

    ``out`` must be new, an empty directory or one holding only a model card (``README.md``); with
    ``force`` it may also be a previous export (its ``goat_export.json`` lists what it wrote): its own files
    are replaced, and the user's beside them (a README.md or other model card, notes, eval results) kept
    (``check_out``). Anything else (a run directory, the working directory) is refused before any work,
    and again before the rename.

    ``fmt="goat"``: ``out/model.safetensors`` (TP=1 parameter names and shapes), ``out/config.json`` (the
    model section of the run's config) and, when found, ``out/tokenizer.json``, for ``load_exported``.
    ``fmt="hf"``: a Hugging Face directory (``hf_export``): ``LlamaForCausalLM`` for a RoPE model, else
    a ``trust_remote_code`` model, with the tokenizer files ``AutoTokenizer`` reads.
    Both: a model card, ``out/README.md`` (``model_card``), unless ``out`` holds the user's own.
    The values are the fp32 master weights of the universal state; ``dtype=bf16`` rounds all but the prior.
    Files and directory get the process umask's modes, as if written in place."""
    if fmt not in FORMATS:
        raise ValueError(f"export format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"export dtype {dtype!r}: expected fp32 or bf16")
    out = Path(os.path.abspath(out))  # "." has no name to build a temp dir beside
    keep = check_out(out, force)
    step_dir = resolve_step_dir(path)
    manifest = read_manifest(step_dir)  # the files read are checked as read: nothing else is hashed
    universal.require_state(step_dir, "export it", manifest)
    config = yaml.safe_load(read_checked(step_dir, "config.yaml", manifest))
    state = json.loads(read_checked(step_dir, STATE, manifest))
    tokenizer = _tokenizer_of(config)
    if tokenizer is not None:
        _check_tokenizer(tokenizer, state)
    target = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    ours: set[str] | None = None  # once known: the entries of ``tmp`` the export wrote
    try:
        metadata = {"step": str(state["step"]), "dtype": dtype}
        with UniversalReader(step_dir, 1, 0, manifest) as reader:
            source = Tensors.of(reader, target)
            shapes = source.shapes
            if fmt == "hf":
                from .hf_export import write_hf

                write_hf(tmp, config["model"], source, metadata, dtype, tokenizer)
            else:
                tensor_file.write(tmp / "model.safetensors", source.entries(), metadata)
        if fmt != "hf":
            (tmp / "config.json").write_text(json.dumps(config["model"], indent=1))
            if tokenizer is not None:
                shutil.copy(tokenizer, tmp / TOKENIZER_NAME)
        if CARD not in keep:
            from .model_card import render

            card = render(
                config,
                state,
                step_dir,
                fmt=fmt,
                dtype=dtype,
                name=out.name,
                shapes=shapes,
                tokenizer=tokenizer,
            )
            (tmp / CARD).write_text(card, encoding="utf-8")
        marker = {
            "written_by": "goat-dist ckpt export",
            "format": fmt,
            "dtype": dtype,
            "checkpoint": str(step_dir),
            "step": state["step"],
            "files": _entries(tmp),
            "stamps": _stamps(tmp),  # the rename keeps them: what --force checks is still the export's
        }
        (tmp / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        ours = {p.name for p in tmp.iterdir()}
        _readable(tmp)
        _put_in_place(tmp, out, force)
    except BaseException:
        _discard(tmp, ours)
        raise
    return out
