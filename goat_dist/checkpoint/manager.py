"""Sharded checkpoints with atomic publish.

Layout of ``<run_dir>/checkpoints/``::

    step_00000020/           universal/rank<R>.safetensors (each rank its own share of the fp32 masters
                             and Adam moments, no gather) + universal/index.json (``universal.py``),
                             rng_rank<R>.pt (every rank), trainer_state.json, config.yaml,
                             digests/ranks_<R>.json (sizes + sha256 of 8 ranks' files) and
                             manifest.json (of the other files; written last: ``manifest.py``)
    latest                   the tag of the newest complete checkpoint (temp + fsync + rename)
    stale/                   checkpoints moved aside at start: newer than the run's starting point and
                             so not in its lineage (lineage.py)

A checkpoint counts only once ``latest`` names it, which happens after every rank finished writing and
the manifest exists: a crash at any point before leaves the previous checkpoint as ``latest``. Which
checkpoint to resume from is decided on rank 0 (resume.py); ``keep_last`` counts only the run's lineage.

Each rank hashes the files it wrote as it writes them (so the hashing is balanced as the writes are), and
rank 0 gathers the digests and hashes the few small files of its own (``digests.py``). One copy of the
state is written (12 bytes per parameter), each rank writing ~1/world of it. A resume reads and checks
what each rank holds and nothing else (``read_run_files``, ``slices.py``): on the same layout, exactly
its own file.

``save_async`` (``checkpoint.async=true``) stages the state in host memory and returns; a background
thread per rank writes and hashes the files (``staging.py``), and ``poll`` (at step boundaries) or
``wait`` publishes the checkpoint once every rank's writes are done. At most one save is in flight: a
new save, and the end of the run, wait for the pending one first.

A save's progress is told to ``events(name, *args)`` (``CheckpointManager(events=...)``, on every rank;
the trainer passes its callbacks' events): ``file_written`` (step_dir, name) for each file an asynchronous
save's background writer finished (on the writer's thread), ``shards_written`` (step_dir, step) once every
rank's files are on disk and hashed, just before the manifest and ``latest`` are written, and
``published`` (step_dir, step) once ``latest`` names the checkpoint.
"""

from __future__ import annotations

import io
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .. import collectives
from ..atomic import atomic_write_text
from . import compat, lineage, rng, space, universal
from . import manifest as manifest_file
from .digests import (
    digest,
    digest_files,
    listing,
    raise_everywhere,
    read_checked,
    read_manifest,
    same_everywhere,
    verify,
)
from .errors import CheckpointError
from .names import LATEST, MANIFEST, SAVE_COST, STALE, STATE, tag_for
from .resume import agree_on_checkpoint
from .safe_load import load as safe_load

__all__ = ["MANIFEST", "STATE", "CheckpointError", "CheckpointManager", "tag_for", "verify", "write_manifest"]

# what must match for every rank to continue exactly where it was, its RNG states included; any other
# layout reads the same files re-split (its RNG starts from the run's seed).
LAYOUT_KEYS = ("world", "tp", "dp", "zero_stage", "precision", "param_groups")


def write_manifest(step_dir: Path, extra: dict, files: dict | None = None) -> None:
    """Write the manifest (atomically; its parts first, ``manifest.py``): ``files`` ({name: {bytes,
    sha256}}, as ``digests.digest_files`` gathers them), or, without them, every file hashed by this
    process."""
    if files is None:
        files = {name: digest(Path(step_dir) / name) for name in listing(step_dir)}
    manifest_file.write(Path(step_dir), files, extra)


@dataclass
class PendingSave:
    """An asynchronous save whose files are still being written (``CheckpointManager.save_async``)."""

    step_dir: Path
    step: int
    writer: object  # staging.BackgroundWriter
    started: float
    paused_s: float


