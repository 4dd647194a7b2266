"""What the trainer logs at log intervals besides loss, lr and grad norm, and the one collective it costs.

Why one place: these values need a reduction over ranks (the parameter norm under TP/ZeRO, every rank's
memory); gathering them together costs one small all-gather per *log* step, never one per training step,
so the hot loop keeps its single control collective.

* ``params_norm``: the L2 norm of all weights, as the model uses them (bf16 weights under bf16 training),
  exact under TP and every ZeRO stage: each rank contributes the squared sum of what it holds divided by
  the number of ranks holding the same values (DP replicas; TP replicas of replicated parameters; under
  ZeRO-3 a rank holds a distinct flat partition, counted once per TP replica). Each tensor's squares
  are summed in fp32 over pieces of at most ``NORM_CHUNK`` elements, the pieces' sums added in fp64: the
  only copy is one fp32 piece (16 MiB), never the whole tensor in fp32 or fp64 (which was 8 bytes per
  element twice over, 2 GiB for a 128M-element bf16 tensor); relative error <= 1e-6 against an fp64 sum
  (``tests/unit/observe/test_observe_metrics.py``). Not ``torch.linalg.vector_norm(x, dtype=float32)``
  (nor ``torch._foreach_norm``, which falls back to it on a CPU): on torch 2.13's CPU it casts the whole
  tensor to fp32 first and accumulates serially (3e-2 relative error at 128M elements).
* ``tflops_per_device`` / ``mfu``: ``tokens_per_s * flops_per_token / world`` against the device peak
  (``observe.flops``, ``observe.peak``); ``mfu`` is absent when the peak is unknown, capped at 1 (with
  ``mfu_raw``, ``mfu_unreliable``) when the peak is too low to be right.
* memory: allocated and peak bytes of the device allocator on CUDA (on a CPU the device *is* the host, so
  allocated = resident set and peak = peak resident set) and host RSS, each as min / mean / max over ranks
  and the rank of the max (``mem_peak_gib_max``, ``mem_peak_gib_max_rank``, ...): a fixed number of
  values whatever the world size (512 ranks' lists would be 1,536 TensorBoard cards). The per-rank lists
  (indexed by global rank) only with ``log.memory_per_rank``.
* ``epoch``: passes over the data of the current stream, for the source seen most often (weights / windows
  per epoch); 0 for a generated (synthetic) source, which never repeats.
"""

from __future__ import annotations

import functools
import resource

import psutil
import torch

from .. import collectives
from ..engine.zero3 import is_partitioned, partition_values
from .flops import flops_per_token
from .peak import cpu_peak, peak_flops, training_dtype

GIB = 2**30


NORM_CHUNK = 1 << 22  # elements squared at once: the one fp32 copy ``sumsq`` makes (16 MiB)


def sumsq(values: torch.Tensor) -> torch.Tensor:
    """The sum of squares of ``values`` (any float dtype), an fp64 scalar on its device: each piece of at
    most ``NORM_CHUNK`` elements copied to fp32, squared in place and summed in fp32 (pairwise on a CPU,
    a tree on CUDA), the pieces' sums added in fp64."""
    flat = values.detach().reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=flat.device)
    for piece in flat.split(NORM_CHUNK):
        total += piece.to(torch.float32, copy=True).square_().sum()
    return total


def param_sumsq_share(model: torch.nn.Module, tp: int, dp: int, dp_rank: int) -> float:
    """This rank's share of the global sum of squared weights (sum over all ranks = the global sum)."""
    total = None  # accumulated where the weights live: one device-to-host copy at the end
    for p in model.parameters():
        split_over_tp = bool(getattr(p, "tensor_model_parallel", False))
        if is_partitioned(p):  # ZeRO-3: a flat partition per DP rank, read without its padding
            values = partition_values(p, dp_rank)
            replicas = 1 if split_over_tp else tp
        else:
            values = p.detach()
            replicas = dp * (1 if split_over_tp else tp)
        share = sumsq(values) / replicas
        total = share if total is None else total + share.to(total.device)
    return 0.0 if total is None else float(total)


MEMORY_KEYS = ("mem_allocated_gib", "mem_peak_gib", "host_rss_gib")  # the gathered columns 1-3, in order
SUMMARY = ("min", "mean", "max", "max_rank")


def summarise(key: str, values) -> dict:
    """``key_min``, ``key_mean``, ``key_max`` and ``key_max_rank`` (the first rank holding the max) of one
    value per rank: what to watch at any world size (which rank runs out of memory first)."""
    v = torch.as_tensor(values, dtype=torch.float64).flatten()
    return {
        f"{key}_min": round(float(v.min()), 4),
        f"{key}_mean": round(float(v.mean()), 4),
        f"{key}_max": round(float(v.max()), 4),
        f"{key}_max_rank": int(v.argmax()),  # the first maximal index on ties
    }


