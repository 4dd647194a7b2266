"""torchrun worker: what a checkpoint save and a resume cost each rank, measured per process.

Every rank builds the same model under the given TP size, ZeRO stage and precision and takes one step (so
Adam's state exists). Then:

* a synchronous ``CheckpointManager.save`` and an asynchronous one (``save_async`` + ``wait``): the bytes
  this process wrote to storage (``/proc/self/io`` ``write_bytes``), its peak RSS above the starting RSS
  (``save_extra_bytes``, ``async_extra_bytes``), the async pause, and the rank's own share of the state
  (``share_bytes``: 12 B per owned element) and largest piece (``piece_bytes``);
* the checkpoint's bytes on disk (``disk_bytes``);
* two resumes, from the checkpoint and (TP=1 runs) from the same state re-split as a TP=2 run of format 1
  (one file per TP rank) writes it: the peak RSS above the starting RSS (``extra_bytes_from_tp<N>``) and
  the growth of file-backed RSS (``file_bytes_from_tp<N>``).

Rank 0 writes every per-rank list and ``state_bytes`` (fp32 weights + both Adam moments of the whole model)
to the output JSON. Used by tests/integration/checkpoint/test_checkpoint.py.

    torchrun --nproc_per_node=4 universal_rss.py <out.json> <workdir> <zero_stage> <precision> [<tp>]
"""

import ctypes
import gc
import json
import re
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from goat_dist import collectives, distributed  # noqa: E402
from goat_dist.checkpoint import CheckpointManager, universal  # noqa: E402
from goat_dist.checkpoint.slices import tensor_key  # noqa: E402
from goat_dist.config import load_config  # noqa: E402
from goat_dist.engine.masters import KEYS  # noqa: E402
from goat_dist.model import GPT  # noqa: E402
from goat_dist.parallel.parallelize import parallelize  # noqa: E402


def _status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+)", text).group(1))


def _write_bytes() -> int:
    return int(re.search(r"write_bytes:\s+(\d+)", Path("/proc/self/io").read_text()).group(1))


