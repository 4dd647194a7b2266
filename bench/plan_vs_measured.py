"""The planner's step time against measured steps: a small GOAT model on 2 CPU ranks (gloo), several
layouts, each predicted by ``plan.planner.throughput`` and measured through the trainer's engine.

The planner is fed this machine as ``goat-dist doctor`` measures it (``plan.hardware.measured_host``):
a rank's matmul FLOP/s from the CPU peak probe (``observe.peak.core_flops``: one core, as each of the 2
ranks runs one thread), the all-reduce bus bandwidth from the doctor's own check
(``doctor.rendezvous.check_all_reduce``, 16 MiB x 5 as ``goat-dist doctor`` on a CPU), and, for the
memory-bound terms the doctor does not probe, a rank's memory bandwidth (a copy of 64 MiB, here). Both
ranks probe at once, as they run.

Each layout is one torchrun launch of 2 processes (``OMP_NUM_THREADS=1``): the model as the trainer
builds it (``GPT`` with ZeRO-3's partitioned construction, ``parallelize``: SP, CP, checkpointing, the TP
gradient sum, the DeepSpeed engine), random tokens, ``--warmup`` steps, then ``--steps`` timed steps of
the layout's micro-batches (``Engine.backward(last=...)``, ``Engine.step``); the median step counts, the
slower rank's, and of ``--rounds`` launches the faster (other work on the machine only slows one). The
wall time inside torch.distributed's collectives is recorded too, so communication and the rest are
checked term by term.

On this machine nothing overlaps: DeepSpeed's CPU accelerator is a synchronized device (no reduction
stream: ``stage_1_and_2``'s ``reduction_stream`` is None, ZeRO-3 fetches in line), and gloo's work runs
on the same 2 cores as the compute. The planner is told so (``streams=False``), so what it predicts here
is its terms summed; the overlap itself (``plan.planner.dp_schedule``) cannot be shown on gloo.

    python bench/plan_vs_measured.py [--hidden 384] [--layers 4] [--seq 256] [--steps 4]

Last line: ``planner vs measured step time: max relative error <x> over <n> layouts; predicted best =
measured best: yes|no``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "_all_gather_base",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "reduce",
    "broadcast",
    "all_to_all_single",
)

# name, TP, SP, CP, ZeRO stage, activation checkpointing, micro-batch (the global batch is --batch)
LAYOUTS = (
    ("DP2 ZeRO-0", 1, False, 1, 0, "none", 2),
    ("DP2 ZeRO-1 accum 2", 1, False, 1, 1, "none", 1),
    ("DP2 ZeRO-2 accum 2", 1, False, 1, 2, "none", 1),
    ("DP2 ZeRO-3", 1, False, 1, 3, "none", 2),
    ("DP2 ZeRO-1 full ckpt", 1, False, 1, 1, "full", 2),
    ("TP2", 2, False, 1, 1, "none", 4),
    ("TP2+SP", 2, True, 1, 1, "none", 4),
    ("CP2", 1, False, 2, 1, "none", 4),
)


def overrides(args, tp: int, sp: bool, cp: int, stage: int, ac: str, micro: int) -> list[str]:
    return [
        f"model.hidden_size={args.hidden}",
        f"model.num_layers={args.layers}",
        f"model.num_heads={args.heads}",
        f"model.seq_len={args.seq}",
        f"model.vocab_size={args.vocab}",
        f"model.ffn_hidden_size={args.ffn}",
        "model.attention_backend=sdpa",
        "model.compile=false",
        f"parallel.tp={tp}",
        f"parallel.sp={'true' if sp else 'false'}",
        f"parallel.cp={cp}",
        f"parallel.zero_stage={stage}",
        f"train.activation_checkpointing={ac}",
        f"train.micro_batch_size={micro}",
        f"train.global_batch_size={args.batch}",
        "train.precision=fp32",
    ]


def _nbytes(name: str, a: tuple, k: dict) -> int:
    """Bytes of the buffer a collective reduces or fills (the output of a gather, the input of a
    reduce-scatter)."""
    import torch

    first = a[0] if a else next(iter(k.values()), None)
    if name == "reduce_scatter_tensor" or name == "_reduce_scatter_base":
        first = a[1] if len(a) > 1 else k.get("input", first)
    if isinstance(first, (list, tuple)):
        return sum(t.numel() * t.element_size() for t in first if isinstance(t, torch.Tensor))
    return first.numel() * first.element_size() if isinstance(first, torch.Tensor) else 0


def time_collectives() -> dict:
    """Accumulate the wall time spent inside torch.distributed's collectives (waiting for the peer
    included), their number and their bytes; installed before megatron-core and DeepSpeed bind them."""
    import torch.distributed as dist

    spent = {"s": 0.0, "calls": 0, "bytes": 0}
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None:
            continue

        def timed(*a, _fn=fn, _name=name, **k):
            t0 = time.perf_counter()
            out = _fn(*a, **k)
            spent["s"] += time.perf_counter() - t0
            spent["calls"] += 1
            nbytes = _nbytes(_name, a, k)
            spent["bytes"] += nbytes
            kinds = spent.setdefault("kinds", {})
            calls, total = kinds.get(_name, (0, 0))
            kinds[_name] = (calls + 1, total + nbytes)
            return out

        setattr(dist, name, timed)
    return spent


def probe(args) -> None:
    """Both ranks: the doctor's CPU peak probe and all-reduce check, and a memory copy bandwidth."""
    import socket

    import torch
    import torch.distributed as dist

    from goat_dist import distributed
    from goat_dist.doctor.rendezvous import check_all_reduce
    from goat_dist.doctor.report import Report
    from goat_dist.observe.peak import core_flops

    torch.set_num_threads(1)
    layout = distributed.init(tp=1)
    dist.barrier()
    flops = core_flops(torch.float32)
    dist.barrier()
    a = torch.ones(16 * 2**20)  # 64 MiB
    b = torch.empty_like(a)
    b.copy_(a)
    best = 0.0
    for _ in range(20):
        t0 = time.perf_counter()
        b.copy_(a)
        best = max(best, 2 * a.numel() * 4 / (time.perf_counter() - t0))  # read + write
    dist.barrier()
    report = Report(layout.rank, socket.gethostname())
    check_all_reduce(report, torch.device("cpu"), 16 * 2**20, 5)
    large = report.bandwidth
    # the same check at the engine's bucket (h^2 fp32 elements, the size most of its collectives have):
    # what it takes beyond its bytes at the large one's bandwidth is the per-collective cost
    check_all_reduce(report, torch.device("cpu"), 4 * args.hidden**2, 9)
    small = report.bandwidth
    latency = small["seconds"] - small["bytes"] / (large["busbw_GBps"] * 1e9)  # 2 ranks: 2(n-1)/n = 1
    # the engine's other two collectives at the same 16 MiB, against a ring's time at that bandwidth
    costs = []
    whole, half = torch.ones(4 * 2**20), torch.ones(2 * 2**20)
    for gather in (True, False):
        times = []
        for i in range(8):
            dist.barrier()
            t0 = time.perf_counter()
            if gather:
                dist.all_gather_into_tensor(whole, half)
            else:
                dist.reduce_scatter_tensor(half, whole)
            if i:  # the first: warm-up
                times.append(time.perf_counter() - t0)
        ring = whole.numel() * 4 / 2 / (large["busbw_GBps"] * 1e9)  # (n-1)/n of the buffer, 2 ranks
        costs.append(statistics.median(times) / ring)
    both = torch.tensor([flops, best, *costs], dtype=torch.float64)
    dist.all_reduce(both)
    if layout.rank == 0:
        out = {"matmul_flops": both[0].item() / 2, "memory_bytes_s": both[1].item() / 2,
               "busbw_GBps": large["busbw_GBps"], "latency_s": max(latency, 0.0),
               "all_gather_cost": both[2].item() / 2, "reduce_scatter_cost": both[3].item() / 2}  # fmt: skip
        Path(args.out).write_text(json.dumps(out))
    distributed.exit_process(0)