def memory_metrics(rows: torch.Tensor, per_rank: bool = False) -> dict:
    """Memory metrics from the gathered [world, 3] bytes (allocated, peak, host RSS): summaries over
    ranks, plus each rank's value in GiB when ``per_rank``."""
    gib = rows.double() / GIB
    out = {}
    for col, key in enumerate(MEMORY_KEYS):
        out.update(summarise(key, gib[:, col]))
        if per_rank:
            out[key] = [round(float(v), 4) for v in gib[:, col]]
    return out


def memory_bytes(device: torch.device) -> tuple[float, float, float]:
    """(allocated, peak, host RSS) in bytes for this rank's device."""
    rss = float(psutil.Process().memory_info().rss)
    if device.type == "cuda":
        return float(torch.cuda.memory_allocated(device)), float(torch.cuda.max_memory_allocated(device)), rss
    peak_rss = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB
    return rss, max(peak_rss, rss), rss


@functools.cache
def _peak(device: torch.device, dtype: str, override: float, cache_dir: str):
    return peak_flops(device, dtype, override, cache_dir)


def device_peak(cfg, device: torch.device) -> tuple[float | None, str]:
    """Peak FLOP/s of one device for this run (probed at most once per process on a CPU)."""
    dtype = training_dtype(cfg.train.precision, device)
    return _peak(device, dtype, float(cfg.log.peak_tflops), str(cfg.data.cache_dir))


def reprobe_peak(cfg, device: torch.device) -> float:
    """A fresh CPU probe (the cache keeps the higher figure), for a measured peak that MFU exceeds."""
    _peak.cache_clear()
    return cpu_peak(training_dtype(cfg.train.precision, device), str(cfg.data.cache_dir), remeasure=True)


def mfu_metrics(flops_per_s: float, peak: float) -> dict:
    """``mfu``; above 1 the peak cannot be right (a probe run under load): ``mfu`` is capped at 1 and
    marked ``mfu_unreliable``, with the uncapped value as ``mfu_raw``."""
    raw = flops_per_s / peak
    if raw <= 1.0:
        return {"mfu": raw}
    return {"mfu": 1.0, "mfu_raw": raw, "mfu_unreliable": True}


def mfu_text(metrics: dict) -> str:
    """The console's MFU note: a percentage, or a warning instead of an impossible one."""
    if "mfu" not in metrics:
        return ""
    if metrics.get("mfu_unreliable"):
        return " (MFU >100%: peak estimate unreliable)"
    return f" (MFU {100 * metrics['mfu']:.1f}%)"


class StepMetrics:
    """Built once per training loop; ``collect`` is called on every rank at the same log steps."""

    def __init__(self, cfg, model: torch.nn.Module, layout, dataset):
        self.cfg, self.model, self.layout = cfg, model, layout
        self.flops_per_token = flops_per_token(cfg.model)["total"]
        self.peak, self.peak_source = device_peak(cfg, layout.device) if layout.is_main else (None, "")
        self.reprobed = False
        sources = getattr(dataset, "sources", None) or []
        windows = getattr(dataset, "windows_per_epoch", None)
        self.epoch_sizes = []  # (weight share, windows per epoch) per source
        if windows:
            total = sum(s.weight for s in sources)
            self.epoch_sizes = [(s.weight / total, w) for s, w in zip(sources, windows)]

    def epoch(self, samples: int) -> float:
        return max((samples * share / windows for share, windows in self.epoch_sizes), default=0.0)

    def collect(self, state, step_time_s: float, tokens_per_s: float) -> dict:
        """Collective over the world (one all-gather of four numbers per rank); what it returns does not
        grow with the world unless ``log.memory_per_rank`` asks for every rank's memory."""
        lay = self.layout
        own = [param_sumsq_share(self.model, lay.tp, lay.dp, lay.dp_rank), *memory_bytes(lay.device)]
        # host tensors: on CUDA the world is NCCL only, and collectives copies them to the device and back
        gathered = collectives.all_gather(torch.tensor(own, dtype=torch.float64))
        rows = torch.stack(gathered)
        tflops = tokens_per_s * self.flops_per_token / lay.world / 1e12
        out = {
            "params_norm": float(rows[:, 0].sum().sqrt()),
            "step_time_s": step_time_s,
            "tflops_per_device": tflops,
            **memory_metrics(rows[:, 1:4], per_rank=bool(self.cfg.log.memory_per_rank)),
            "consumed_tokens": state.consumed_tokens,
            "epoch": self.epoch(state.consumed_samples - state.stream_start),
        }
        if self.peak:
            out.update(self.mfu(tflops * 1e12))
        return out

    def mfu(self, flops_per_s: float) -> dict:
        """MFU against the peak; a measured peak that MFU exceeds is probed once more first."""
        if flops_per_s > self.peak and not self.reprobed and self.peak_source.startswith("measured"):
            self.reprobed = True
            self.peak = max(self.peak, reprobe_peak(self.cfg, self.layout.device))
        return mfu_metrics(flops_per_s, self.peak)
