"""What ``goat_dist.engine`` assumes of DeepSpeed, one test per assumption, so that a DeepSpeed upgrade
names the one that broke, and that its facade (``Engine``) does what the trainer and checkpoints rely on.
One process, gloo, a model of three small tensors (no megatron layers): each test builds the engines it
needs in about a second. The contract tests read DeepSpeed's engine (``Engine.deepspeed``) directly: that
is what they check."""

from __future__ import annotations

import pytest
import torch
from harness.multiproc import one_layer_config
from torch import nn

from goat_dist import distributed
from goat_dist.engine import masters, patches, sizes, steps, zero3
from goat_dist.engine.build import HeldGradHooks, build_engine
from goat_dist.engine.facade import Engine
from goat_dist.engine.memory import training_state_bytes

ATTR = "fp32_forward"  # the attribute the fp32 mirror attaches (as GOAT's prior reads it)


class Tiny(nn.Module):
    """A linear layer and a 'prior' that must compute in fp32 (read as GOAT's prior is)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.proj = nn.Linear(8, 8)
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(8, 8, generator=g) * 0.3)
            self.proj.bias.copy_(torch.randn(8, generator=g) * 0.1)
        self.prior = nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x):
        exact = getattr(self.prior, ATTR, None)
        prior = self.prior if exact is None else self.prior + (exact - self.prior).detach()
        return (self.proj(x.to(self.proj.weight.dtype)).float() * prior.float().sum()).pow(2).mean()


def build_facade(stage: int, precision: str = "fp32", fp32: bool = False, held=None, accum: int = 1):
    """(model, ``Engine``); ``held(model)`` may return the ``HeldGradHooks`` the engine's gradient hooks
    go to; ``accum``: micro-batches per step."""
    cfg = one_layer_config(
        f"parallel.zero_stage={stage}", f"train.precision={precision}", "train.grad_clip=1.0"
    )
    model = Tiny()
    groups = [
        {"params": [model.proj.weight, model.proj.bias], "weight_decay": 0.1},
        {"params": [model.prior], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    engine = build_engine(
        model,
        distributed.current_layout(),
        cfg,
        accum,
        optimizer=opt,
        scheduler=sched,
        fp32_params=[model.prior] if fp32 else [],
        fp32_attr=ATTR,
        held_hooks=None if held is None else held(model),
    )
    assert isinstance(engine, Engine)
    return model, engine


def build(stage: int, precision: str = "fp32", fp32: bool = False, held=None, accum: int = 1):
    """(model, DeepSpeed's engine) for the contract tests (``build_facade``'s arguments)."""
    model, engine = build_facade(stage, precision, fp32, held, accum)
    return model, engine.deepspeed


def backward(engine, scale: float = 1.0, seed: int = 1) -> None:
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(seed))
    engine.backward(engine(x) * scale)


def full_values(engine, model) -> dict[str, torch.Tensor]:
    layout = masters.layout_of(engine)
    layout.prepare()
    return {n: layout.full(p)[""].clone() for n, p in model.named_parameters()}


def test_the_cpu_shm_op_we_skip_is_the_one_deepspeed_builds(world1):
    """``patches.skip_shm_build`` marks ``deepspeed_shm_comm`` incompatible; DeepSpeed's comm init then
    builds nothing (else ~20 s of g++ on first init)."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.comm.torch import build_shm_op

    if torch.cuda.is_available():
        pytest.skip("the shm op is built on the CPU accelerator only")
    assert get_accelerator().create_op_builder("ShareMemCommBuilder").NAME == "deepspeed_shm_comm"
    patches.skip_shm_build()
    assert build_shm_op() is None


