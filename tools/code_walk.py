"""Measure how far one training step and the run's config travel through ``goat_dist``'s packages.

    python tools/code_walk.py [--json OUT] [--verbose]

It trains a tiny model in this process (``configs/tiny.yaml`` with one 64-wide layer of 2 heads, 2 steps,
logging every step, no evaluation, no periodic checkpoint, the run dir in a temporary directory, the
bundled data set, prepared on first use) through the entry point ``goat_dist.trainer.entry.run(cfg)``,
traced with ``sys.setprofile``: Python-level 'call' events of the main thread only (C calls, other threads
and DataLoader workers are not seen; a generator's resumption is a call). ``goat_dist`` is whichever one
is imported (``PYTHONPATH`` picks the checkout); ``configs/tiny.yaml`` and the floors table are found
beside it, so an older checkout is measured with its own config and floors.

A call's *file* is its code's ``co_filename``, counted only under the imported ``goat_dist/``; its *unit*
is the first path component there (``trainer``, ``engine``), a root module counting as its own unit
(``distributed``).

One step: the calls of the second training step (the first includes warm-up): from the end of the first
step's ``post_step`` event (``Trainer.emit``; without one, from the end of the first ``train_step``) to
the end of the second's. Reported: its distinct files, distinct units (packages) and *package changes*,
the number of call events whose unit differs from the previous call event's unit.

The cfg walk: the calls from ``run(cfg)`` through the trainer's construction to the end of the first
step. A call of a ``goat_dist`` function one of whose parameters (``self``, ``*args`` and ``**kwargs``
included, read from ``frame.f_locals`` at its 'call' event) is the run's ``Config`` or one of its sections
(``cfg.model``, ``cfg.model.goat``, ...: by identity, or any instance of their classes, the section
dataclasses of ``goat_dist/config``, since the config may be copied) is a *stay*; its file is its *room*.
A room's floor is its unit's import floor: ``FLOORS`` of the measured checkout's
``tests/unit/repo/test_import_floors.py`` (older layouts: ``tests/**/test_import_floors.py``; none: this
tool's repo's), imported by path. A *climb* is a stay whose room's floor is higher than the
previous stay's (a unit with no floor is left out of that comparison). Reported: stays, distinct rooms,
climbs; and the same without the stays whose only config argument is ``self`` (the config's own
methods, e.g. ``Config.run_dir``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path

OVERRIDES = ["train.max_steps=2", "log.interval=1", "train.eval_interval=0", "checkpoint.interval=0"]
OVERRIDES += ["checkpoint.save_at_end=false", "model.num_layers=1", "model.hidden_size=64"]
OVERRIDES += ["model.num_heads=2"]  # save_at_end: after both windows, so only the run's time changes
FLOOR_TABLE = "tests/unit/repo/test_import_floors.py"


def unit_of(rel: str) -> str:
    """The top-level unit of a path relative to ``goat_dist/``: ``engine/build.py`` -> ``engine``."""
    parts = Path(rel).parts
    return parts[0].removesuffix(".py") if len(parts) == 1 else parts[0]


def package_changes(units: list[str]) -> int:
    """The events whose unit differs from the previous event's."""
    return sum(a != b for a, b in zip(units, units[1:]))


def climbs(floors: list[int | None]) -> int:
    """The stays on a higher floor than the previous stay with a floor (None: no floor, skipped)."""
    known = [f for f in floors if f is not None]
    return sum(b > a for a, b in zip(known, known[1:]))


def rooms(stays: list[str]) -> list[str]:
    """The distinct rooms in order of first visit."""
    return list(dict.fromkeys(stays))


def step_summary(files: list[str]) -> dict:
    units = [unit_of(f) for f in files]
    return {
        "calls": len(files),
        "files": len(set(files)),
        "packages": len(set(units)),
        "package_changes": package_changes(units),
        "per_package": dict(Counter(units).most_common()),
        "file_list": sorted(set(files)),
    }


def walk_summary(stays: list[str], floor: dict[str, int]) -> dict:
    floors = [floor.get(unit_of(s)) for s in stays]
    walk = {"stays": len(stays), "rooms": len(rooms(stays)), "climbs": climbs(floors), "order": rooms(stays)}
    return walk | {"sequence": [[s, f] for s, f in zip(stays, floors)]}  # each stay's room and floor


