"""The training engine: the one package that knows DeepSpeed.

Everything else in goat_dist sees the engine through its facade, ``Engine`` (``facade.py``: forward and
backward of micro-batches, the optimizer step or a dropped one, the gradient norm and learning rate, the
state a checkpoint saves and loads, the bytes of training state, the module for evaluation), through the
functions of the modules below, or through the sizes the planner counts with (``sizes``). Only this
package imports ``deepspeed`` and only its objects hold DeepSpeed's engine (both enforced by
``tests/unit/repo/test_import_floors.py`` and ``tests/unit/repo/test_package_promises.py``); whatever
depends on
DeepSpeed's attributes, optimizer classes or behaviour lives here, so that a DeepSpeed upgrade is checked
here and in ``tests/unit/engine/test_engine_contract.py`` (one test per assumption). The version range
tested is
pinned in pyproject.toml.

* ``facade``: ``Engine``, the engine as the trainer, checkpoints, evaluation and callbacks use it.
* ``build``: the DeepSpeed config, megatron's process groups as DeepSpeed's ``mpu``, ``build_engine``, and
  ``HeldGradHooks`` (the engine's gradient hooks run after a caller's own gradient step: the TP sum).
* ``sizes``: the buffer sizes and per-stage rules that the config sets and the memory planner counts.
* ``construct``: the model built already partitioned under ZeRO-3 (``partition_as_built``).
* ``patches``: each change of DeepSpeed's behaviour (the bf16 cast, ZeRO-0's init step, grad norm and
  fp32 accumulation).
* ``masters``: where each parameter's fp32 master and Adam moments live, per precision x ZeRO stage.
* ``steps``: non-finite gradients, a dropped update, the gradient norm, the engine's step counters.
* ``zero3``: ZeRO-3 partitions (real elements vs padding), gathering, the fp32 forward mirror.
* ``memory``: bytes of parameters, gradients and optimizer state a rank holds.

May import: torch, deepspeed, megatron-core, ``goat_dist.config`` and ``goat_dist.distributed``; never the
trainer, checkpoint or evaluation packages (they build on it). Exports resolve lazily, so importing the
package loads neither DeepSpeed nor megatron.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Engine": "facade",
    "HeldGradHooks": "build",
    "build_engine": "build",
    "deepspeed_config": "build",
    "MegatronMPU": "build",
    "PartitionAsBuilt": "construct",
    "partition_as_built": "construct",
    "PRIOR_FP32_STAGES": "sizes",
    "BF16_OPTIMIZER_STAGES": "sizes",
    "accumulates_fp32": "sizes",
    "uses_bf16_optimizer": "sizes",
    "ZERO0_ALLREDUCE_ELEMENTS": "sizes",
    "KEYS": "masters",
    "MOMENTS": "masters",
    "MasterLayout": "masters",
    "Owned": "masters",
    "layout_of": "masters",
    "local_grads_nonfinite": "steps",
    "first_nonfinite_gradient": "steps",
    "update_dropped": "steps",
    "global_grad_norm": "steps",
    "step_counters": "steps",
    "set_step_counters": "steps",
    "full_shape": "zero3",
    "gathered": "zero3",
    "is_partitioned": "zero3",
    "local_values": "zero3",
    "partition_span": "zero3",
    "partition_values": "zero3",
    "training_state_bytes": "memory",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