def _reset_peak() -> int:
    """Return freed heap memory to the OS (so a previous phase's freed pages cannot hide this phase's
    allocations), set peak RSS := current RSS, and return the current RSS in bytes."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS") * 1024


LISTS_GATHERED: list[int] = []  # piece lists sent to rank 0 by universal.save (none when the rules agree)
_gather_object = collectives.gather_object


def _counting_gather(obj, *args, **kwargs):
    if isinstance(obj, dict) and "pieces" in obj:
        LISTS_GATHERED.append(len(obj["pieces"]))
    return _gather_object(obj, *args, **kwargs)


collectives.gather_object = _counting_gather


def measured_saves(engine, model, layout, run_dir: Path, tp: int, stage: int) -> tuple[dict, Path]:
    pieces, _, _ = universal.own_pieces(engine, model)
    result = {
        "share_bytes": 12 * sum(numel for _, _, numel, _ in pieces),
        "piece_bytes": 4 * max(numel for _, _, numel, _ in pieces),
    }
    del pieces
    manager = CheckpointManager(run_dir, keep_last=0, is_main=layout.rank == 0)
    state = {"step": 1, "world": layout.world, "tp": tp, "dp": layout.dp, "zero_stage": stage}
    dist.barrier()
    rss, written = _reset_peak(), _write_bytes()
    step_dir = manager.save(engine, dict(state), "model: {}\n")
    result["save_write_bytes"] = _write_bytes() - written
    result["save_extra_bytes"] = _status_kib("VmHWM") * 1024 - rss
    dist.barrier()
    rss, written = _reset_peak(), _write_bytes()
    t0 = time.perf_counter()
    manager.save_async(engine, {**state, "step": 2}, "model: {}\n")
    result["async_pause_s"] = time.perf_counter() - t0
    manager.wait()
    result["async_write_bytes"] = _write_bytes() - written
    result["async_extra_bytes"] = _status_kib("VmHWM") * 1024 - rss
    result["disk_bytes"] = sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file())
    return result, step_dir


def main(out: str, workdir: str, stage: int, precision: str, tp: int = 1) -> None:
    layout = distributed.init(tp=tp)
    cfg = load_config(
        None,
        [
            "model.num_layers=4",
            "model.hidden_size=256",
            "model.num_heads=4",
            "model.seq_len=32",
            "model.vocab_size=4096",
            "model.attention_backend=sdpa",
            "model.position=rope" if precision == "bf16" and stage == 3 else "model.position=goat",
            "train.micro_batch_size=1",
            f"train.global_batch_size={layout.dp}",
            f"train.precision={precision}",
            f"parallel.zero_stage={stage}",
        ],
    )
    torch.manual_seed(0)
    model = GPT(cfg.model)
    # fp32 value + exp_avg + exp_avg_sq of the whole model (a TP-split parameter is 1/tp of it here)
    state_bytes = 12 * sum(
        p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1) for p in model.parameters()
    )
    engine = parallelize(model, cfg, grad_accum=1)
    tokens = torch.randint(0, 4096, (1, 33), generator=torch.Generator().manual_seed(layout.rank))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        loss = engine(tokens[:, :-1], torch.arange(32)[None], tokens[:, 1:])
    engine.backward(loss)
    engine.step()
    saves, step_dir = measured_saves(engine, model, layout, Path(workdir) / "run", tp, stage)
    sources = {tp: step_dir}
    if tp == 1:
        if layout.rank == 0:
            resplit_as_tp2(step_dir, Path(workdir) / "step_tp2")
        sources[2] = Path(workdir) / "step_tp2"
    dist.barrier()

    result = {"state_bytes": state_bytes}
    measured = {**saves, "lists_gathered": len(LISTS_GATHERED)}
    for saved_tp, source in sources.items():
        loaded = measured_load(engine, model, source)
        measured.update({f"{k}_from_tp{saved_tp}": v for k, v in loaded.items()})
    for key, value in measured.items():
        gathered = [torch.zeros(1, dtype=torch.float64) for _ in range(layout.world)]
        dist.all_gather(gathered, torch.tensor([float(value)], dtype=torch.float64))
        result[key] = [float(g) for g in gathered]
    if layout.rank == 0:
        index = json.loads((step_dir / "universal" / "index.json").read_text())
        rules = index["pieces"].values()
        result["index_rules"] = sorted({next(iter(r)) if isinstance(r, dict) else "list" for r in rules})
        result["index_grid"] = index["grid"]
        Path(out).write_text(json.dumps(result))
    distributed.exit_process(0)


def resplit_as_tp2(step_dir: Path, out: Path) -> None:
    """The same universal state as a TP=2 run would have written it (each parameter split as megatron
    splits it): resuming from it on TP=1 merges TP slices, the usual case of a layout change."""
    full, meta = universal.read_full(step_dir, KEYS)
    (out / "universal").mkdir(parents=True)
    for rank in range(2):
        tensors = {
            tensor_key(name, key): universal.split(value, meta["params"][name], 2, rank).contiguous()
            for name, states in full.items()
            for key, value in states.items()
        }
        save_file(tensors, str(out / "universal" / f"tp{rank:02d}.safetensors"))
    splits = {name: {k: m[k] for k in ("tp_split", "dim", "stride")} for name, m in meta["params"].items()}
    format1 = {"tp": 2, "step": meta["step"], "params": splits}  # format 1: no "format" key, no pieces
    (out / "universal" / "meta.json").write_text(json.dumps(format1))


def measured_load(engine, model, step_dir: Path) -> dict[str, int]:
    """Peak RSS above the starting RSS during one universal load, and the growth of file-backed RSS
    (memory-mapped checkpoint pages still mapped, shared-library code paged in on first use).

    Before measuring, freed heap memory is returned to the OS (``malloc_trim``), so that memory a previous
    load freed but the allocator kept cannot hide this load's allocations."""
    before, file_before = _reset_peak() // 1024, _status_kib("RssFile")
    universal.load(engine, model, step_dir, step=1)
    return {
        "extra_bytes": (_status_kib("VmHWM") - before) * 1024,
        "file_bytes": (_status_kib("RssFile") - file_before) * 1024,
    }


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], *map(int, sys.argv[5:]))
