"""Checkpoint save / load time and size for a 125M-class GOAT model on CPU: ZeRO-0 vs ZeRO-3 on DP=2.

Each stage runs under torchrun (2 processes, gloo): build the model (12 layers, hidden 768, 12 heads,
vocab 50304), take one training step so that Adam state exists, then time ``CheckpointManager.save``
(DeepSpeed shards + the layout-independent universal copy + manifest with sha256 hashed by both ranks in
parallel + atomic publish), ``load`` into the same engine (DeepSpeed's shards: the same-layout path) and
``universal.load`` (the layout-change path: every rank reads only the slices it holds), then an
asynchronous save (``checkpoint.async``): the training loop's pause (``save_async``: staging in host
memory) and the time until it is published (``wait``).

Prints, per stage: bytes written / (model + optimizer-state bytes) (the state: fp32 masters + Adam's two
moments, + the bf16 weights in bf16, counted once, not per replica), split into DeepSpeed's shards and
universal/; save and load times and MB/s; the async pause vs the sync save, ratio last.

    python bench/checkpoint_io.py [--layers 12] [--hidden 768] [--precision fp32|bf16]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from goat_dist.launcher import child_env, launch_command


def same_contents(sync_dir: Path, async_dir: Path) -> str:
    """'yes' when every torch / safetensors file of the two checkpoints holds the same values, else the
    first file that differs (the async save of the same state must write what the sync save wrote)."""
    import torch
    from safetensors.torch import load_file

    from goat_dist.checkpoint.safe_load import load

    def equal(a, b) -> bool:
        if isinstance(a, torch.Tensor):
            bits = lambda t: t.detach().contiguous().view(-1).view(torch.uint8)  # noqa: E731 - NaN padding too
            return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(bits(a), bits(b))
        if isinstance(a, dict):
            return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return type(a) is type(b) and len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
        if isinstance(a, (bool, int, float, str)):
            return type(a) is type(b) and a == b
        return type(a) is type(b)  # DeepSpeed's objects (config, loss scaler): the structure only

    for path in sorted(sync_dir.rglob("*")):
        other = async_dir / path.relative_to(sync_dir)
        if path.suffix == ".pt" and not path.name.startswith("rng"):
            if not equal(load(path), load(other)):
                return f"differs: {path.name}"
        elif path.suffix == ".safetensors" and not equal(load_file(path), load_file(other)):
            return f"differs: {path.name}"
    return "yes"


def worker(args) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    from goat_dist import distributed
    from goat_dist.checkpoint import CheckpointManager, universal
    from goat_dist.config import load_config
    from goat_dist.model import GPT
    from goat_dist.trainer.parallelize import parallelize

    cfg = load_config(
        None,
        [
            f"model.num_layers={args.layers}",
            f"model.hidden_size={args.hidden}",
            "model.num_heads=12",
            "model.vocab_size=50304",
            "model.seq_len=128",
            "model.attention_backend=sdpa",
            f"parallel.zero_stage={args.stage}",
            "train.micro_batch_size=1",
            "train.global_batch_size=2",
            f"train.precision={args.precision}",
        ],
    )
    layout = distributed.init(tp=1)
    torch.manual_seed(0)
    model = GPT(cfg.model)
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
        **dict(world=layout.world, tp=1, dp=layout.dp, zero_stage=args.stage),
    }
    dist.barrier()
    t0 = time.perf_counter()
    step_dir = manager.save(engine, state, "model: {}\n")
    save_s = time.perf_counter() - t0
    files = [p for p in step_dir.rglob("*") if p.is_file()]
    ds = sum(p.stat().st_size for p in files if "universal" not in p.parts)
    uni = sum(p.stat().st_size for p in files if "universal" in p.parts)
    # the asynchronous save of the same state (step 2): the loop's pause, then the background writes
    dist.barrier()
    t0 = time.perf_counter()
    async_dir = manager.save_async(engine, {**state, "step": 2}, "model: {}\n")
    pause_s = time.perf_counter() - t0
    manager.wait()
    publish_s = time.perf_counter() - t0
    async_bytes = sum(p.stat().st_size for p in async_dir.rglob("*") if p.is_file())
    same = same_contents(step_dir, async_dir) if layout.is_main else None
    dist.barrier()
    t0 = time.perf_counter()
    manager.load(engine, step_dir, {k: state[k] for k in ("world", "tp", "dp", "zero_stage")})
    load_s = time.perf_counter() - t0
    dist.barrier()
    t0 = time.perf_counter()
    universal.load(engine, model, step_dir, step=1)
    dist.barrier()
    universal_load_s = time.perf_counter() - t0
    if layout.is_main:
        params = (
            sum(p.numel() for p in model.parameters())
            if args.stage < 3
            else sum(p.ds_numel for p in model.parameters())
        )
        Path(args.out).write_text(
            json.dumps(
                {
                    "save_s": save_s,
                    "load_s": load_s,
                    "universal_load_s": universal_load_s,
                    "ds_bytes": ds,
                    "universal_bytes": uni,
                    "params": params,
                    "async_pause_s": pause_s,
                    "async_publish_s": publish_s,
                    "async_bytes": async_bytes,
                    "async_same": same,
                }
            )
        )
    distributed.exit_process(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--stage", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    model = f"GOAT GPT {args.layers} layers, hidden {args.hidden}, vocab 50304, {args.precision}"
    print(f"{model}, DP=2 on CPU (gloo)")
    with tempfile.TemporaryDirectory() as tmp:
        for stage in (0, 3):
            out = Path(tmp) / f"zero{stage}" / "result.json"
            out.parent.mkdir()
            env = child_env(OMP_NUM_THREADS="1")
            cmd = launch_command(
                2,
                [
                    __file__,
                    "--worker",
                    f"--stage={stage}",
                    f"--out={out}",
                    f"--layers={args.layers}",
                    f"--hidden={args.hidden}",
                    f"--precision={args.precision}",
                ],
            )
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"ZeRO-{stage} failed:\n{proc.stderr[-3000:]}")
            r = json.loads(out.read_text())
            total = r["ds_bytes"] + r["universal_bytes"]
            # one copy of the training state: fp32 masters + exp_avg + exp_avg_sq (+ bf16 weights)
            state = r["params"] * (4 + 4 + 4 + (2 if args.precision == "bf16" else 0))
            ds_mb, uni_mb = r["ds_bytes"] / 1e6, r["universal_bytes"] / 1e6
            ds_x, uni_x = r["ds_bytes"] / state, r["universal_bytes"] / state
            print(
                f"  ZeRO-{stage}: {r['params'] / 1e6:.0f}M params, state {state / 1e6:.1f} MB | written "
                f"{total / 1e6:.1f} MB = {total / state:.2f} x state (DeepSpeed shards {ds_mb:.1f} MB = "
                f"{ds_x:.2f} x, universal {uni_mb:.1f} MB = {uni_x:.2f} x)",
                flush=True,
            )
            print(
                f"    save {r['save_s']:6.1f} s = {total / 1e6 / r['save_s']:6.1f} MB/s | "
                f"load {r['load_s']:6.1f} s = {r['ds_bytes'] / 1e6 / r['load_s']:6.1f} MB/s | "
                f"universal load {r['universal_load_s']:6.1f} s = {uni_mb / r['universal_load_s']:6.1f} MB/s",
                flush=True,
            )
            print(
                f"    async: published after {r['async_publish_s']:6.1f} s "
                f"({r['async_bytes'] / 1e6:.1f} MB) | "
                f"loop paused {r['async_pause_s']:6.2f} s vs sync save {r['save_s']:6.1f} s | "
                f"same contents as the sync save: {r['async_same']} | "
                f"pause / sync save {r['async_pause_s'] / r['save_s']:.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
