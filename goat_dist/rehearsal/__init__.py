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
"""

from .run import Rehearsal, rehearse

__all__ = ["Rehearsal", "rehearse"]
