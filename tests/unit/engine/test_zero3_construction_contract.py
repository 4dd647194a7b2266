"""What building partitioned (``engine/construct.py``) assumes of DeepSpeed, one test each, in one process:
``zero.Init(module=part)`` partitions a built part in place and keeps the dtype it was given, and
``deepspeed.initialize`` takes parameters so partitioned as they are (no second conversion, no cast, fp32
masters equal to the partitions), GOAT's prior computing from its fp32 masters as usual; and
``train.init_from`` and a resume load into such a model."""

from __future__ import annotations

import torch
import yaml
from harness.multiproc import in_process_config, one_layer_config

from goat_dist import distributed
from goat_dist.engine.construct import partition_as_built
from goat_dist.engine.zero3 import full_shape, is_partitioned, partition_values
from goat_dist.model import GPT
from goat_dist.parallel.parallelize import parallelize


def _built(*overrides: str):
    cfg = one_layer_config("parallel.zero_stage=3", *overrides)
    torch.manual_seed(0)
    whole = {n: p.detach().clone() for n, p in GPT(cfg.model).named_parameters()}
    hook = partition_as_built(cfg, grad_accum=1, layout=distributed.current_layout())
    torch.manual_seed(0)
    return cfg, GPT(cfg.model, built=hook), whole, hook


def test_only_zero3_builds_partitioned():
    layout = distributed.Layout(1, 0, 0, 1, 1, 0, 0, torch.device("cpu"))  # sizes only: no groups used
    assert partition_as_built(one_layer_config("parallel.zero_stage=2"), 1, layout) is None
    assert partition_as_built(one_layer_config("parallel.zero_stage=3"), 1, layout) is not None


def test_init_on_a_built_part_partitions_it_in_the_given_dtype(world1):
    cfg, model, whole, hook = _built("train.precision=bf16")
    assert hook.parts == 3  # the embedding (tied to the output), one block, the final norm
    for name, p in model.named_parameters():
        assert is_partitioned(p) and p.numel() == 0, name  # the placeholder holds nothing
        assert p.dtype == p.ds_tensor.dtype == torch.bfloat16, name  # GOAT's prior too, as the engine's cast
        assert list(full_shape(p)) == list(whole[name].shape), name
        assert torch.equal(partition_values(p), whole[name].reshape(-1).to(torch.bfloat16)), name


def test_initialize_takes_the_partitions_as_they_are(world1):
    cfg, model, whole, _ = _built("train.precision=bf16")
    before = {n: (p.ds_id, p.ds_tensor) for n, p in model.named_parameters()}
    engine = parallelize(model, cfg, grad_accum=1)
    opt = engine.deepspeed.optimizer
    for name, p in model.named_parameters():
        ds_id, partition = before[name]
        assert p.ds_id == ds_id, name  # not converted a second time
        assert p.ds_tensor.dtype == torch.bfloat16, name  # not cast again
        assert torch.equal(p.ds_tensor, partition), name
        master = opt._get_fp32_opt_state_partition(p, release_swap_buffers=False)[0]
        assert torch.equal(master.reshape(-1)[: p.ds_numel], partition.float().reshape(-1)[: p.ds_numel])
    # the prior's forward values are its fp32 masters (engine/zero3.py), the model trains
    prior = [p for n, p in model.named_parameters() if ".prior." in n]
    assert prior and all(p.fp32_forward.dtype == torch.float32 for p in prior)
    tokens = torch.randint(0, 300, (2, 33), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = engine(tokens[:, :-1], torch.arange(32).expand(2, -1), tokens[:, 1:])
    engine.backward(loss)
    engine.step()
    assert torch.isfinite(loss)


def test_init_from_and_resume_start_a_model_built_partitioned(world1, builtin_cache, tmp_path):
    """``train.init_from`` and a resume write their weights into a model built partitioned (ZeRO-3)."""
    from goat_dist.checkpoint import universal
    from goat_dist.engine.zero3 import gathered
    from goat_dist.trainer import Trainer

    first = tmp_path / "first"
    Trainer(in_process_config(builtin_cache, first, "train.max_steps=2", "train.warmup_steps=1")).fit()
    step = first / "checkpoints" / "step_00000002"
    saved, _ = universal.read_full(step, ("",))
    second = tmp_path / "second"
    zero3 = ["parallel.zero_stage=3", "train.warmup_steps=1"]
    trainer = Trainer(
        in_process_config(builtin_cache, second, *zero3, "train.max_steps=2", f"train.init_from={step}")
    )
    assert all(is_partitioned(p) for p in trainer.model.parameters())
    with gathered(trainer.model):
        for name, p in trainer.model.named_parameters():
            assert torch.equal(p.detach(), saved[name][""]), name
    trainer.fit()
    resumed = Trainer(in_process_config(builtin_cache, second, *zero3, "train.max_steps=3"))
    assert resumed.state.step == 2 and resumed.resumed_from is not None
    saved, _ = universal.read_full(second / "checkpoints" / "step_00000002", ("",))
    with gathered(resumed.model):
        for name, p in resumed.model.named_parameters():
            assert torch.equal(p.detach(), saved[name][""]), name
    # the resumed run's config.yaml is its resolved config (L_train from the run it started from)
    written = yaml.safe_load((second / "config.yaml").read_text())
    assert written == resumed.cfg.to_dict()
    assert written["model"]["goat"]["train_len"] == resumed.cfg.model.seq_len
