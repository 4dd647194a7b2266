"""Process groups: torch.distributed + megatron-core ``parallel_state``, set up and torn down once.

One process (``goat-dist train``) and many (``torchrun -m goat_dist train``) take the same path: without
torchrun's environment a world of size 1 is created, so the model is always built from megatron-core's
tensor-parallel layers.

``init`` returns a ``Layout``: the sizes, this rank's place and its process groups (TP, DP, CP and the
DP x CP replicas). Everything that needs a group is handed the layout (or the group), so this module is
the one place besides ``goat_dist.parallel`` that reads megatron's ``parallel_state`` (a test holds it).
"""

from __future__ import annotations

import atexit
import datetime
import os
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import collectives
from .compat import apply_cpu_compat
from .rampup import sizes_to_come


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
    # the process groups (torch ProcessGroups; None in a layout written by hand, e.g. a test's fake one)
    tp_group: Any = field(default=None, repr=False, compare=False)
    dp_group: Any = field(default=None, repr=False, compare=False)  # DP only: the loader's split
    cp_group: Any = field(default=None, repr=False, compare=False)
    replica_group: Any = field(default=None, repr=False, compare=False)  # DP x CP: ZeRO, grad averages

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


def _nearest(options: list[int], wanted: int) -> int:
    return min(options, key=lambda v: (abs(v - wanted), v))  # a tie: the smaller


def check_rampup(
    final: int, micro_batch: int, dp: int, rampup, seq_len: int, consumed_samples: int = 0
) -> None:
    """Reject a ``train.batch_rampup`` whose global batches still to come (after ``consumed_samples``, a
    resume's) ``micro_batch`` x ``dp`` does not divide, naming a ramp that works (the start and increment
    nearest the given ones that are multiples of it), else the largest micro-batch size that divides every
    size. A ramp already over is not checked; the final size is ``check_batch``'s."""
    if not rampup:
        return
    check_batch(final, micro_batch, dp)
    per_step = micro_batch * dp
    sizes = sizes_to_come(consumed_samples, final, rampup, seq_len)
    odd = [s for s in sizes if s % per_step]
    if not odd:
        return
    start, increment, ramp_tokens = rampup
    what = (
        f"train.batch_rampup={list(rampup)} takes global batches of {', '.join(map(str, odd))} sequences, "
        f"not divisible by train.micro_batch_size={micro_batch} x data-parallel size {dp} = {per_step}"
    )
    fixes = []
    starts = list(range(per_step, final, per_step))
    if starts:
        new_start = _nearest(starts, start)
        gap = final - new_start
        new_increment = _nearest([d for d in range(per_step, gap + 1, per_step) if gap % d == 0], increment)
        fixes.append(
            f"train.batch_rampup=[{new_start},{new_increment},{ramp_tokens}] (multiples of {per_step})"
        )
    micro = [m for m in range(micro_batch - 1, 0, -1) if all(s % (m * dp) == 0 for s in sizes)]
    if micro:
        fixes.append(f"train.micro_batch_size={micro[0]} (the largest that divides every size)")
    no_ramp = "train.batch_rampup=null (no ramp)"
    if not starts:
        no_ramp += f": no global batch below train.global_batch_size={final} is a multiple of {per_step}"
    fixes.append(no_ramp)
    raise LayoutError(f"impossible batch layout: {what}; set {', or '.join(fixes)}")


def backend_for(cuda: bool) -> str:
    """The world group's backend, which every group created after it inherits: gloo on CPU, NCCL on CUDA.

    No gloo side on CUDA: a gloo group connects every pair of its ranks when it is created, so a world
    group with one (``cpu:gloo,cuda:nccl``) cost every rank world - 1 sockets at start (511 at 512 ranks,
    ``bench/world_sockets.py``), for a few host-side collectives (checkpoint decisions, start records,
    log-step gathers). Those go through ``goat_dist.collectives``, which copies a host tensor to the device
    for a group that serves only CUDA and the result back (one copy each way, at saves, start and log
    steps; torch does the same for object collectives on NCCL). An NCCL communicator connects a rank to a
    few ring and tree peers, and only when the group is first used. The per-step control vector is a
    device tensor already."""
    return "nccl" if cuda else "gloo"


DEFAULT_TIMEOUT_MINUTES = 10.0  # parallel.timeout_minutes' default
NCCL_TRACE_PREFIX = "nccl_trace_rank_"  # <run_dir>/nccl_trace_rank_<rank>: NCCL's flight recorder dumps