@pytest.mark.parametrize("stage", [0, 1])
def test_the_bf16_cast_is_the_method_patched_and_keeps_fp32_params(world1, stage):
    """bf16 mode casts parameters in ``DeepSpeedEngine._cast_module_mixed_precision``; while our patch
    wraps it, the fp32 parameters stay fp32 (and their optimizer group takes them)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    original = DeepSpeedEngine._cast_module_mixed_precision
    model, _ = build(stage, "bf16", fp32=False)
    assert model.proj.weight.dtype == model.prior.dtype == torch.bfloat16  # the cast happens there
    model, engine = build(stage, "bf16", fp32=True)
    assert DeepSpeedEngine._cast_module_mixed_precision is original  # the patch is undone
    assert model.proj.weight.dtype == torch.bfloat16 and model.prior.dtype == torch.float32
    assert torch.equal(full_values(engine, model)["prior"], torch.linspace(0.5, 1.5, 3))


def test_zero3_bf16_has_one_dtype_so_the_fp32_values_are_mirrored(world1):
    """ZeRO-3 puts every partition in one buffer of one dtype: the 'fp32' parameter is bf16 there, and the
    mirror attaches its fp32 master (``_get_fp32_opt_state_partition``) before each forward."""
    from deepspeed.utils import safe_get_full_fp32_param

    model, engine = build(3, "bf16", fp32=True)
    assert model.prior.dtype == torch.bfloat16  # if this fails, ZeRO-3 could keep fp32 (PRIOR_FP32_STAGES)
    mirror = engine.module.sync_prior_masters.__self__
    assert torch.equal(getattr(model.prior, ATTR), safe_get_full_fp32_param(model.prior))
    backward(engine)
    engine.step()
    before = getattr(model.prior, ATTR).clone()
    backward(engine)  # the forward after a step gathers the new masters
    assert mirror.gathers == 3 and not torch.equal(getattr(model.prior, ATTR), before)
    assert torch.equal(getattr(model.prior, ATTR), safe_get_full_fp32_param(model.prior))
    assert getattr(model.prior, ATTR).dtype == torch.float32


def _grad_norm(model) -> float:
    return float(torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in model.parameters()])))


def test_the_global_grad_norm_is_recorded_without_zero_and_equal_across_stages(world1):
    """fp32 ZeRO-0 clips through ``engine.clip_fp32_gradients`` and drops the norm; ours keeps it in
    ``engine._global_grad_norm``, which ``get_global_grad_norm`` returns, as ZeRO-1 does by itself."""
    model, engine = build(0)
    assert "clip_fp32_gradients" in vars(engine)  # our closure shadows the engine's method
    backward(engine)
    expected = _grad_norm(model)
    engine.step()
    assert engine.get_global_grad_norm() == engine._global_grad_norm
    assert steps.global_grad_norm(engine) == pytest.approx(expected, rel=1e-5)
    _, zero1 = build(1)
    backward(zero1)
    zero1.step()
    assert steps.global_grad_norm(zero1) == pytest.approx(expected, rel=1e-5)


def test_bf16_zero0_init_step_is_undone(world1):
    """FP16_UnfusedOptimizer steps Adam while it is built; afterwards its masters are the weights again
    and Adam's state is empty, as at every other stage."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    model, engine = build(0, "bf16", fp32=True)
    opt = engine.optimizer
    assert type(opt) is FP16_UnfusedOptimizer and hasattr(opt, "initialize_optimizer_states")
    assert len(opt.optimizer.state) == 0
    for weights, fp32 in zip(opt.fp16_groups, opt.fp32_groups, strict=True):
        for p, master in zip(weights, fp32, strict=True):
            assert master.dtype == torch.float32 and torch.equal(master, p.data.float())


def test_the_model_parallel_attribute_is_what_deepspeeds_norm_reads(world1):
    """``patches.mark_tp_gradients`` tags gradients with megatron's ``tensor_model_parallel``, the
    attribute DeepSpeed's ``is_model_parallel_parameter`` asks for."""
    from deepspeed.runtime.utils import is_model_parallel_parameter

    p = nn.Parameter(torch.ones(2))
    p.tensor_model_parallel = True
    assert patches.mark_tp_gradients(nn.ParameterList([p])) == 1
    p.sum().backward()
    assert is_model_parallel_parameter(p.grad) and not is_model_parallel_parameter(torch.ones(1))


