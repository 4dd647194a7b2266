"""The devices check: CUDA devices visible to every rank (its device, ``distributed.local_device_index``:
``LOCAL_RANK``'s among all of the node's GPUs, or the task's only one; a small allocation works), GPUs
that Slurm allocated not invisible to torch; CPU with gloo on a machine without CUDA."""

from __future__ import annotations

from .report import Report


def _gpus_allocated(environ) -> str | None:
    """What Slurm/the environment says about GPUs for this task, if it says any were given."""
    for name in ("SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "CUDA_VISIBLE_DEVICES"):
        value = environ.get(name, "")
        if value and value not in ("0", "-1", "NoDevFiles") and name != "SLURM_GPUS_ON_NODE":
            return f"{name}={value}"
        if name == "SLURM_GPUS_ON_NODE" and value.isdigit() and int(value) > 0:
            return f"{name}={value}"
    return None


def check_devices(report: Report, environ, local_rank: int, local_world: int):
    import torch

    from ..distributed import DeviceBindingError, local_device_index

    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        try:
            index = local_device_index(local_rank, count, environ)
        except DeviceBindingError as e:
            report.fail("devices", str(e))
            return None
        device = torch.device("cuda", index)
        try:
            torch.cuda.set_device(device)
            torch.ones(1024, device=device).sum().item()
        except Exception as e:  # a broken or busy GPU
            report.fail("devices", f"cuda:{index} ({torch.cuda.get_device_name(index)}) unusable: {e}")
            return None
        name = torch.cuda.get_device_name(index)
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        if count == 1 and local_world > 1 and visible:  # one GPU per task (--gpus-per-task=1, --gpu-bind)
            report.ok("devices", f"1 x {name} for this task (CUDA_VISIBLE_DEVICES={visible}); backend nccl")
            return device
        if local_world > count:
            report.warn("devices", f"{local_world} tasks on this node share {count} GPUs")
        report.ok("devices", f"{count} x {name} visible; backend nccl")
        return device
    allocated = _gpus_allocated(environ)
    if allocated:
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        report.fail(
            "devices",
            f"GPUs were allocated ({allocated}) but torch {torch.__version__} ({build}) sees none: "
            "install the CUDA build of torch, or check the driver (nvidia-smi) and the module loads in "
            "slurm/site.env",
        )
        return None
    report.ok("devices", f"no CUDA: training runs on CPU with gloo (torch {torch.__version__})")
    return torch.device("cpu")
