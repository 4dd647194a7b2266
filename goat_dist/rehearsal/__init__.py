"""Rehearse the cluster job on a CPU: one rank's real training step at the real world size, the accelerator
stood in (``goat-dist plan --rehearse``; ``docs/gpu.md``).

Every test of this project runs over gloo on CPUs, where three kinds of GPU fault cannot show: a host tensor
meeting a device tensor, a host sync on the step path, a kernel call FlashAttention refuses. The rehearsal
builds rank R of a world of N x G ranks in this one process (``world``: a process-group backend that
records every collective instead of sending it), with the **meta** device standing in for CUDA
(``standin``), the FlashAttention stand-ins for the GPU's kernels (``kernels``), and runs the trainer's own
step (``step``). It reports, and fails on:

* placement faults (a CPU tensor meeting a meta one raises, as it would meet a CUDA one), by file and line;
* host syncs per step beyond the designed one (the control agreement), by file, line and count, unless a
  configured feature documents its cost (``rank.DOCUMENTED_SYNCS``);
* kernel calls the real interface refuses;
* host tensors sent to a group that is NCCL-only on a CUDA run;
* collectives one rank makes and another does not (two ranks are rehearsed and their records compared);

and prints every collective by group, op, dtype and bytes beside the analytical volume (``volumes``), and
the rank's traced peak memory beside the planner's (``memory``).

The command line reaches it through injection: ``cli`` hands ``commands.plan_rehearsal`` to ``goat-dist
plan --rehearse`` and ``commands.doctor_check`` to ``goat-dist doctor``, both of which sit on lower floors.

May import: torch, megatron-core, ``goat_dist.config``, ``goat_dist.collectives``, ``goat_dist.distributed``,
``goat_dist.kernels`` (the stand-ins), ``goat_dist.engine`` (only ``engine.sizes``: the buckets and stage
rules the engine is built with), ``goat_dist.model``, ``goat_dist.optim``, ``goat_dist.parallel``,
``goat_dist.shapes``, ``goat_dist.trainer`` (its step, its control agreement, its config resolution) and
``goat_dist.plan`` (the GPUs, the planner's memory); never DeepSpeed (it does not run on the meta device).
"""

from .run import Rehearsal, rehearse

__all__ = ["Rehearsal", "rehearse"]