# "bf16+sums": bf16 with two micro-batches a step, summed in fp32 (BF16_Optimizer at ZeRO-0/1)
LAYOUTS = [
    (0, "fp32", masters.PlainAdam, ()),
    (0, "bf16", masters.UnfusedMasters, ("fp16_groups", "fp32_groups")),
    (0, "bf16+sums", masters.BF16Masters, ("fp32_groups_flat_partition", "update_lp_params")),
    (1, "fp32", masters.Zero12, ("single_partition_of_fp32_groups", "_lazy_init_hp_params_optimizer_state")),
    (
        1,
        "bf16+sums",
        masters.BF16Masters,
        ("fp32_groups_flat_partition", "_lazy_init_hp_params_optimizer_state"),
    ),
    (2, "bf16", masters.Zero12, ("single_partition_of_fp32_groups", "update_lp_params")),
    (3, "fp32", masters.Zero3, ("fp32_partitioned_groups_flat", "_get_fp32_opt_state_partition")),
]


def build_and_step(stage: int, precision: str, fp32: bool = False, scale: float = 1.0):
    """(model, engine) after one optimizer step (its last backward scaled by ``scale``, and the step left
    to the caller when ``scale`` is not 1); "bf16+sums" takes two micro-batches."""
    accum = 2 if precision == "bf16+sums" else 1
    model, engine = build(stage, precision.removesuffix("+sums"), fp32=fp32, accum=accum)
    for micro in range(accum):
        backward(engine, scale=scale if micro == accum - 1 else 1.0, seed=micro + 1)
        if micro < accum - 1 or scale == 1.0:
            engine.step()
    return model, engine


@pytest.mark.parametrize(
    "stage,precision,kind,attrs", LAYOUTS, ids=[f"{p}-zero{s}" for s, p, _, _ in LAYOUTS]
)
def test_master_layout_reads_and_writes_where_deepspeed_keeps_them(world1, stage, precision, kind, attrs):
    """Per stage x precision: the optimizer class ``layout_of`` maps, the attributes it reads, and a write
    through ``owned`` + ``finish_load`` that reads back through ``full`` and reaches the forward weights."""
    model, engine = build_and_step(stage, precision, fp32=True)
    layout = masters.layout_of(engine)
    assert type(layout) is kind and all(hasattr(engine.optimizer, a) for a in attrs)
    layout.prepare()
    for name, p in model.named_parameters():
        whole = layout.full(p)
        shape = zero3.full_shape(p)
        assert list(whole[""].shape) == shape and whole[""].dtype == torch.float32, name
        assert float(whole["exp_avg_sq"].abs().sum()) > 0, name  # the moments of the step just taken
        owned = layout.owned(p)
        assert sum(o.numel for o in owned) == whole[""].numel(), name  # one rank holds all of it
        if stage in (1, 2) or kind is masters.BF16Masters:
            assert p._hp_mapping.lp_fragment_address.numel == p.numel()
        value = torch.arange(whole[""].numel(), dtype=torch.float32) / 64
        with torch.no_grad():  # as universal.load writes them
            for o in owned:
                piece = value[o.start : o.start + o.numel]
                o.dest[""].copy_(piece)
                if "lp" in o.dest:  # ZeRO-3: the forward weights' partition
                    o.dest["lp"].copy_(piece)
    layout.finish_load(7)
    assert layout.adam_step() == 7
    for name, p in model.named_parameters():
        value = torch.arange(p.ds_numel if zero3.is_partitioned(p) else p.numel(), dtype=torch.float32) / 64
        assert torch.equal(layout.full(p)[""].reshape(-1), value), name
        with zero3.gathered(model):
            assert torch.equal(p.detach().float().reshape(-1), value.to(p.dtype).float()), name


def test_zero3_partition_is_a_padded_flat_ds_tensor(world1):
    """ZeRO-3: ``ds_tensor`` is this rank's flat partition, ``ds_numel`` its real elements, ``ds_shape``
    the parameter's shape; outside ``gathered`` the parameter itself holds no data."""
    model, _ = build(3)
    for p, shape in zip(model.parameters(), [[3], [8, 8], [8]], strict=True):  # own parameters first
        assert zero3.is_partitioned(p) and zero3.full_shape(p) == shape
        assert p.ds_tensor.dim() == 1 and p.ds_tensor.numel() >= p.ds_numel
        assert zero3.partition_span(p) == (0, p.ds_numel)
        assert zero3.partition_values(p).numel() == p.ds_numel
    with zero3.gathered(model):
        assert list(model.proj.weight.shape) == [8, 8]


