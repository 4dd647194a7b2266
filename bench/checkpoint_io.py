"""Checkpoint save / load cost per rank on CPU: DP=2 and DP=4 (gloo), a 125M-class GOAT model by default.

Each world runs under torchrun: build the model, take one training step so that Adam state exists, then

* a synchronous ``CheckpointManager.save`` (each rank writes its own share, hashes it as written; rank 0
  the manifest and ``latest``): seconds, and the bytes each process wrote (``/proc/self/io``);
* an asynchronous save of the same state (``checkpoint.async``): the loop's pause (staging this rank's
  share in host memory) and the time until it is published;
* a load of the checkpoint into the same engine (the same-layout path: every rank reads its own file).

Prints, per world: bytes written / state (the state: fp32 masters + Adam's two moments, 12 B/param), the
busiest rank's bytes / the mean, save and load seconds and MB/s, the async pause / the sync save, and
whether the async files hold what the sync ones do.

    python bench/checkpoint_io.py [--layers 12] [--hidden 768] [--precision fp32|bf16] [--stage 1]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from goat_dist.launcher import child_env, launch_command


def _write_bytes() -> int:
    return int(re.search(r"write_bytes:\s+(\d+)", Path("/proc/self/io").read_text()).group(1))


def same_contents(sync_dir: Path, async_dir: Path) -> str:
    """'yes' when every safetensors file of the two checkpoints holds the same values, else the first that
    differs (an async save of the same state must write what the sync save wrote)."""
    import torch
    from safetensors.torch import load_file

    for path in sorted((sync_dir / "universal").glob("*.safetensors")):
        a, b = load_file(path), load_file(async_dir / "universal" / path.name)
        if a.keys() != b.keys() or not all(torch.equal(a[k], b[k]) for k in a):
            return f"differs: {path.name}"
    return "yes"


def worker(args) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    from goat_dist import distributed
    from goat_dist.checkpoint import CheckpointManager
    from goat_dist.config import load_config
    from goat_dist.model import GPT
    from goat_dist.parallel.parallelize import parallelize

    layout = distributed.init(tp=1)
    cfg = load_config(
        None,
        [
            f"model.num_layers={args.layers}",
            f"model.hidden_size={args.hidden}",
            "model.num_heads=12" if args.hidden % 12 == 0 else "model.num_heads=8",
            "model.vocab_size=50304",
            "model.seq_len=128",
            "model.attention_backend=sdpa",
            f"parallel.zero_stage={args.stage}",
            "train.micro_batch_size=1",
            f"train.global_batch_size={layout.dp}",
            f"train.precision={args.precision}",
        ],
    )
    torch.manual_seed(0)
    model = GPT(cfg.model)
    params = sum(p.numel() for p in model.parameters())
    engine = parallelize(model, cfg, grad_accum=1)
    tokens = torch.randint(0, 50304, (1, 129))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
        loss = engine(tokens[:, :-1], torch.arange(128)[None], tokens[:, 1:])
    engine.backward(loss)
    engine.step()
    manager = CheckpointManager(Path(args.out).parent / "run", keep_last=0, is_main=layout.is_main)
    state = {
        "step": 1,
        "run_state": {},
        "world": layout.world,
        "tp": 1,
        "dp": layout.dp,
        "zero_stage": args.stage,
    }
    mine = {}
    dist.barrier()
    written, t0 = _write_bytes(), time.perf_counter()
    step_dir = manager.save(engine, dict(state), "model: {}\n")
    mine["save_s"], mine["save_bytes"] = time.perf_counter() - t0, _write_bytes() - written
    dist.barrier()
    written, t0 = _write_bytes(), time.perf_counter()
    async_dir = manager.save_async(engine, {**state, "step": 2}, "model: {}\n")
    mine["pause_s"] = time.perf_counter() - t0
    manager.wait()
    mine["publish_s"], mine["async_bytes"] = time.perf_counter() - t0, _write_bytes() - written
    dist.barrier()
    t0 = time.perf_counter()
    manager.load(engine, step_dir, {k: state[k] for k in ("world", "tp", "dp", "zero_stage")})
    dist.barrier()
    mine["load_s"] = time.perf_counter() - t0
    ranks = [None] * layout.world
    dist.all_gather_object(ranks, mine)
    if layout.is_main:
        disk = sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file())
        same = same_contents(step_dir, async_dir)
        Path(args.out).write_text(json.dumps({"ranks": ranks, "params": params, "disk": disk, "same": same}))
    distributed.exit_process(0)


def report(dp: int, r: dict) -> None:
    state = 12 * r["params"]
    ranks = r["ranks"]
    for kind in ("save", "async"):
        per_rank = [x[f"{kind}_bytes"] for x in ranks]
        total, mean = sum(per_rank), sum(per_rank) / len(per_rank)
        print(
            f"  DP={dp} {kind:5s}: wrote {total / 1e6:7.1f} MB = {total / state:.3f} x state | busiest rank "
            f"{max(per_rank) / 1e6:6.1f} MB = {max(per_rank) / mean:.2f} x mean",
            flush=True,
        )
    save_s = max(x["save_s"] for x in ranks)
    load_s = max(x["load_s"] for x in ranks)
    pause_s = max(x["pause_s"] for x in ranks)
    publish_s = max(x["publish_s"] for x in ranks)
    mb = state / 1e6
    print(
        f"  DP={dp} on disk {r['disk'] / state:.3f} x state | save {save_s:5.2f} s ({mb / save_s:6.1f} MB/s) "
        f"| load {load_s:5.2f} s ({mb / load_s:6.1f} MB/s) | async pause {pause_s:5.2f} s, published after "
        f"{publish_s:5.2f} s | async pause / sync save = {pause_s / save_s:.2f} | async files same as sync: "
        f"{r['same']}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--stage", type=int, default=1, help="ZeRO stage (default 1)")
    ap.add_argument("--worlds", default="2,4", help="data-parallel sizes to run (default 2,4)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    model = f"GOAT GPT {args.layers} layers, hidden {args.hidden}, vocab 50304"
    print(f"{model}, {args.precision}, ZeRO-{args.stage}, CPU (gloo)")
    with tempfile.TemporaryDirectory() as tmp:
        for dp in map(int, args.worlds.split(",")):
            out = Path(tmp) / f"dp{dp}" / "result.json"
            out.parent.mkdir()
            flags = [f"--layers={args.layers}", f"--hidden={args.hidden}", f"--precision={args.precision}"]
            cmd = launch_command(dp, [__file__, "--worker", f"--out={out}", f"--stage={args.stage}", *flags])
            proc = subprocess.run(cmd, env=child_env(OMP_NUM_THREADS="1"), capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"DP={dp} failed:\n{proc.stderr[-3000:]}")
            report(dp, json.loads(out.read_text()))


if __name__ == "__main__":
    main()