# What every launcher exports before the training processes start (``launch_environment``): slurm/train.sbatch
# and launch/local.sh through ``slurm/goat_slurm.py env``, ``goat-dist train --nproc`` through
# ``launcher.worker_env``. Two of them act only when set before the process touches CUDA:
# CUDA_DEVICE_MAX_CONNECTIONS is read when the CUDA context is created, the allocator's configuration at its
# first allocation.
MAX_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"
ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
# the allocator's configuration, under either name (torch reads PYTORCH_ALLOC_CONF first)
ALLOC_CONF_VARS = (ALLOC_CONF, "PYTORCH_ALLOC_CONF")
LAUNCH_ENV = {
    # one hardware work queue: megatron's TP (and SP) communication overlap relies on kernels running in
    # the order they were issued (a site may export another value for runs without TP: it is kept)
    MAX_CONNECTIONS: "1",
    # the caching allocator grows segments instead of fragmenting into fixed blocks (less memory lost to
    # fragmentation with changing activation shapes)
    ALLOC_CONF: "expandable_segments:True",
    # NCCL's async error handling: a collective that times out tears the process down
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
}


def launch_environment(environ) -> dict[str, str]:
    """The variables a launcher exports for its training processes, given its own ``environ``: each of
    ``LAUNCH_ENV`` the environment does not set already. A value of the user's (or the site file's) is
    kept as it is, an allocator configuration included: one set in ``PYTORCH_CUDA_ALLOC_CONF`` or
    ``PYTORCH_ALLOC_CONF`` without ``expandable_segments`` stays without it (the site chose its allocator).
    A ``CUDA_DEVICE_MAX_CONNECTIONS`` other than 1 is kept too, and refused by ``distributed.init`` under TP
    (``cuda_settings``)."""
    return {key: value for key, value in LAUNCH_ENV.items() if _unset(environ, key)}


class LaunchEnvError(LayoutError):
    """The process environment cannot give the run what it needs (a variable that can no longer be set);
    the message names the variable, its value, the value needed and where to set it."""


def cuda_environment(tp: int, run_dir: Path | None) -> dict[str, str]:
    """What a CUDA run sets in its environment before the first NCCL communicator or CUDA context, where
    a launcher has not (``LAUNCH_ENV``):

    * NCCL's async error handling: a collective that times out tears the process down (a frozen peer
      ends the job instead of holding it; ``srun --kill-on-bad-exit`` and torchrun end the rest);
    * its flight recorder: the last collectives of every rank, dumped on a timeout into
      ``<run_dir>/nccl_trace_rank_<rank>`` (read with ``torchfrtrace <run_dir> --prefix nccl_trace_rank_``);
    * the allocator's expandable segments;
    * ``CUDA_DEVICE_MAX_CONNECTIONS=1`` under TP: megatron's TP communication overlap relies on kernels
      being issued in order (the launchers export it for every run)."""
    env = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": LAUNCH_ENV["TORCH_NCCL_ASYNC_ERROR_HANDLING"],
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        ALLOC_CONF: LAUNCH_ENV[ALLOC_CONF],
    }
    if run_dir is not None:
        env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = str(Path(run_dir) / NCCL_TRACE_PREFIX)
    if tp > 1:
        env[MAX_CONNECTIONS] = LAUNCH_ENV[MAX_CONNECTIONS]
    return env


def _unset(environ, key: str) -> bool:
    """``key`` is not set in ``environ`` (for the allocator's configuration: under neither of its names)."""
    return not any(name in environ for name in (ALLOC_CONF_VARS if key == ALLOC_CONF else (key,)))


def cuda_settings(
    environ, cuda_initialised: bool, tp: int, sp: bool = False, run_dir: Path | None = None
) -> dict[str, str]:
    """The variables ``init`` sets on CUDA (``cuda_environment``, each only where ``environ`` does not set
    it), or ``LaunchEnvError`` where the run cannot get what it needs: under TP (or SP) megatron needs
    ``CUDA_DEVICE_MAX_CONNECTIONS=1``, so another value is refused, and so is none at all once the CUDA
    context exists (``cuda_initialised``), where setting it has no effect any more."""
    needs_one = tp > 1 or sp
    value = environ.get(MAX_CONNECTIONS)
    why = f"parallel.tp={tp}" + (" with parallel.sp=true" if sp else "")
    fix = (
        f"export {MAX_CONNECTIONS}=1 in the launcher, before python starts (slurm/train.sbatch, "
        "launch/local.sh and goat-dist train --nproc do; check slurm/site.env and the submitting shell)"
    )
    if needs_one and value is not None and value.strip() != "1":
        raise LaunchEnvError(
            f"{MAX_CONNECTIONS}={value} is set, but {why} needs {MAX_CONNECTIONS}=1 (megatron's "
            f"tensor-parallel communication overlaps compute only when kernels run in issue order): {fix}"
        )
    if needs_one and value is None and cuda_initialised:
        raise LaunchEnvError(
            f"{MAX_CONNECTIONS} is not set and the CUDA context already exists, so setting it now has no "
            f"effect; {why} needs {MAX_CONNECTIONS}=1: {fix}"
        )
    return {k: v for k, v in cuda_environment(tp, run_dir).items() if _unset(environ, k)}