def worker(args) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    spent = time_collectives()
    import torch

    from goat_dist import distributed
    from goat_dist.config import load_config
    from goat_dist.engine.construct import partition_as_built
    from goat_dist.model import GPT
    from goat_dist.parallel.parallelize import parallelize
    from goat_dist.shapes import resolve_key_bias_lanes

    torch.set_num_threads(1)
    lay = json.loads(args.layout)
    cfg = load_config(None, overrides(args, *lay[1:]))
    resolve_key_bias_lanes(cfg.model, cfg.train.precision)  # as the trainer resolves it before building
    p, t = cfg.parallel, cfg.train
    layout = distributed.init(tp=p.tp, cp=p.cp)
    accum = t.global_batch_size // (t.micro_batch_size * layout.dp)
    torch.manual_seed(0)
    model = GPT(cfg.model, layout, sequence_parallel=p.sp, built=partition_as_built(cfg, accum, layout))
    engine = parallelize(model, cfg, grad_accum=accum)
    gen = torch.Generator().manual_seed(layout.dp_rank)  # TP and CP peers read the same rows
    tokens = torch.randint(0, cfg.model.vocab_size, (t.micro_batch_size, args.seq + 1), generator=gen)
    positions = torch.arange(args.seq).expand(t.micro_batch_size, -1)

    def step():
        for i in range(accum):
            loss = engine(tokens[:, :-1], positions, tokens[:, 1:])
            engine.backward(loss, last=i == accum - 1)
        engine.step()

    for _ in range(args.warmup):
        step()
    steps, comms = [], []
    for _ in range(args.steps):
        torch.distributed.barrier()
        spent.update(s=0.0, calls=0, bytes=0, kinds={})
        start = time.perf_counter()
        step()
        steps.append(time.perf_counter() - start)
        comms.append(spent["s"])
    # the slower rank's view: each rank's median, the max over ranks
    med = torch.tensor([statistics.median(steps), statistics.median(comms)], dtype=torch.float64)
    torch.distributed.all_reduce(med, op=torch.distributed.ReduceOp.MAX)
    if layout.rank == 0:
        Path(args.out).write_text(json.dumps({"step_s": med[0].item(), "comm_s": med[1].item(),
                                              "grad_accum": accum, "calls": spent["calls"],
                                              "bytes": spent["bytes"], "kinds": spent["kinds"]}))  # fmt: skip
    distributed.exit_process(0)


