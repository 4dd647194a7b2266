"""torchrun worker (2 processes) for tests/integration/plan/test_plan_validation.py: what real DeepSpeed
engines hold.

    plan_memory.py '{"dp": {name: [override, ...]}, "cp": {name: [...]}}'

The ``dp`` cases run on DP=2, then the world is rebuilt as CP=2 (DP=1) for the ``cp`` cases. Each case
builds its engine, takes one full step (so that the optimizer state exists), then runs the micro-batches
of a second step one by one, as the trainer does, and measures:

* ``mid_state``: the most state bytes (``engine.memory.training_state_bytes``) seen during the
  accumulation, right after the backward of each non-final micro-batch and, where DeepSpeed runs its
  gradient-partition epilogue inside that backward (ZeRO 2-3), on entering it: there ZeRO-2's freshly
  reduced partition sits next to the accumulated one and the reduce bucket, and ZeRO-3 still holds the
  last parameter (the embedding) gathered, with its whole gradient;
* ``boundary_state``: the state right after the last micro-batch's backward (gradients reduced);
* ``activations``: the unique storages saved for backward during the first micro-batch's forward
  (``torch.autograd.graph.saved_tensors_hooks``), parameters and their storages excluded, and
  ``whole_rows``: those of them that span the whole row (see ``saved_storages``).

Rank 0 prints ``MEASURED <json>``: one dict per rank, case name -> the figures above.
"""

import contextlib
import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from goat_dist import distributed  # noqa: E402


def saved_storages(model, whole_row: int):
    """A saved-tensor pack hook recording each storage saved for backward once (bytes by storage), not
    counting parameters or views of their storage (weights, whole or ZeRO-3-gathered, are not activations).
    The third value: the storages of saved tensors of 3+ dimensions spanning ``whole_row`` tokens (under
    CP: the all-gathered K and V of the whole rows; the cases choose a length no other dimension has;
    0: none)."""
    saved: dict[tuple[int, int], int] = {}
    rows: dict[tuple[int, int], int] = {}

    def pack(t):
        if isinstance(t, nn.Parameter) or t.device.type == "meta":
            return t
        storage = t.untyped_storage()
        weights = {p.untyped_storage().data_ptr() for p in model.parameters() if p.device.type != "meta"}
        if storage.data_ptr() not in weights:
            key = (storage.data_ptr(), storage.nbytes())
            saved[key] = storage.nbytes()
            if whole_row and t.dim() >= 3 and whole_row in t.shape[1:]:
                rows[key] = storage.nbytes()
        return t

    return pack, saved, rows


def watch_epilogue(engine, seen: list, active: list) -> None:
    """Measure the state on entering DeepSpeed's gradient-partition epilogue while ``active`` is set: the
    moment a ZeRO-2 rank holds the accumulated partition, this micro-batch's and the bucket at once, and a
    ZeRO-3 rank the last parameter gathered whole with its unreduced gradient."""
    from goat_dist.engine.memory import training_state_bytes

    opt = engine.deepspeed.optimizer
    original = getattr(opt, "independent_gradient_partition_epilogue", None)
    if original is None:
        return

    def measured(*args, **kwargs):
        if active:
            seen.append(training_state_bytes(engine.module, opt)["total"])
        return original(*args, **kwargs)

    opt.independent_gradient_partition_epilogue = measured


def measure_case(overrides: list[str], layout) -> dict:
    from goat_dist.config import load_config
    from goat_dist.model import GPT
    from goat_dist.parallel.parallelize import parallelize
    from goat_dist.trainer.trainer import autocast_context, gradient_accumulation

    cfg = load_config(None, overrides)
    torch.manual_seed(0)
    model = GPT(cfg.model, layout)  # parallelize applies train.activation_checkpointing
    accum = gradient_accumulation(cfg, layout.dp)
    engine = parallelize(model, cfg, accum)
    autocast = autocast_context(cfg, layout.device)
    b, s = cfg.train.micro_batch_size, cfg.model.seq_len
    tokens = torch.randint(0, cfg.model.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(1))
    batch = (tokens[:, :-1], torch.arange(s).expand(b, -1), tokens[:, 1:])  # whole rows; CP splits them
    for _ in range(accum):  # one full step: the optimizer state exists from here on
        with autocast():
            loss = engine(*batch)
        engine.backward(loss)
        engine.step()
    mid, in_epilogue, active = [], [], []
    watch_epilogue(engine, in_epilogue, active)
    pack, saved, rows = saved_storages(engine.module, s if layout.cp > 1 else 0)
    for micro in range(accum):
        final = micro == accum - 1
        active[:] = [] if final else [True]
        recording = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        with autocast(), recording if micro == 0 else contextlib.nullcontext():
            loss = engine(*batch)
        engine.backward(loss)
        state = engine.state_bytes()
        if final:
            boundary = state
        else:
            mid.append(state["total"])
        engine.step()
    del engine, model
    return {"mid_state": max(mid + in_epilogue), "epilogue_peak": max(in_epilogue, default=0),
            "boundary_state": boundary["total"], "boundary_grads": boundary["grads"],
            "activations": sum(saved.values()), "whole_rows": sum(rows.values()), "accum": accum}  # fmt: skip


def relayout(cp: int):
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    return distributed.init(tp=1, cp=cp)


def main(jobs: dict) -> None:
    results = {}
    for phase, cp in (("dp", 1), ("cp", 2)):
        if not jobs.get(phase):
            continue
        layout = relayout(cp)
        for name, overrides in jobs[phase].items():
            results[name] = measure_case(overrides, layout)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        print("MEASURED " + json.dumps(gathered), flush=True)
    distributed.exit_process(0)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
