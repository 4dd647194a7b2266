"""Peak FLOP/s of one device, the denominator of MFU.

Why a table: a GPU's peak is a datasheet number, not something a short probe reaches. Known accelerators
are looked up by the name CUDA reports; ``log.peak_tflops`` overrides everything (other GPUs, clocks,
TF32). On a CPU there is no datasheet number worth using: the peak is *measured* once, per core, and
multiplied by the process's thread count. One thread, the training dtype, the best of many single
``512 x 512`` products over ``PROBE_S`` seconds: on a machine shared with other jobs a multi-threaded probe
measured a sixth of the real rate (each product waits for its slowest thread, and a busy machine always
has one descheduled), so a quiet training run printed MFU above 100 % on every line; one thread gets
whole time slices, and the best sample of many is one that nothing interrupted. The figure per core is
cached in ``<data.cache_dir>/peak_flops.json``, so CPU MFU reads as "fraction of what this machine's
cores reach in matmuls". An MFU above 1 still means the cached figure is too low: the run probes once
more (``cpu_peak(remeasure=True)``, the cache keeps the higher figure) and, if MFU still exceeds 1, the
console says once that MFU is unknown (``observe.step_metrics.mfu_metrics`` marks it unreliable).
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch

from ..atomic import atomic_write_text
from ..precision import resolve_precision, torch_dtype

# Dense (no structured sparsity) peak FLOP/s per GPU, NVIDIA datasheets (SXM parts unless named). fp32 is
# the non-tensor-core rate: torch does not use TF32 for fp32 matmuls unless told to.
# Matched in order as substrings of torch.cuda.get_device_name() (e.g. "NVIDIA H100 80GB HBM3").
PEAK_FLOPS: list[tuple[str, dict[str, float]]] = [
    ("A100", {"bf16": 312e12, "fp32": 19.5e12}),
    ("H100 PCIe", {"bf16": 756e12, "fp32": 51.2e12}),
    ("H100", {"bf16": 989.4e12, "fp32": 66.9e12}),
    ("H200", {"bf16": 989.4e12, "fp32": 66.9e12}),
    ("B200", {"bf16": 2250e12, "fp32": 75e12}),
]


# ``bf16`` or ``fp32``: what the matmuls of a run with ``train.precision`` use on a device (the one resolver)
training_dtype = resolve_precision


def table_peak(device_name: str, dtype: str) -> float | None:
    for key, peaks in PEAK_FLOPS:
        if key.lower() in device_name.lower():
            return peaks[dtype]
    return None


PROBE_N = 512  # one product takes a few ms on a core: short enough to fit between two preemptions
PROBE_S = 1.5  # seconds of samples per probe


def measure_matmul_flops(
    dtype: torch.dtype = torch.float32, n: int = 1024, seconds: float = 1.0, threads: int | None = None
) -> float:
    """Best observed FLOP/s of one ``n x n`` matmul on the CPU, on ``threads`` threads (default: the
    process's), over ``seconds``: each product is timed alone, so one that the scheduler interrupted
    lowers only its own sample."""
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)  # not the run's RNG: a probe mid-run must not change the data
        a, b = (torch.randn(n, n, generator=gen).to(dtype) for _ in range(2))
        torch.mm(a, b)  # warm-up: thread pool, packing buffers
        best, deadline = 0.0, time.perf_counter() + seconds
        while True:
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = max(best, 2 * n**3 / (time.perf_counter() - t0))
            if time.perf_counter() > deadline:
                return best
    finally:
        torch.set_num_threads(previous)


def core_flops(dtype: torch.dtype) -> float:
    """One core's matmul FLOP/s in ``dtype`` (the probe behind a CPU's peak)."""
    return measure_matmul_flops(dtype, n=PROBE_N, seconds=PROBE_S, threads=1)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_peak(dtype: str, cache_dir: str | Path, remeasure: bool = False) -> float:
    """This process's CPU peak: one core's FLOP/s (from the cache when this machine and dtype were
    measured) times the thread count. ``remeasure`` probes again and keeps the higher figure: a probe only
    ever under-measures."""
    cache = Path(cache_dir).expanduser() / "peak_flops.json"
    key = f"{_cpu_name()} | per core | {dtype} | torch {torch.__version__}"
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if key not in known or remeasure:
        measured = core_flops(torch_dtype(dtype))
        known[key] = max(measured, float(known.get(key, 0.0)))
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(cache, json.dumps(known, indent=1))
        except OSError:
            pass  # a read-only cache only costs a probe per run
    return float(known[key]) * torch.get_num_threads()


def peak_flops(device: torch.device, dtype: str, override_tflops: float, cache_dir: str | Path):
    """(FLOP/s or None, where it came from). None: an unknown GPU without ``log.peak_tflops``."""
    if override_tflops:
        return override_tflops * 1e12, "log.peak_tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = table_peak(name, dtype)
        return peak, (f"table: {name} {dtype}" if peak else f"unknown device {name!r}; set log.peak_tflops")
    cache = Path(cache_dir).expanduser() / "peak_flops.json"
    threads = torch.get_num_threads()
    source = f"measured: CPU matmul probe, {dtype}, one core x {threads} threads, cached in {cache}"
    return cpu_peak(dtype, cache_dir), source
