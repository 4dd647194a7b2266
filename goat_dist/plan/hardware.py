"""GPUs the planner knows: dense bf16 peak, memory, HBM bandwidth and the links between GPUs.

Peaks come from ``observe.peak`` (the same datasheet numbers MFU is measured against during training).
Memory is what ``nvidia-smi`` reports as the device's total (a little under the marketing number).
Bandwidths are per GPU and per direction: NVLink inside a node, the node's InfiniBand/RoCE NICs shared
out per GPU (one 400 Gb/s NDR NIC per GPU on DGX/HGX H100, H200 and B200; 200 Gb/s HDR on DGX A100).
The planner applies ``LINK_EFFICIENCY`` to both: NCCL's measured bus bandwidth is about 80 % of the link.

``measured_host`` describes a machine from what ``goat-dist doctor`` measures instead (a CPU's matmul
peak, gloo's all-reduce bus bandwidth): ``bench/plan_vs_measured.py`` checks the planner's terms on it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..observe.peak import table_peak

GIB = 1024**3
LINK_EFFICIENCY = 0.8


@dataclass(frozen=True)
class GPU:
    name: str
    cuda_name: str  # as torch.cuda.get_device_name reports it (the key of observe.peak.PEAK_FLOPS)
    memory_gib: float
    hbm_tb_s: float
    nvlink_gb_s: float  # per GPU, per direction
    network_gb_s: float  # per GPU, per direction, between nodes
    capability: tuple[int, int] = (9, 0)  # CUDA compute capability: which attention kernels it runs
    # a measured peak (FLOP/s) in place of the datasheet's (``measured_host``)
    peak_flops: float | None = None
    # communication can run beside compute: CUDA streams. DeepSpeed's CPU accelerator is a "synchronized
    # device" (``is_synchronized_device()``): no reduction stream, every collective runs in line
    streams: bool = True
    link_efficiency: float = LINK_EFFICIENCY  # measured bus bandwidths are taken as they are (1.0)
    # fixed seconds per collective on top of its bytes: not counted on GPUs (NCCL's launches are a few
    # microseconds against the milliseconds of these messages); measured on a host (gloo: milliseconds)
    collective_latency_s: float = 0.0
    # an all-gather's and a reduce-scatter's time over a ring's ((n-1)/n of the buffer at the bus
    # bandwidth): 1 for NCCL's rings; gloo's reduce-scatter runs as an all-reduce (measured ~2 on 2 ranks)
    all_gather_cost: float = 1.0
    reduce_scatter_cost: float = 1.0

    @property
    def peak_bf16(self) -> float:
        if self.peak_flops is not None:
            return self.peak_flops
        peak = table_peak(self.cuda_name, "bf16")
        assert peak is not None, self.cuda_name
        return peak

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)


GPUS: dict[str, GPU] = {
    g.name: g
    for g in (
        GPU("a100-40gb", "NVIDIA A100-SXM4-40GB", 39.4, 1.555, 300, 25, (8, 0)),
        GPU("a100-80gb", "NVIDIA A100-SXM4-80GB", 79.2, 2.039, 300, 25, (8, 0)),
        GPU("h100-80gb", "NVIDIA H100 80GB HBM3", 79.6, 3.35, 450, 50, (9, 0)),
        GPU("h200", "NVIDIA H200", 139.8, 4.8, 450, 50, (9, 0)),
        GPU("b200", "NVIDIA B200", 178.4, 8.0, 900, 50, (10, 0)),
    )
}


def gpu(name: str) -> GPU:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}") from None


def measured_host(
    matmul_flops: float,
    busbw_gb_s: float,
    memory_gb_s: float,
    latency_s: float = 0.0,
    all_gather_cost: float = 1.0,
    reduce_scatter_cost: float = 1.0,
    memory_gib: float = 1024.0,
) -> GPU:
    """A CPU host as the planner's device, from measurements: ``matmul_flops`` a rank's matmul FLOP/s (the
    doctor's probe, ``observe.peak.measure_matmul_flops``, at the rank's threads), ``busbw_gb_s`` the
    all-reduce bus bandwidth between its ranks (``goat-dist doctor``'s, nccl-tests' definition: already
    what a ring achieves, so no link efficiency), ``memory_gb_s`` a rank's memory bandwidth, ``latency_s``
    each collective's fixed cost beyond its bytes, ``all_gather_cost`` and ``reduce_scatter_cost`` those
    collectives' measured time over a ring's at that bandwidth. No streams: collectives do not overlap
    compute there."""
    return GPU("measured-host", "cpu", memory_gib, memory_gb_s / 1e3, busbw_gb_s, busbw_gb_s, (0, 0),
               peak_flops=matmul_flops, streams=False, link_efficiency=1.0,
               collective_latency_s=latency_s, all_gather_cost=all_gather_cost,
               reduce_scatter_cost=reduce_scatter_cost)  # fmt: skip