DROPS = [(0, "fp32"), (0, "bf16"), (0, "bf16+sums"), (1, "bf16+sums"), (2, "fp32"), (3, "fp32")]


@pytest.mark.parametrize("stage,precision", DROPS, ids=[f"{p}-zero{s}" for s, p in DROPS])
def test_a_dropped_step_changes_nothing_and_restores_the_optimizer(world1, stage, precision):
    """NaN gradients are seen where DeepSpeed keeps this rank's reduced gradients; ``update_dropped``
    sends the step through DeepSpeed's overflow path (no update, no LR step, ``skipped_steps`` + 1) and
    then removes its shadowing attributes, so the next step updates as usual."""
    accum = 2 if precision == "bf16+sums" else 1
    model, engine = build(stage, precision.removesuffix("+sums"), accum=accum)
    opt = engine.optimizer
    before, own = full_values(engine, model), dict(vars(opt))
    shadowing = ("step", "check_overflow", "_overflow_check_and_loss_scale_update", "overflow")
    for micro in range(accum):  # the NaN in the first micro-batch: it must survive the fp32 sum
        backward(engine, scale=float("nan") if micro == 0 else 1.0, seed=micro + 1)
        if micro < accum - 1:
            engine.step()
    assert float(steps.local_grads_nonfinite(engine)) == 1.0
    with steps.update_dropped(engine):
        engine.step()
    assert [k for k in shadowing if (k in vars(opt)) != (k in own)] == []  # the class's methods again
    assert all(vars(opt)[k] is own[k] for k in shadowing if k in own and callable(own[k]))  # LR wrapper
    assert getattr(opt, "check_grad_overflow", None) == own.get("check_grad_overflow")
    samples = 2 * accum
    assert steps.step_counters(engine) == {"global_steps": 1, "global_samples": samples, "skipped_steps": 1}
    assert engine.lr_scheduler.last_epoch == 0
    after = full_values(engine, model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    for micro in range(accum):
        backward(engine, seed=micro + 1)
        if micro < accum - 1:
            engine.step()
    assert float(steps.local_grads_nonfinite(engine)) == 0.0
    engine.step()
    assert engine.lr_scheduler.last_epoch == 1 and steps.step_counters(engine)["skipped_steps"] == 1
    updated = full_values(engine, model)
    assert all(not torch.equal(after[n], updated[n]) for n in after)


def test_the_first_nonfinite_gradient_is_named_from_deepspeeds_full_grad(world1):
    model, engine = build(0)
    backward(engine)
    assert steps.first_nonfinite_gradient(engine) is None
    model.prior.grad[0] = float("inf")
    assert steps.first_nonfinite_gradient(engine) == "prior"


def test_deepspeed_hooks_the_gradients_through_post_accumulate_hooks(world1):
    """ZeRO-1/2 reduce a gradient from a hook registered with ``register_post_accumulate_grad_hook``
    while the engine is built; ``HeldGradHooks`` holds exactly those for the TP gradient sum, which runs
    them after its own all-reduce."""
    import torch.distributed as dist

    from goat_dist.parallel.parallelize import TPGradSum

    sums = []

    def held(model):
        sums.append(TPGradSum(list(model.parameters()), dist.group.WORLD))
        return sums[0].held

    _, engine = build(2, held=held)
    assert all(len(hooks) >= 1 for hooks in sums[0].held.hooks)  # DeepSpeed's hook on every parameter
    backward(engine)
    assert sums[0].all_reduces == 1
    assert float(torch.stack([g.abs().sum() for g in engine.optimizer.averaged_gradients[0]]).sum()) > 0
    engine.step()
    assert steps.global_grad_norm(engine) > 0


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_memory_walk_finds_the_optimizers_state(world1, stage):
    """The byte count walks DeepSpeed's optimizer wrapper: after a step it holds (at least) Adam's two
    fp32 moments of every element, plus the fp32 masters at ZeRO-1/3."""
    model, engine = build(stage)
    backward(engine)
    engine.step()
    numel = sum(p.ds_numel if zero3.is_partitioned(p) else p.numel() for p in model.parameters())
    counted = training_state_bytes(engine.module, engine.optimizer)
    assert counted["optimizer"] >= 4 * numel * (2 if stage == 0 else 3)
    assert counted["params"] >= 4 * numel


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_gradients_are_reduced_and_accumulated_in_fp32_at_every_stage(world1, stage):
    """``deepspeed_config``'s ``communication_data_type`` is the engine's reduction dtype at every stage,
    and ``grad_accum_dtype`` fp32 makes the accumulated gradients fp32 where ``steps`` reads them, through
    two micro-batches and a step: ZeRO-2's partition (``averaged_gradients``), ZeRO-3's flat partition,
    and ZeRO-0/1's ``BF16_Optimizer`` buffers (ZeRO-0's masters kept whole on the rank)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    model, engine = build(stage, "bf16", fp32=True, accum=2)
    assert engine.communication_data_type == torch.float32
    backward(engine, seed=1)
    engine.step()  # not a boundary: only counts the micro-batch
    backward(engine, seed=2)
    opt = engine.optimizer
    if stage == 3:
        held = [opt.grad_partitions_flat_buffer]
    elif stage == 2:
        held = [g for gs in opt.averaged_gradients.values() for g in gs]
    else:
        assert type(opt) is BF16_Optimizer
        held = list(opt.fp32_groups_gradients_flat)
        assert masters.layout_of(engine).replicated == (stage == 0)
    assert held and all(g.dtype == torch.float32 for g in held), [g.dtype for g in held]
    assert float(steps.local_grads_nonfinite(engine)) == 0.0
    engine.step()
    assert steps.step_counters(engine)["global_steps"] == 1 and steps.global_grad_norm(engine) > 0
    masters.layout_of(engine)  # the optimizer class is one whose masters we read


def test_bf16_accumulation_when_chosen_keeps_deepspeeds_optimizers(world1):
    """``parallel.grad_accum_dtype=bf16``: ZeRO-0 and ZeRO-1 keep the optimizers that sum micro-batches in
    the bf16 ``.grad`` (FP16_UnfusedOptimizer, DeepSpeedZeroOptimizer)."""
    for stage, kind in ((0, "FP16_UnfusedOptimizer"), (1, "DeepSpeedZeroOptimizer")):
        cfg = one_layer_config(
            f"parallel.zero_stage={stage}", "train.precision=bf16", "parallel.grad_accum_dtype=bf16"
        )
        model = Tiny()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        engine = build_engine(model, distributed.current_layout(), cfg, 2, optimizer=opt, scheduler=sched)
        assert type(engine.deepspeed.optimizer).__name__ == kind


def test_deepspeed_refuses_fp32_accumulation_at_zero0_unless_patched(world1):
    """Why ``patches.bf16_optimizer_without_zero`` exists: bf16 weights with fp32 accumulation raise
    without ZeRO; with the patch the engine builds ``BF16_Optimizer`` over a group of the rank alone. If
    DeepSpeed stops refusing, the patch may go."""
    import deepspeed
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    from goat_dist.engine.build import MegatronMPU, deepspeed_config

    def engine():
        cfg = one_layer_config("parallel.zero_stage=0", "train.precision=bf16")
        config = {**deepspeed_config(cfg, 2), "data_types": {"grad_accum_dtype": "fp32"}}
        model = Tiny()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return deepspeed.initialize(
            model=model,
            optimizer=opt,
            config=config,
            mpu=MegatronMPU(distributed.current_layout()),
            dist_init_required=False,
        )[0]

    with pytest.raises(NotImplementedError, match="unsupported mix"):
        engine()
    with patches.bf16_optimizer_without_zero(True):
        patched = engine()
    assert type(patched.optimizer) is BF16_Optimizer and patched.optimizer.partition_count == [1]


def test_the_sizes_the_planner_counts_are_deepspeeds():
    """``sizes`` is what the config sets and the planner counts: ZeRO-0's all-reduce bucket is DeepSpeed's
    fixed size, and ``deepspeed_config``'s buckets and thresholds are ``sizes``' functions of the model."""
    from deepspeed.runtime.engine import MEMORY_OPT_ALLREDUCE_SIZE

    from goat_dist.engine.build import deepspeed_config

    assert sizes.ZERO0_ALLREDUCE_ELEMENTS == MEMORY_OPT_ALLREDUCE_SIZE
    cfg = one_layer_config("parallel.zero_stage=3")
    zero = deepspeed_config(cfg, 1)["zero_optimization"]
    h = cfg.model.hidden_size
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == sizes.bucket_elements(h)
    assert zero["stage3_prefetch_bucket_size"] == sizes.prefetch_elements(h)
    assert zero["stage3_param_persistence_threshold"] == sizes.persistence_threshold(h)
    assert patches.PRIOR_FP32_STAGES is sizes.PRIOR_FP32_STAGES


def test_held_hooks_run_when_their_owner_says_and_can_be_removed():
    p = nn.Parameter(torch.ones(2))
    held, calls = HeldGradHooks([p]), []
    with held.capturing():
        kept = p.register_post_accumulate_grad_hook(lambda q: calls.append("kept"))
        gone = p.register_post_accumulate_grad_hook(lambda q: calls.append("gone"))
    gone.remove()
    assert "register_post_accumulate_grad_hook" not in vars(p)  # torch's own method again
    p.sum().backward()
    assert calls == []  # held: torch never saw them
    held.run(0)
    assert calls == ["kept"] and kept is not None


@pytest.mark.parametrize("stage", [0, 2])
def test_the_facade_steps_as_deepspeeds_own_calls(world1, stage):
    """Two micro-batches through ``Engine.backward(last=False)`` / ``backward`` / ``step`` give the
    masters, counters, norm and LR of DeepSpeed's own backward/step per micro-batch; ``step(drop=True)``
    changes nothing (the next step trains); the facade's other reads answer as DeepSpeed does."""
    _, ours = build_facade(stage, accum=2)
    _, theirs = build(stage, accum=2)
    for _ in range(2):
        ours.backward(_loss(ours, seed=1), last=False)
        ours.backward(_loss(ours, seed=2))
        assert float(ours.grads_nonfinite()) == 0.0
        ours.step()
        for seed in (1, 2):
            backward(theirs, seed=seed)
            theirs.step()
    model = ours.module
    assert ours.step_counters() == steps.step_counters(theirs)
    assert ours.grad_norm() == steps.global_grad_norm(theirs) > 0
    assert ours.lr == theirs.get_lr()[0] and ours.scheduler is ours.deepspeed.lr_scheduler
    expected, got = full_values(theirs, theirs.module), full_values(ours, model)
    assert all(torch.equal(expected[n], got[n]) for n in expected)
    ours.backward(_loss(ours, seed=1) * float("nan"), last=False)
    ours.backward(_loss(ours, seed=2))
    assert float(ours.grads_nonfinite()) == 1.0 and ours.first_nonfinite_gradient() is not None
    ours.step(drop=True)
    assert ours.step_counters()["skipped_steps"] == 1
    assert all(torch.equal(got[n], v) for n, v in full_values(ours, model).items())
    assert ours.param_group_names() == [None, None]  # this test's groups have no names
    assert ours.state_bytes()["total"] == training_state_bytes(model, ours.deepspeed.optimizer)["total"]
    with ours.evaluating():
        assert not model.training
    assert model.training


@pytest.mark.parametrize("stage", [0, 2])
def test_a_changed_accumulation_steps_once_at_each_steps_last_micro_batch(world1, stage):
    """A batch ramp-up: a step of 1 micro-batch, then steps of 2. DeepSpeed counts micro-batches modulo
    the accumulation for its boundary; after 1 micro-batch, the next step's first of 2 would take the
    optimizer step (and every later step be split across two)."""
    _, engine = build_facade(stage, accum=2)
    engine.set_micro_batches(1)
    engine.backward(_loss(engine, seed=1))
    engine.step()
    assert engine.step_counters()["global_steps"] == 1
    engine.set_micro_batches(2)
    for step in (2, 3):
        engine.backward(_loss(engine, seed=1), last=False)
        assert engine.step_counters()["global_steps"] == step - 1, "an optimizer step after 1 of 2"
        engine.backward(_loss(engine, seed=2))
        engine.step()
        assert engine.step_counters()["global_steps"] == step


def _loss(engine, seed: int) -> torch.Tensor:
    return engine(torch.randn(2, 8, generator=torch.Generator().manual_seed(seed)))