def launch(extra: list[str], args, out: Path) -> dict:
    from goat_dist.launcher import child_env, launch_command

    env = child_env(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    cmd = launch_command(2, [__file__, *extra, f"--out={out}", *passthrough(args)])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{extra} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def passthrough(args) -> list[str]:
    keys = ("hidden", "layers", "heads", "seq", "vocab", "ffn", "batch", "steps", "warmup")
    return [f"--{k}={getattr(args, k)}" for k in keys]


def predict(args, lay, host) -> dict:
    from goat_dist.config import load_config
    from goat_dist.plan.planner import layout_of, planned_config, throughput

    cfg = planned_config(load_config(None, overrides(args, *lay[1:])))
    return throughput(cfg, layout_of(cfg, 2), host, gpus_per_node=2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4, help="global batch (sequences per step)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per layout (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="launches per layout; the fastest counts")
    ap.add_argument("--only", nargs="+", default=None, help="run only these layouts (by name)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--layout", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        return probe(args)
    if args.worker:
        return worker(args)

    from goat_dist.plan.hardware import measured_host

    layouts = [lay for lay in LAYOUTS if args.only is None or lay[0] in args.only]
    print(
        f"GOAT GPT hidden={args.hidden} layers={args.layers} heads={args.heads} seq={args.seq} "
        f"vocab={args.vocab} ffn={args.ffn}, global batch {args.batch}, fp32, 2 ranks x 1 thread, gloo "
        f"({os.cpu_count()} cores)",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        m = launch(["--probe"], args, Path(tmp) / "probe.json")
        host = measured_host(m["matmul_flops"], m["busbw_GBps"], m["memory_bytes_s"] / 1e9, m["latency_s"],
                             m["all_gather_cost"], m["reduce_scatter_cost"])  # fmt: skip
        print(
            f"measured: matmul {m['matmul_flops'] / 1e9:.1f} GFLOP/s per rank, gloo all-reduce busbw "
            f"{m['busbw_GBps']:.2f} GB/s and {m['latency_s'] * 1e3:.2f} ms per collective beyond its bytes "
            f"(at {4 * args.hidden**2 / 2**20:.2f} MiB), memory copy {m['memory_bytes_s'] / 1e9:.1f} GB/s "
            f"per rank; all-gather {m['all_gather_cost']:.2f} and reduce-scatter "
            f"{m['reduce_scatter_cost']:.2f} x a ring's time",
            flush=True,
        )
        print(
            f"{'layout':<22} {'predicted s':>11} {'measured s':>10} {'rel err':>8} | {'pred comm':>9} "
            f"{'meas comm':>9} | {'pred rest':>9} {'meas rest':>9}"
        )
        rows = []
        for i, lay in enumerate(layouts):
            pred = predict(args, lay, host)
            # a shared machine only ever slows a run down: the faster of --rounds launches counts
            runs = [launch(["--worker", f"--layout={json.dumps(lay)}"], args, Path(tmp) / f"{i}.{r}.json")
                    for r in range(args.rounds)]  # fmt: skip
            meas = min(runs, key=lambda r: r["step_s"])
            comm_p = pred["tp_comm_s"] + pred["cp_comm_s"] + pred["dp_comm_s"]
            err = abs(pred["step_s"] - meas["step_s"]) / meas["step_s"]
            rows.append((lay[0], pred["step_s"], meas["step_s"], err))
            print(
                f"{lay[0]:<22} {pred['step_s']:>11.3f} {meas['step_s']:>10.3f} {err:>8.3f} | {comm_p:>9.3f} "
                f"{meas['comm_s']:>9.3f} | {pred['step_s'] - comm_p:>9.3f} "
                f"{meas['step_s'] - meas['comm_s']:>9.3f}"
                f"   [{meas['calls']} collectives, {meas['bytes'] / 1e6:.1f} MB: {meas['kinds']}]"
                f"   (matmuls {pred['compute_s']:.3f}, memory-bound {pred['memory_bound_s']:.3f}, TP "
                f"{pred['tp_comm_s']:.3f}, CP {pred['cp_comm_s']:.3f}, DP {pred['dp_comm_s']:.3f}, optimizer "
                f"{pred['optimizer_s']:.3f})",
                flush=True,
            )
    best_p = min(rows, key=lambda r: r[1])[0]
    best_m = min(rows, key=lambda r: r[2])[0]
    print(f"predicted best: {best_p}; measured best: {best_m}")
    print(
        f"planner vs measured step time: max relative error {max(r[3] for r in rows):.3f} over {len(rows)} "
        f"layouts; predicted best = measured best: {'yes' if best_p == best_m else 'no'}"
    )


if __name__ == "__main__":
    main()
