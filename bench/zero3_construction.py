"""The model's construction peak per rank: ZeRO-3 (built partitioned, ``engine/construct.py``) against
ZeRO-0 (every rank builds its whole shard in fp32), the same model, each on a real world of ``--nproc``
gloo ranks (torchrun), CPU.

Each rank builds the model exactly as the trainer does (``GPT(..., built=partition_as_built(cfg, ...))``)
and reports the high-water mark of its resident memory above the memory it held just before (Linux's
``VmHWM``, reset through ``/proc/self/clear_refs``), then the same for the engine's build
(``parallelize``). torch allocates tensors outside Python's allocator, so tracemalloc would see none of
them; with a fixed 64 KiB mmap threshold every tensor is its own mapping, a freed one leaves the RSS at
once, and the high-water mark follows the live tensors. A first small build before the measurement loads
the code the builds run (library pages count in the RSS too). The engine's build adds the training state
it allocates at once (at ZeRO-3 its fp32 master and gradient partitions; ``goat-dist plan`` counts them
as state). The last line is the ratio of the largest ZeRO-3 rank's construction peak to the largest
ZeRO-0 rank's (target: <= 0.35 at DP=4).

    python bench/zero3_construction.py [--nproc 4] [--layers 24] [--hidden 512]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MMAP_THRESHOLD = 1 << 16


def overrides(args, stage: int) -> list[str]:
    return [
        f"model.num_layers={args.layers}",
        f"model.hidden_size={args.hidden}",
        "model.num_heads=8",
        "model.seq_len=128",
        "model.vocab_size=4096",
        "model.attention_backend=sdpa",
        "train.precision=fp32",
        "train.micro_batch_size=1",
        f"train.global_batch_size={args.nproc}",
        f"parallel.zero_stage={stage}",
    ]


# ---- one rank ------------------------------------------------------------------------------------------
def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(field)


class Peak:
    """The RSS high-water mark above the RSS at ``reset()``, in bytes."""

    def __init__(self):
        import ctypes

        self.libc = ctypes.CDLL("libc.so.6")
        self.libc.mallopt(-3, MMAP_THRESHOLD)  # M_MMAP_THRESHOLD: fixed, so freed tensors are unmapped
        self.base = 0

    def reset(self) -> None:
        import gc

        gc.collect()
        self.libc.malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        self.base = _kib("VmRSS") * 1024

    def peak(self) -> int:
        return _kib("VmHWM") * 1024 - self.base

    def held(self) -> int:
        return _kib("VmRSS") * 1024 - self.base


def worker(args) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    from goat_dist import distributed
    from goat_dist.config import load_config
    from goat_dist.engine.construct import partition_as_built
    from goat_dist.model import GPT
    from goat_dist.parallel.parallelize import parallelize
    from goat_dist.trainer.trainer import gradient_accumulation

    torch.set_num_threads(1)
    layout = distributed.init(tp=1)
    cfg = load_config(None, overrides(args, args.stage))
    accum = gradient_accumulation(cfg, layout.dp)
    meter = Peak()
    small = load_config(None, [*overrides(args, args.stage), "model.num_layers=1"])
    GPT(small.model, built=partition_as_built(small, accum, layout))  # loads the code (see the docstring)
    hook = partition_as_built(cfg, accum, layout)
    dist.barrier()
    meter.reset()
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model, built=hook)
    result = {"construction": meter.peak(), "held": meter.held()}
    result["model_bytes"] = 4 * sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())
    result["largest_part"] = hook.largest_part_bytes if hook is not None else 0
    dist.barrier()
    meter.reset()
    parallelize(model, cfg, accum)
    result["engine"] = meter.peak()
    everyone = [None] * layout.world
    dist.all_gather_object(everyone, result)
    if layout.rank == 0:
        Path(args.out).write_text(json.dumps(everyone))
    distributed.exit_process(0)


# ---- the driver --------------------------------------------------------------------------------------
def measure(stage: int, args, workdir: Path) -> list[dict]:
    from goat_dist.launcher import child_env, launch_command

    out = workdir / f"zero{stage}.json"
    # the worker's settings as one positional argument: torchrun would claim options such as --nproc
    job = json.dumps({"stage": stage, "out": str(out), "nproc": args.nproc, "layers": args.layers,
                      "hidden": args.hidden})  # fmt: skip
    env = child_env(OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD))
    cmd = launch_command(args.nproc, [str(Path(__file__).resolve()), "worker", job])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode or not out.exists():
        sys.exit(f"ZeRO-{stage} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def main() -> None:
    if sys.argv[1:2] == ["worker"]:
        worker(argparse.Namespace(**json.loads(sys.argv[2])))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=512)
    args = ap.parse_args()
    mib = lambda n: f"{n / 2**20:8.1f}"
    peaks = {}
    with tempfile.TemporaryDirectory() as tmp:
        for stage in (0, 3):
            ranks = measure(stage, args, Path(tmp))
            model = ranks[0]["model_bytes"]
            print(
                f"ZeRO-{stage}, DP={args.nproc}: model {mib(model)} MiB fp32 per rank"
                + (f", largest part {mib(ranks[0]['largest_part'])} MiB" if stage == 3 else "")
            )
            print("  rank  construction peak MiB (x model)   held after MiB   engine build peak MiB")
            for r, m in enumerate(ranks):
                print(
                    f"  {r:4d}  {mib(m['construction'])} ({m['construction'] / model:.3f})"
                    f"               {mib(m['held'])}         {mib(m['engine'])}"
                )
            peaks[stage] = max(m["construction"] for m in ranks)
            sys.stdout.flush()
    share = 1 / args.nproc
    print(
        f"construction peak ratio ZeRO-3 / ZeRO-0 (largest rank): {peaks[3] / peaks[0]:.3f} "
        f"(partition alone: {share:.3f}; target <= 0.35)"
    )


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