class CheckpointManager:
    def __init__(self, run_dir: Path, keep_last: int = 2, is_main: bool = True, events=None):
        self.root = Path(run_dir) / "checkpoints"
        self.events = events  # told of each save's progress (module docstring)
        self.keep_last = keep_last
        self.is_main = is_main
        self.parent: str | None = None  # this run's previous checkpoint in root (its lineage), if any
        self.origin: str | None = None  # the train.resume pin this run's lineage began at (lineage.py)
        self._pin: str | None = None  # set when this run starts at its pin itself (choose_resume)
        self.pending: PendingSave | None = None  # an asynchronous save not yet published
        self.last_save_s: float | None = None  # the last published save, start to publish
        self._published_bytes = 0
        self._buffers = None  # staging.HostBuffers, kept across async saves (pinned memory on CUDA)

    # ---- reading ----------------------------------------------------------------------------------
    def latest(self) -> Path | None:
        """This process's view of ``latest`` (see ``choose_resume`` for the decision every rank uses)."""
        pointer = self.root / LATEST
        if not pointer.is_file():
            return None
        return self.root / pointer.read_text().strip()

    def choose_resume(self, choice: str) -> Path | None:
        """Collective: the checkpoint to resume from per ``train.resume`` (auto, never or a path), decided on
        rank 0 and seen by every rank (else a CheckpointError on all ranks naming the path and rank)."""
        if choice == "never":
            return None
        chosen = agree_on_checkpoint(choice, self.latest, pinned=self._continue_pin)
        if choice != "auto" and chosen == Path(choice):
            self._pin = lineage.origin_of(chosen)  # this run's lineage begins at the pin
        return chosen

    def _continue_pin(self, pin: Path) -> Path:
        """Rank 0: where a run pinned to ``pin`` resumes: this run dir's ``latest`` when it descends from
        the pin (a requeue of the same command), else the pin itself (lineage.py)."""
        own = self.latest()
        if own is None or own.resolve() == pin.resolve() or not lineage.continues_pin(pin, own):
            return pin
        print(
            f"train.resume={pin}: this run dir holds checkpoints of its own that began at that pin; "
            f"continuing from the newest, {own} (the pin is where the run started)"
        )
        return own

    def begin(self, resumed_from: Path | None, start_step: int, origin: str | None = None) -> list[str]:
        """Rank 0, once the run's starting point is known: start this run's lineage there and move
        checkpoints newer than it (not in its lineage) to ``checkpoints/stale/``. Returns the moved tags.
        ``origin``: the lineage origin the checkpoint resumed from recorded (kept unless the run starts at
        its pin)."""
        start_tag = None
        if resumed_from is not None and Path(resumed_from).parent.resolve() == self.root.resolve():
            start_tag = Path(resumed_from).name
        self.parent = start_tag
        self.origin = self._pin or origin
        if not self.is_main or not self.root.is_dir():
            return []
        moved = lineage.move_aside_newer(self.root, start_step, start_tag)
        if moved:
            print(
                f"checkpoints newer than this run's start (step {start_step}) are not in its lineage and "
                f"were moved to {self.root / STALE}: {', '.join(moved)} (train.resume=never or a resume "
                "from an older checkpoint); keep_last never counts them. Delete them when no longer needed."
            )
        return moved

    def check_room(self, need: int, saves: int | None, measure: bool) -> str:
        """Collective, at start (after ``begin``): is there room in ``root`` for checkpoints of ``need``
        bytes? Ranks with ``measure`` (each node's first) compare it with the bytes free; a disk without
        room for one stops every rank with a CheckpointError naming run.dir, the bytes needed and free
        (``space.room_at_start``). Returns this rank's warning ("" if none) when what ``keep_last`` keeps,
        of ``saves`` saves (None: unbounded), does not fit."""
        error = warning = ""
        if measure:
            kept = len(lineage.lineage(self.root, self.parent)) if self.parent else 0
            error, warning = space.room_at_start(
                self.root.parent, self.root, need, self.keep_last, kept, saves
            )
        raise_everywhere(error)
        return warning

    # ---- saving -----------------------------------------------------------------------------------
    def _begin_save(self, trainer_state: dict) -> Path:
        step_dir = self.root / tag_for(trainer_state["step"])
        trainer_state[lineage.PARENT] = self.parent if self.parent != step_dir.name else None
        trainer_state[lineage.ORIGIN] = self.origin
        if self.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            if step_dir.exists():  # a leftover of an interrupted save of the same step
                shutil.rmtree(step_dir)
        collectives.barrier()
        return step_dir

    def _write_run_files(self, step_dir: Path, trainer_state: dict, config_text: str) -> str:
        """Rank 0 writes the run state and config; returns what failed ("" when nothing did)."""
        if self.is_main:
            for name, text in ((STATE, json.dumps(trainer_state, indent=1)), ("config.yaml", config_text)):
                try:
                    atomic_write_text(step_dir / name, text)
                except OSError as e:
                    return self._write_failure(step_dir, step_dir / name, e)
        return ""

    def _write_failure(self, step_dir: Path, path: Path, error: BaseException) -> str:
        """The message for a failed write of ``path``: on a full disk, the directory, bytes needed and free,
        and the checkpoint that stays ``latest`` (``space.write_failure``)."""
        previous = self._published_bytes or None
        if previous is None:
            try:
                previous = int(json.loads((self.root / SAVE_COST).read_text())["bytes"])
            except (OSError, ValueError, KeyError, TypeError):
                previous = None
        try:
            latest = (self.root / LATEST).read_text().strip() or None
        except OSError:
            latest = None
        return space.write_failure(path, step_dir, error, previous, latest)

    def _tell(self, event: str, *args) -> None:
        if self.events is not None:
            self.events(event, *args)

    def _publish(self, step_dir: Path, step: int, known: dict, error: str) -> None:
        """Collective, once every rank's files are on disk (or a write failed: ``error``): digests in
        parallel, then rank 0 writes the manifest, ``latest`` and prunes. A failure anywhere is raised on
        every rank; rank 0 then removes the unpublished step directory (only this save wrote it; on a full
        disk it holds the space the next attempt needs) and ``latest`` still names the previous one."""
        try:
            files = digest_files(step_dir, known, error)  # raises a write failure on every rank
            self._tell("shards_written", step_dir, step)
            problem = ""
            if self.is_main:
                target = step_dir / MANIFEST
                try:
                    write_manifest(step_dir, {"step": step, "saved_at": time.time()}, files=files)
                    target = self.root / LATEST
                    atomic_write_text(target, step_dir.name)
                except OSError as e:
                    problem = self._write_failure(step_dir, target, e)
                else:
                    self._published_bytes = sum(int(f["bytes"]) for f in files.values())
                    lineage.prune(self.root, step_dir.name, self.keep_last)
            raise_everywhere(problem)  # also the barrier: every rank waits for the publish
        except CheckpointError:
            if self.is_main:
                shutil.rmtree(step_dir, ignore_errors=True)
            raise
        self.parent = step_dir.name
        self._tell("published", step_dir, step)

    def save(self, engine, trainer_state: dict, config_text: str) -> Path:
        """Collective: every rank calls it. Returns the published step directory."""
        self.wait()  # a pending asynchronous save is published first
        started = time.perf_counter()
        step = trainer_state["step"]
        step_dir = self._begin_save(trainer_state)
        known, error = {}, ""
        # a failed write (a full disk) is not raised here: every rank reaches the publish, which raises it
        # on all of them (raising on one rank alone would leave the others waiting in a collective)
        target = step_dir / "universal" / universal.file_name(dist.get_rank())
        try:
            known = universal.save(engine, engine.module, step_dir, step)
            target = step_dir / f"rng_rank{dist.get_rank()}.pt"
            with open(target, "wb") as f:  # a file object: a write failure is an OSError, not torch's own
                torch.save(rng.capture(), f)
            known[target.name] = digest(target)
        except OSError as e:
            error = self._write_failure(step_dir, getattr(e, "filename", None) or target, e)
        error = self._write_run_files(step_dir, trainer_state, config_text) or error
        collectives.barrier()  # every shard is on disk
        self._publish(step_dir, step, known, error)
        self.last_save_s = trainer_state["last_save_s"] = time.perf_counter() - started
        self._record_cost(step)
        return step_dir

    def save_async(self, engine, trainer_state: dict, config_text: str) -> Path:
        """Collective: stage this step's checkpoint in host memory and return; the files are written in the
        background and published by ``poll`` or ``wait``. Returns the (not yet published) step directory;
        ``trainer_state["last_save_s"]`` is the pause (staging) the caller saw."""
        from .staging import BackgroundWriter, HostBuffers, queue_torch_save, stage_universal

        self.wait()
        started = time.perf_counter()
        step = trainer_state["step"]
        step_dir = self._begin_save(trainer_state)
        self._buffers = self._buffers or HostBuffers()
        writer = BackgroundWriter(step_dir, self._buffers, self.events, describe=self._write_failure)
        stage_universal(engine, engine.module, step_dir, step, writer)
        queue_torch_save(writer, rng.capture(), step_dir / f"rng_rank{dist.get_rank()}.pt")
        failed = self._write_run_files(step_dir, trainer_state, config_text)
        writer.error = writer.error or failed  # raised on every rank when the save is published
        writer.start()
        paused = time.perf_counter() - started
        self.pending = PendingSave(step_dir, step, writer, started, paused)
        trainer_state["last_save_s"] = paused
        return step_dir

    def poll(self) -> Path | None:
        """Collective while a save is pending (every rank knows it is: saves are collective decisions):
        publish it if every rank's writes are done. Returns the published step directory, or None."""
        if self.pending is None:
            return None
        busy = torch.tensor([0 if self.pending.writer.done() else 1])
        collectives.all_reduce(busy)
        return None if busy.item() else self._finish()

    def wait(self) -> Path | None:
        """Collective: wait for the pending save's writes and publish it (None when nothing is pending)."""
        if self.pending is None:
            return None
        self.pending.writer.wait()
        return self._finish()

    def _finish(self) -> Path:
        pending, self.pending = self.pending, None
        writer = pending.writer
        try:
            self._publish(pending.step_dir, pending.step, writer.digests, writer.error)
        finally:
            writer.close()
        self.last_save_s = time.perf_counter() - pending.started
        self._record_cost(pending.step)
        return pending.step_dir

    def _record_cost(self, step: int) -> None:
        """Rank 0 notes the published save's seconds and bytes in the run dir, so that the deadline of the
        next attempt (a requeued job) budgets for it from its first step instead of guessing."""
        if self.is_main:
            cost = {"seconds": self.last_save_s, "bytes": self._published_bytes, "step": step}
            try:
                atomic_write_text(self.root / SAVE_COST, json.dumps(cost) + "\n")
            except OSError as e:  # the checkpoint is published; only the next deadline's estimate is lost
                print(f"could not record the save's cost in {self.root / SAVE_COST}: {e}")

    def previous_save_s(self) -> float | None:
        """The seconds of the last save recorded in this run dir (an earlier attempt's), or None."""
        try:
            seconds = json.loads((self.root / SAVE_COST).read_text())["seconds"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return float(seconds) if isinstance(seconds, (int, float)) and seconds > 0 else None

    # ---- loading ----------------------------------------------------------------------------------
    def load(self, engine, step_dir: Path, layout: dict, contract: dict | None = None) -> dict:
        """Collective: restores model, optimizer, LR schedule and this rank's RNG; returns trainer state.

        Every rank reads the manifest, the run state, its own RNG file and the universal state it holds,
        each checked against the manifest as read (``read_checked``; the state's block checksums), and no
        other file: a corrupt or missing one is named on every rank. A checkpoint of another model is
        refused naming the config keys that differ; with ``contract`` (this run's data contract) one
        trained with another tokenizer is refused first (``compat``)."""
        step_dir = Path(step_dir)
        manifest, state, rng_state = read_run_files(step_dir, dist.get_rank(), layout=layout)
        current = getattr(engine.module, "cfg", None)  # the model's ModelConfig
        compat.check_tokenizer(step_dir, state, contract, current, compat.RESUME)
        try:
            universal.load(engine, engine.module, step_dir, state["step"], manifest=manifest)
        except universal.ModelMismatch as e:
            raise CheckpointError(compat.model_change(step_dir, current, e.problems, compat.RESUME)) from None
        if not same_layout(state, layout) and self.is_main:
            changed = {
                k: f"{state.get(k)} -> {layout.get(k)}" for k in LAYOUT_KEYS if state.get(k) != layout.get(k)
            }
            print(f"checkpoint {step_dir}: layout differs ({changed}); its state was re-split for it")
        if rng_state is not None:
            rng.restore(rng_state)
        return state


def same_layout(state: dict, layout: dict) -> bool:
    """Whether a checkpoint's run state was saved on ``layout`` (every rank continues exactly: RNG too)."""
    return all(state.get(k) == layout.get(k) for k in LAYOUT_KEYS)


def read_run_files(
    step_dir: Path, rank: int | None, purpose: str = "resume from it", layout: dict | None = None
) -> tuple[dict, dict, object]:
    """Collective: (manifest, trainer state, RNG state of ``rank`` or None) of ``step_dir``, each file read
    once and checked against the manifest; a format-0 checkpoint is refused for ``purpose``. The RNG file
    is read only on the ``layout`` that saved it (on another, every rank starts from the run's seed). A
    problem on any rank (or ranks that read different manifests) is raised on every rank."""
    manifest, state, rng_state, error, fingerprint = None, None, None, "", ""
    try:
        manifest = read_manifest(step_dir)
        fingerprint = manifest.fingerprint
        state = json.loads(read_checked(step_dir, STATE, manifest))
        universal.require_state(step_dir, purpose, manifest)
        name = f"rng_rank{rank}.pt"
        same = layout is None or same_layout(state, layout)
        if rank is not None and same and name in manifest["files"]:
            data = io.BytesIO(read_checked(step_dir, name, manifest))
            data.name = str(step_dir / name)
            rng_state = safe_load(data, state["step"])
    except CheckpointError as e:
        error = str(e)
    except ValueError as e:
        error = f"checkpoint {step_dir}: {STATE} is not valid JSON: {e}"
    raise_everywhere(error)  # a problem on any rank stops every rank, naming it
    if not same_everywhere(fingerprint):
        raise CheckpointError(
            f"checkpoint {step_dir}: the ranks read different {MANIFEST} files (is run.dir on a file "
            "system every node shares?)"
        )
    assert manifest is not None and state is not None  # else this rank's error was raised above
    return manifest, state, rng_state
