"""The devices check: CUDA devices visible to every rank (``LOCAL_RANK`` has one, a small allocation
works), GPUs that Slurm allocated not invisible to torch; CPU with gloo on a machine without CUDA."""

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

    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if local_rank >= count:
            report.fail(
                "devices",
                f"LOCAL_RANK {local_rank} has no CUDA device: {count} visible "
                f"(CUDA_VISIBLE_DEVICES={environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}). With one task per "
                "GPU every task must see all of its node's GPUs: do not bind GPUs per task (--gpus-per-task, "
                "--gpu-bind); give --gpus-per-node with --ntasks-per-node",
            )
            return None
        device = torch.device("cuda", local_rank)
        try:
            torch.cuda.set_device(device)
            torch.ones(1024, device=device).sum().item()
        except Exception as e:  # a broken or busy GPU
            report.fail(
                "devices", f"cuda:{local_rank} ({torch.cuda.get_device_name(local_rank)}) unusable: {e}"
            )
            return None
        if local_world > count:
            report.warn("devices", f"{local_world} tasks on this node share {count} GPUs")
        report.ok("devices", f"{count} x {torch.cuda.get_device_name(local_rank)} visible; backend nccl")
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