def _configure_cuda(tp: int, run_dir: Path | None, sp: bool = False) -> None:
    """``cuda_settings``, applied to this process's environment (refused as it says)."""
    settings = cuda_settings(os.environ, torch.cuda.is_initialized(), tp, sp, run_dir)
    if run_dir is not None:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
    os.environ.update(settings)


class DeviceBindingError(RuntimeError):
    """This task cannot tell which CUDA device is its own; the message names LOCAL_RANK, the devices
    it sees and CUDA_VISIBLE_DEVICES. Not a ``LayoutError``: it may hold on some ranks only, and each
    such rank reports it."""


def local_device_index(local_rank: int, visible: int, environ=None) -> int:
    """The CUDA device index of the task with ``LOCAL_RANK`` ``local_rank`` that sees ``visible`` devices.

    Two bindings work: every task sees all of its node's GPUs (``--gpus-per-node`` with one task per GPU)
    and ``LOCAL_RANK`` picks one; or each task sees exactly one (``srun --gpus-per-task=1``,
    ``--gpu-bind=single:1`` or ``map_gpu``), device 0, whatever ``LOCAL_RANK`` says. Anything else
    (no device, or fewer than ``LOCAL_RANK + 1``) raises ``DeviceBindingError``."""
    environ = os.environ if environ is None else environ
    seen = f"CUDA_VISIBLE_DEVICES={environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}"
    if visible == 1:
        return 0
    if visible < 1:
        raise DeviceBindingError(f"LOCAL_RANK={local_rank}: this task sees no CUDA device ({seen})")
    if not 0 <= local_rank < visible:
        raise DeviceBindingError(
            f"LOCAL_RANK={local_rank} has no CUDA device: this task sees {visible} ({seen}). Either every "
            "task sees all of its node's GPUs (--gpus-per-node=G with --ntasks-per-node=G: LOCAL_RANK picks "
            "one) or each task sees exactly one (srun --gpus-per-task=1, or --gpu-bind=single:1 / map_gpu); "
            "a binding that gives a task some but not all GPUs leaves LOCAL_RANK pointing past them"
        )
    return local_rank


NODE_LOCAL_RANK = "GOAT_NODE_LOCAL_RANK"  # the launcher's LOCAL_RANK, where LOCAL_RANK was made the device's


def node_local_rank(environ=None) -> int:
    """This process's place among its node's processes, as the launcher numbered them: which process does
    a node's once-only work (local checks, the node's view of shared files). ``LOCAL_RANK``, unless
    ``bind_local_rank`` made that the device's index."""
    env = os.environ if environ is None else environ
    return int(env.get(NODE_LOCAL_RANK, env.get("LOCAL_RANK", 0)))


def bind_local_rank(environ, index: int) -> None:
    """Make ``LOCAL_RANK`` the index of this task's device, keeping the launcher's in ``NODE_LOCAL_RANK``.

    Why: DeepSpeed takes its device from ``LOCAL_RANK`` itself (its engine's ``_set_distributed_vars``,
    ZeRO-3's ``zero.Init`` and ``zero/utils.py``), so under one GPU per task, where ``LOCAL_RANK`` 0-7
    each see their one device as cuda:0 (``local_device_index``), it would ask for a device past the
    task's. Nothing changes where the two agree (every task sees all of its node's GPUs)."""
    launcher = environ.get("LOCAL_RANK", "0")
    if launcher != str(index):
        environ.setdefault(NODE_LOCAL_RANK, launcher)
        environ["LOCAL_RANK"] = str(index)


def local_device(local_rank: int | None = None) -> torch.device:
    """This task's CUDA device (``local_device_index`` of ``LOCAL_RANK`` and the devices it sees)."""
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
    return torch.device("cuda", local_device_index(local_rank, torch.cuda.device_count()))


