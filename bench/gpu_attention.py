"""GOAT attention on CUDA in bf16: TFLOP/s of flash4 (FlashAttention-4), flash (FlashAttention-2, when
installed) and torch SDPA, GOAT against plain attention of the same shape in the same kernel, forward and
forward + backward, causal, at head dims 64 and 128 and L = 2k to 32k.

Each backend runs ``goat_attention`` (lanes folded into q/k, one kernel call) and, as "plain", the same
kernel on q/k/v of the same head dim with no prior (``kernels.attend``): batch so that B x L = 32k tokens,
16 query heads over 4 KV heads. FLOPs count the two matmuls on the causal half, with q/k and v head dims:
``2 B H (L^2 / 2) (D_qk + D_v)`` forward and 2.5x that backward (the usual flash-attn convention;
recomputation not counted; GOAT's lanes are part of D_qk, so both count the same work). Timing: CUDA
events, median of ``--repeats`` after ``--warmup`` calls (the first flash4 call of a shape JIT-compiles
its kernels and is not timed; a shape a kernel refuses, by an error or an ``AssertionError``, is
recorded under ``skipped``). Writes ``gpu_attention.json`` after every row (``complete`` once all ran)
and ``gpu_attention.md`` (a table) at the end to ``--out``; the last lines printed are GOAT / plain
fwd+bwd time and flash4 / sdpa fwd+bwd TFLOP/s.

    python bench/gpu_attention.py [--lengths 2048 8192 32768] [--head-dims 64 128] [--backends ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from goat_dist.goat import GoatPrior, goat_attention
from goat_dist.kernels import attend, resolve_backend


def timed(fn, repeats: int, warmup: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls, CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def measure(backend: str, L: int, D: int, plain: bool, args) -> dict:
    B = max(1, args.tokens // L)
    H, Hk = args.heads, args.kv_heads
    torch.manual_seed(0)
    prior = GoatPrior(Hk, args.pos_rank, args.abs_rank, training_seq_len=2048).cuda()
    d_c = D if plain else D - prior.num_lanes
    positions = torch.arange(L, device="cuda").expand(B, L)
    qc = torch.randn(B, L, H, d_c, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kc = torch.randn(B, L, Hk, d_c, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, L, Hk, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16)

    def call():
        if plain:
            return attend(qc, kc, v, causal=True, scale=D**-0.5, backend=backend)
        return goat_attention(qc, kc, v, prior, positions, causal=True, backend=backend)

    def fwd():
        with torch.no_grad():
            return call()

    def fwd_bwd():
        call().backward(grad)

    compile_start = time.perf_counter()
    fwd_bwd()  # first call: FA4 compiles here
    torch.cuda.synchronize()
    first_call_s = time.perf_counter() - compile_start
    t_fwd = timed(fwd, args.repeats, args.warmup)
    t_all = timed(fwd_bwd, args.repeats, args.warmup)
    flops_fwd = 2 * B * H * (L * L / 2) * (D + D)
    return {
        "backend": backend,
        "attention": "plain" if plain else "goat",
        "L": L,
        "batch": B,
        "heads": H,
        "kv_heads": Hk,
        "head_dim": D,
        "fwd_ms": t_fwd * 1e3,
        "fwd_bwd_ms": t_all * 1e3,
        "fwd_tflops": flops_fwd / t_fwd / 1e12,
        "fwd_bwd_tflops": 3.5 * flops_fwd / t_all / 1e12,
        "first_call_s": first_call_s,
    }


def write_json(out: Path, device: str, cap, rows: list, skipped: dict, done: bool = False) -> None:
    """gpu_attention.json as it stands (rewritten after every row; ``complete`` once all ran)."""
    out.mkdir(parents=True, exist_ok=True)
    result = {"device": device, "capability": list(cap), "torch": torch.__version__, "complete": done,
              "rows": rows, "skipped": skipped}  # fmt: skip
    tmp = out / "gpu_attention.json.tmp"
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(out / "gpu_attention.json")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument("--backends", nargs="+", default=["flash4", "flash", "sdpa"])
    p.add_argument("--tokens", type=int, default=32768, help="B x L per call")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--pos-rank", type=int, default=4)
    p.add_argument("--abs-rank", type=int, default=4)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("runs/gpu_suite"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name()
    cap = torch.cuda.get_device_capability()
    rows, skipped = [], {}
    write_json(args.out, device, cap, rows, skipped)
    for backend in args.backends:
        try:
            resolve_backend(backend)
        except (RuntimeError, ValueError) as exc:
            skipped[backend] = str(exc)
            print(f"{backend}: skipped ({exc})")
            continue
        for D in args.head_dims:
            for L in args.lengths:
                for plain in (False, True):
                    try:
                        row = measure(backend, L, D, plain, args)
                    except (RuntimeError, ValueError, AssertionError) as exc:  # FA4 refuses by assert
                        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                        skipped[f"{backend} D={D} L={L}"] = f"{type(exc).__name__}: {why}"
                        print(f"{backend} D={D} L={L}: failed ({type(exc).__name__}: {exc})", flush=True)
                        torch.cuda.empty_cache()
                        write_json(args.out, device, cap, rows, skipped)
                        break
                    rows.append(row)
                    write_json(args.out, device, cap, rows, skipped)  # a run cut short keeps its rows
                    print(
                        f"{backend:7s} {row['attention']:5s} D={D:3d} L={L:6d} B={row['batch']:3d}  "
                        f"fwd {row['fwd_ms']:8.2f} ms {row['fwd_tflops']:7.1f} TFLOP/s  fwd+bwd "
                        f"{row['fwd_bwd_ms']:8.2f} ms {row['fwd_bwd_tflops']:7.1f} TFLOP/s  "
                        f"(first call {row['first_call_s']:.1f} s)",
                        flush=True,
                    )
    write_json(args.out, device, cap, rows, skipped, done=True)
    lines = [
        f"GOAT and plain attention, bf16, causal, {device} (sm_{cap[0]}{cap[1]}), torch {torch.__version__}; "
        f"H={args.heads}, H_kv={args.kv_heads}, B x L = {args.tokens}",
        "",
        "| backend | attention | head dim | L | B | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['backend']} | {r['attention']} | {r['head_dim']} | {r['L']} | {r['batch']} | "
            f"{r['fwd_ms']:.2f} | {r['fwd_tflops']:.1f} | {r['fwd_bwd_ms']:.2f} | {r['fwd_bwd_tflops']:.1f} |"
        )
    lines += [f"\nskipped {name}: {why}" for name, why in skipped.items()]
    (args.out / "gpu_attention.md").write_text("\n".join(lines) + "\n")
    by = {(r["backend"], r["attention"], r["head_dim"], r["L"]): r for r in rows}
    overhead = [
        f"{b} D={D} L={L}: {r['fwd_bwd_ms'] / by[b, 'plain', D, L]['fwd_bwd_ms']:.3f}"
        for (b, kind, D, L), r in by.items()
        if kind == "goat" and (b, "plain", D, L) in by
    ]
    print("GOAT / plain fwd+bwd time: " + (", ".join(overhead) if overhead else "n/a"))
    speed = [
        f"D={D} L={L}: {r['fwd_bwd_tflops'] / by['sdpa', 'goat', D, L]['fwd_bwd_tflops']:.2f}"
        for (b, kind, D, L), r in by.items()
        if b == "flash4" and kind == "goat" and ("sdpa", "goat", D, L) in by
    ]
    print("flash4 / sdpa GOAT fwd+bwd TFLOP/s: " + (", ".join(speed) if speed else "n/a"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
