"""torchrun worker: extra peak host memory (RSS) of a universal resume, per rank.

Every rank builds the same model under the given ZeRO stage, takes one step (so Adam's state exists) and
writes the universal state, also re-split as a TP=2 run writes it. For each of the two it resets its
peak-RSS counter (``/proc/self/clear_refs``), loads it back and reads the new peak. Rank 0 writes, per
rank, ``extra_bytes_from_tp<N>`` (peak above the starting RSS) and ``file_bytes_from_tp<N>`` (growth of
file-backed RSS), and ``state_bytes`` (fp32 weights + both Adam moments of the whole model) to the output
JSON. Used by tests/test_checkpoint.py.

    torchrun --nproc_per_node=4 universal_rss.py <out.json> <workdir> <zero_stage> <precision>
"""

import ctypes
import gc
import json
import re
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from goat_dist import distributed  # noqa: E402
from goat_dist.checkpoint import universal  # noqa: E402
from goat_dist.checkpoint.masters import KEYS  # noqa: E402
from goat_dist.checkpoint.slices import tensor_key  # noqa: E402
from goat_dist.config import load_config  # noqa: E402
from goat_dist.model import GPT  # noqa: E402
from goat_dist.trainer.parallelize import parallelize  # noqa: E402


def _status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+)", text).group(1))


def main(out: str, workdir: str, stage: int, precision: str) -> None:
    layout = distributed.init(tp=1)
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
    state_bytes = 12 * sum(p.numel() for p in model.parameters())  # fp32 value + exp_avg + exp_avg_sq
    engine = parallelize(model, cfg, grad_accum=1)
    tokens = torch.randint(0, 4096, (1, 33), generator=torch.Generator().manual_seed(layout.rank))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        loss = engine(tokens[:, :-1], torch.arange(32)[None], tokens[:, 1:])
    engine.backward(loss)
    engine.step()
    step_dir = Path(workdir) / "step"
    universal.save(engine, model, step_dir, step=1)
    if layout.rank == 0:
        resplit_as_tp2(step_dir, Path(workdir) / "step_tp2")
    dist.barrier()

    result = {"state_bytes": state_bytes}
    for saved_tp, source in ((1, step_dir), (2, Path(workdir) / "step_tp2")):
        for key, value in measured_load(engine, model, source).items():
            gathered = [torch.zeros(1, dtype=torch.long) for _ in range(layout.world)]
            dist.all_gather(gathered, torch.tensor([value]))
            result[f"{key}_from_tp{saved_tp}"] = [int(g) for g in gathered]
    if layout.rank == 0:
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
    (out / "universal" / "meta.json").write_text(json.dumps({**meta, "tp": 2}))


def measured_load(engine, model, step_dir: Path) -> dict[str, int]:
    """Peak RSS above the starting RSS during one universal load, and the growth of file-backed RSS
    (memory-mapped checkpoint pages still mapped, shared-library code paged in on first use).

    Before measuring, freed heap memory is returned to the OS (``malloc_trim``), so that memory a previous
    load freed but the allocator kept cannot hide this load's allocations."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    before, file_before = _status_kib("VmRSS"), _status_kib("RssFile")
    universal.load(engine, model, step_dir, step=1)
    return {
        "extra_bytes": (_status_kib("VmHWM") - before) * 1024,
        "file_bytes": (_status_kib("RssFile") - file_before) * 1024,
    }


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
