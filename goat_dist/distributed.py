"""Process groups: torch.distributed + megatron-core ``parallel_state``, set up and torn down once.

One process (``goat-dist train``) and many (``torchrun -m goat_dist train``) take the same path: without
torchrun's environment a world of size 1 is created, so the model is always built from megatron-core's
tensor-parallel layers.
"""

from __future__ import annotations

import atexit
import datetime
import math
import os
import socket
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .compat import apply_cpu_compat


@dataclass(frozen=True)
class Layout:
    world: int
    rank: int
    local_rank: int
    tp: int
    dp: int
    tp_rank: int
    dp_rank: int
    device: torch.device
    cp: int = 1  # context parallel: the ranks that split one sequence
    cp_rank: int = 0
    replica_rank: int = 0  # rank among the dp x cp model replicas (ZeRO's partition index)

    @property
    def replicas(self) -> int:
        """Ranks holding the same TP slice of the weights: DP x CP (ZeRO partitions and gradient
        reductions span them; CP splits activations, not weights)."""
        return self.dp * self.cp

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LayoutError(ValueError):
    """The parallel layout cannot work (sizes do not divide); raised before any work starts."""


def check_layout(
    world: int, tp: int, num_heads: int, num_kv_heads: int, seq_len: int, sp: bool, cp: int = 1
) -> None:
    """Reject impossible layouts before any work starts, naming the numbers."""
    problems = []
    if world % (tp * cp):
        what = f"parallel.tp={tp}" if cp == 1 else f"parallel.tp={tp} x parallel.cp={cp} = {tp * cp}"
        problems.append(f"world size {world} is not divisible by {what}")
    if cp > 1 and seq_len % (2 * cp):
        problems.append(
            f"model.seq_len={seq_len} is not divisible by 2 x parallel.cp = {2 * cp} (context parallel "
            "splits every sequence into 2·cp chunks)"
        )
    if cp > 1 and sp and seq_len % (2 * cp * tp):
        problems.append(
            f"model.seq_len={seq_len} is not divisible by 2 x parallel.cp x parallel.tp = {2 * cp * tp} "
            "(context parallel with sequence parallel)"
        )
    if num_heads % tp:
        problems.append(f"model.num_heads={num_heads} is not divisible by parallel.tp={tp}")
    if num_kv_heads % tp:
        problems.append(f"model.num_kv_heads={num_kv_heads} is not divisible by parallel.tp={tp}")
    if sp and cp == 1 and seq_len % tp:
        problems.append(f"model.seq_len={seq_len} is not divisible by parallel.tp={tp} (sequence parallel)")
    if problems:
        raise LayoutError("impossible parallel layout: " + "; ".join(problems))


def check_batch(global_batch: int, micro_batch: int, dp: int) -> None:
    """Reject a global batch that ``micro_batch`` x ``dp`` does not divide, naming the sizes that work: the
    largest micro-batch size up to the given one that divides it, else the nearest global batch sizes."""
    per_step = micro_batch * dp
    if global_batch % per_step == 0:
        return
    what = (
        f"train.global_batch_size={global_batch} is not divisible by train.micro_batch_size={micro_batch} "
        f"x data-parallel size {dp} = {per_step}"
    )
    fits = [m for m in range(min(micro_batch, global_batch // dp), 0, -1) if global_batch % (m * dp) == 0]
    lower, upper = global_batch // per_step * per_step, (global_batch // per_step + 1) * per_step
    batches = " or ".join(f"train.global_batch_size={b}" for b in (lower, upper) if b > 0)
    if fits:
        fix = f"set train.micro_batch_size={fits[0]} (the largest that divides it), or {batches}"
    else:
        fix = f"set {batches} (a multiple of {per_step})"
    raise LayoutError(f"impossible batch layout: {what}; {fix}")


def backend_for(cuda: bool) -> str:
    """The process-group backend: gloo on CPU; on CUDA, NCCL for device tensors AND gloo for CPU tensors.

    Why both: the trainer's control values (loss/fingerprint/flags of the one per-step collective,
    parameter counts, memory figures, checkpoint decisions) are host values, and NCCL reduces only CUDA
    tensors. A dual backend keeps them on the host (no device round trip) while gradients, parameters and
    megatron's TP traffic stay on NCCL. Every group created later without an explicit backend (megatron's
    parallel_state, DeepSpeed's) inherits both.
    """
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


DEFAULT_TIMEOUT_MINUTES = 10.0  # parallel.timeout_minutes' default


def init(tp: int = 1, cp: int = 1, timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES) -> Layout:
    """Initialise torch.distributed (see ``backend_for``) and megatron's parallel_state.

    megatron's rank order is tp-cp-dp (TP fastest): the CP ranks of one sequence are ``tp`` apart, and
    ``get_data_parallel_group(with_context_parallel=True)`` holds every replica of one TP slice.

    ``timeout_minutes`` (``parallel.timeout_minutes``) is the collective timeout of every group, the
    default one and megatron's (a mixed backend string would otherwise get torch's 30 minutes): a rank
    that stops answering ends a collective with an error instead of holding the job. megatron's own
    extra gloo groups are not created (nothing here uses them; at 512 ranks they are thousands of
    sockets per process)."""
    from megatron.core import parallel_state

    apply_cpu_compat()
    cuda = torch.cuda.is_available()
    if timeout_minutes <= 0:
        raise LayoutError(f"parallel.timeout_minutes must be > 0, got {timeout_minutes}")
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if not dist.is_initialized():
        backend = backend_for(cuda)
        if "RANK" in os.environ:  # torchrun (or Slurm via a launcher) set up the rendezvous
            dist.init_process_group(backend=backend, timeout=timeout)
        else:  # a single process: a private store, so child processes can start worlds of their own
            os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed insists on it
            url = f"tcp://127.0.0.1:{free_port()}"
            dist.init_process_group(backend=backend, init_method=url, rank=0, world_size=1, timeout=timeout)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not parallel_state.model_parallel_is_initialized():
        if dist.get_world_size() % (tp * cp):  # megatron would only assert
            what = f"parallel.tp={tp}" if cp == 1 else f"parallel.tp={tp} x parallel.cp={cp} = {tp * cp}"
            raise LayoutError(
                f"impossible parallel layout: world size {dist.get_world_size()} is not divisible by {what}"
            )
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            context_parallel_size=cp,
            distributed_timeout_minutes=max(1, math.ceil(timeout_minutes)),
            create_gloo_process_groups=False,
        )
    return Layout(
        world=dist.get_world_size(),
        rank=dist.get_rank(),
        local_rank=local_rank,
        tp=tp,
        dp=dist.get_world_size() // (tp * cp),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),  # without CP: the loader's split
        device=device,
        cp=cp,
        cp_rank=parallel_state.get_context_parallel_rank(),
        replica_rank=parallel_state.get_data_parallel_rank(with_context_parallel=True),
    )


def teardown(barrier: bool = True) -> None:
    """Barrier, destroy megatron's and torch's groups. Idempotent. After an error on this rank, skip the
    barrier: the other ranks may never reach it, and the error must surface instead of a hang."""
    from megatron.core import parallel_state

    if dist.is_initialized():
        try:
            if barrier:
                dist.barrier()
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


def exit_process(code: int = 0) -> None:
    """End a distributed worker deterministically.

    gloo groups created by DeepSpeed can outlive ``destroy_process_group`` and abort the interpreter at
    teardown ("terminate called without an active exception"). Running the atexit handlers ourselves,
    flushing, then ``os._exit`` avoids that race while still stopping helper processes cleanly.
    """
    teardown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