def init(
    tp: int = 1,
    cp: int = 1,
    timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES,
    run_dir: Path | None = None,
) -> Layout:
    """Initialise torch.distributed (see ``backend_for``) and megatron's parallel_state.

    megatron's rank order is tp-cp-dp (TP fastest): the CP ranks of one sequence are ``tp`` apart, and
    ``get_data_parallel_group(with_context_parallel=True)`` holds every replica of one TP slice.

    ``timeout_minutes`` (``parallel.timeout_minutes``) is the collective timeout of every group, the
    default one and megatron's (a mixed backend string would otherwise get torch's 30 minutes): a rank
    that stops answering ends a collective with an error instead of holding the job. megatron's own
    extra gloo groups are not created (nothing here uses them). On CUDA, ``run_dir`` receives NCCL's
    flight-recorder dumps (``cuda_environment``); the environment is completed or refused as
    ``cuda_settings`` says, and the device is ``local_device_index``'s."""
    from megatron.core import parallel_state

    apply_cpu_compat()
    cuda = torch.cuda.is_available()
    if timeout_minutes <= 0:
        raise LayoutError(f"parallel.timeout_minutes must be > 0, got {timeout_minutes}")
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if cuda:
        _configure_cuda(tp, run_dir)  # before anything here creates the CUDA context
    if not dist.is_initialized():
        backend = backend_for(cuda)
        if "RANK" in os.environ:  # torchrun (or Slurm via a launcher) set up the rendezvous
            dist.init_process_group(backend=backend, timeout=timeout)
        else:  # a single process: a private store, so child processes can start worlds of their own
            os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed insists on it
            url = f"tcp://127.0.0.1:{free_port()}"
            dist.init_process_group(backend=backend, init_method=url, rank=0, world_size=1, timeout=timeout)
    if cuda and dist.get_backend() != "fake":  # a simulated CUDA machine (tests) has no device to pick
        device = local_device()  # LOCAL_RANK's, or the task's only one (local_device_index)
        bind_local_rank(os.environ, device.index)  # DeepSpeed reads LOCAL_RANK for its device
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
            distributed_timeout_minutes=timeout_minutes,  # a float is kept (a timedelta of minutes)
            create_gloo_process_groups=False,
        )
    return current_layout()


def current_layout() -> Layout:
    """The layout of the process groups ``init`` (or ``init_fake``) set up: sizes, ranks and groups, read
    from torch.distributed and megatron's parallel_state. For code handed no layout (a model built in a
    test); the run's own code passes the one ``init`` returned."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("no parallel layout: goat_dist.distributed.init() has not run in this process")
    cuda = torch.cuda.is_available() and dist.get_backend() != "fake"
    local_rank = node_local_rank()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    cp = parallel_state.get_context_parallel_world_size()
    return Layout(
        world=dist.get_world_size(),
        rank=dist.get_rank(),
        local_rank=local_rank,
        tp=tp,
        dp=dist.get_world_size() // (tp * cp),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),  # without CP: the loader's split
        device=local_device() if cuda else torch.device("cpu"),
        cp=cp,
        cp_rank=parallel_state.get_context_parallel_rank(),
        replica_rank=parallel_state.get_data_parallel_rank(with_context_parallel=True),
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        dp_group=parallel_state.get_data_parallel_group(),
        cp_group=parallel_state.get_context_parallel_group(),
        replica_group=parallel_state.get_data_parallel_group(with_context_parallel=True),
    )


def init_fake(rank: int, world: int, tp: int, cp: int = 1, backend: str = "fake") -> Layout:
    """Rank ``rank`` of a fake world of ``world`` processes (torch's "fake" backend: collectives do
    nothing; or a registered ``backend`` of the same kind, such as the rehearsal's recording one), for
    building or running one rank's model on the meta device (the planner's dry run, the rehearsal), with
    megatron's TP/CP/DP groups as ``init`` makes them. Undone by ``teardown_fake``."""
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group(backend, store=FakeStore(), rank=rank, world_size=world)
    # megatron's extra gloo groups cannot be created on a fake world (and are not needed to build)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, context_parallel_size=cp, create_gloo_process_groups=False
    )
    return current_layout()


def teardown_fake() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


# what a collective says when a peer stopped answering (gloo's timeout and reset texts, NCCL's watchdog)
_PEER_LOST = (
    "Timed out",
    "timed out",
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
)


def collective_failure(error: BaseException, timeout: float | str) -> str | None:
    """The reason ``last_exit.json`` records when ``error`` is a collective that lost a peer (None
    otherwise): the collective error alone names a socket, not what happened to the job. ``timeout``: the
    timeout that applied, as minutes of ``parallel.timeout_minutes`` or as the caller words it."""
    text = str(error)
    if not isinstance(error, RuntimeError) or not any(m in text for m in _PEER_LOST):
        return None
    what = "timed out" if "imed out" in text else "lost its connection to a peer"
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    applied = f"parallel.timeout_minutes={timeout:g}" if isinstance(timeout, (int, float)) else timeout
    return (
        f"a collective {what} ({applied}): another rank stopped "
        f"answering (frozen, dead or far behind; see its log); {type(error).__name__}: {first}"
    )


def teardown(barrier: bool = True) -> None:
    """Barrier, destroy megatron's and torch's groups. Idempotent. After an error on this rank, skip the
    barrier: the other ranks may never reach it, and the error must surface instead of a hang."""
    from megatron.core import parallel_state

    if dist.is_initialized():
        try:
            if barrier:
                collectives.barrier()
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