def load_floors(root: Path) -> tuple[dict[str, int], str]:
    """The unit -> floor table of the measured checkout's import-floors test (else of this tool's repo)."""
    own = Path(__file__).resolve().parents[1] / FLOOR_TABLE
    found = [root / FLOOR_TABLE, *sorted(root.glob("tests/**/test_import_floors.py")), own]
    path = next(p for p in found if p.is_file())
    spec = importlib.util.spec_from_file_location("_code_walk_floors", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    floors = {unit: level for level, units in enumerate(module.FLOORS) for unit in units}
    return floors, str(path)


def overrides(Config, run_dir: str) -> list[str]:
    """``OVERRIDES`` whose key this version's config has, and the run dir."""
    cfg, kept = Config(), []
    for text in OVERRIDES:
        section, key = text.split("=")[0].split(".", 1)
        if hasattr(getattr(cfg, section, None), key):
            kept.append(text)
    return [*kept, f"run.dir={run_dir}/run"]


def measure() -> dict:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import goat_dist
    from goat_dist.config import Config, load_config
    from goat_dist.trainer.trainer import Trainer

    try:
        from goat_dist.trainer.entry import run
    except ImportError:  # a version without the entry module: the trainer alone
        run = lambda cfg: Trainer(cfg).fit()
    package = Path(goat_dist.__file__).resolve().parent
    floor, floors_from = load_floors(package.parent)
    tmp = tempfile.mkdtemp(prefix="code_walk_")
    cfg = load_config(str(package.parent / "configs" / "tiny.yaml"), overrides(Config, tmp))
    sections = [cfg]  # the config and its sections, nested ones (model.goat) included
    for section in sections:
        sections += [v for v in vars(section).values() if dataclasses.is_dataclass(v)]
    known, classes = {id(s) for s in sections}, tuple({type(s) for s in sections})
    is_cfg = lambda v: id(v) in known or isinstance(v, classes)

    phase = [0]  # steps ended: 0 while the cfg walk lasts, 1 during the measured step
    step_files: list[str] = []
    stays: list[tuple[str, bool]] = []  # (room, only as self)
    relpaths: dict[str, str | None] = {}

    def rel(filename: str) -> str | None:
        if filename not in relpaths:
            path = Path(os.path.realpath(filename))
            relpaths[filename] = str(path.relative_to(package)) if path.is_relative_to(package) else None
        return relpaths[filename]

    def profile(frame, event, arg):
        if event != "call" or phase[0] > 1:
            return
        code = frame.f_code
        room = rel(code.co_filename)
        if room is None:
            return
        if phase[0] == 1:
            step_files.append(room)
            return
        n = code.co_argcount + code.co_kwonlyargcount
        n += bool(code.co_flags & 0x04) + bool(code.co_flags & 0x08)  # *args, **kwargs
        local = frame.f_locals
        found = []
        for name in code.co_varnames[:n]:
            value = local.get(name)
            values = value.values() if isinstance(value, dict) else value if isinstance(value, tuple) else ()
            if is_cfg(value) or any(is_cfg(v) for v in values):
                found.append(name)
        if found:
            stays.append((room, found == ["self"]))

    hook = "emit" if hasattr(Trainer, "emit") else "train_step"
    original = getattr(Trainer, hook)

    def ended(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if hook == "train_step" or (args and args[0] == "post_step"):
            phase[0] += 1
            if phase[0] > 1:
                sys.setprofile(None)  # both windows measured: the rest of the run untraced
        return out

    setattr(Trainer, hook, ended)
    sys.setprofile(profile)
    try:
        run(cfg)
    finally:
        sys.setprofile(None)
        setattr(Trainer, hook, original)
        shutil.rmtree(tmp, ignore_errors=True)
    if phase[0] < 2:
        raise SystemExit(f"code_walk: the run ended before a second step (Trainer.{hook} seen {phase[0]}x)")
    walk = walk_summary([r for r, _ in stays], floor)
    plain = walk_summary([r for r, only_self in stays if not only_self], floor)
    walk["without_self"] = {k: plain[k] for k in ("stays", "rooms", "climbs")}
    walk["floors_from"] = floors_from
    return {"goat_dist": str(package), "step_hook": hook, "step": step_summary(step_files), "cfg_walk": walk}


def report(result: dict, verbose: bool) -> str:
    s, w, p = result["step"], result["cfg_walk"], result["cfg_walk"]["without_self"]
    lines = [
        f"goat_dist: {result['goat_dist']}",
        f"one training step touches {s['files']} files in {s['packages']} packages with "
        f"{s['package_changes']} package changes ({s['calls']} calls)",
        f"following cfg from the entry point makes {w['stays']} stays in {w['rooms']} rooms with "
        f"{w['climbs']} climbs back up a floor",
        f"  without the config's own methods (cfg only as self): {p['stays']} stays in {p['rooms']} rooms "
        f"with {p['climbs']} climbs",
    ]
    if verbose:
        lines.append(f"floors from: {w['floors_from']}; step ends at Trainer.{result['step_hook']}")
        lines.append(
            "calls per package in the step: " + ", ".join(f"{u} {n}" for u, n in s["per_package"].items())
        )
        lines.append("rooms in order of first visit:")
        lines += [f"  {room}" for room in w["order"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", metavar="OUT", help="also write the measurements as JSON to OUT")
    parser.add_argument("--verbose", action="store_true", help="per-package counts and the rooms in order")
    args = parser.parse_args(argv)
    result = measure()
    print(report(result, args.verbose))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
