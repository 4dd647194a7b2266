"""Compile FlashAttention-4's real kernels on CPU for every call the project makes to them.

FA4 (``flash_attn/cute/interface.py``, 4.0.0b36) documents CPU-only compilation: ``FLASH_ATTENTION_ARCH``
picks the kernel family, ``CUTE_DSL_ARCH`` the target, ``FLASH_ATTENTION_NUM_SMS`` the SKU, and under
torch's fake-tensor mode ``_flash_attn_fwd`` / ``_flash_attn_bwd`` build and compile the kernels without
running them. The compile runs the kernels' own shape, dtype and layout checks (the backward's GQA
asserts among them), which no stand-in can promise to mirror.

What is compiled is what the project hands FA4: each case below runs the project's own attention code
(``ParallelSelfAttention._attend`` / ``_attend_cp``, ``GoatSelfAttention``, ``from_reference``, the
attention diagnostics) on real CPU bf16 tensors of the run's shapes, with ``flash_imports._flash_attn_cute``
pointed at ``CompilingInterface``: every ``flash_attn_func`` / ``flash_attn_varlen_func`` call is
replayed on fake CUDA tensors of the same shapes and strides through ``_flash_attn_fwd`` and, when the
inputs require grad (training), ``_flash_attn_bwd`` with the arguments FA4's autograd functions pass.
The cases come from ``configs/**/*.yaml`` (a study config's runs included) and the library API at
those configs' head dims and GQA ratios, so a new config is covered without editing this file.

The same process also holds the stand-in (``goat_dist/kernels/flash4_standin.py``) to the real interface's
argument checks (``fa4_interface.argument_rules``): calls that each break one rule (cu_seqlens dtype,
contiguity and length, dtypes, head counts, shapes, head dims) must be refused by both. Those checks run
before any kernel is built, so they cost no compile time.

    python tests/harness/fa4_compile.py --arch sm_90 --out result.json     # needs flash-attn-4 and triton

Each process compiles for one architecture (the choice is read from the environment once); identical
kernels are compiled once per process (FA4's own cache), and across runs when
``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1`` with ``FLASH_ATTENTION_CUTE_DSL_CACHE_DIR``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
if __name__ == "__main__":  # run as a script: tests/ on the path (for harness.*) in place of tests/harness/
    sys.path[:] = [str(TESTS), *(p for p in sys.path if Path(p or ".").resolve() != TESTS / "harness")]
from harness.fa4_interface import CompilingInterface, _first_line, argument_rules  # noqa: E402

ROOT = TESTS.parent
ARCHS = {"sm_90": ("sm_90a", 132), "sm_100": ("sm_100a", 148)}  # CUTE_DSL_ARCH, SMs (H100/H200, B200)
PACKAGES = ("flash-attn-4", "nvidia-cutlass-dsl", "quack-kernels", "triton")


def arch_env(arch: str) -> dict[str, str]:
    """The environment FA4 reads to compile for ``arch`` without a GPU."""
    target, sms = ARCHS[arch]
    return {"FLASH_ATTENTION_ARCH": arch, "CUTE_DSL_ARCH": target, "FLASH_ATTENTION_NUM_SMS": str(sms)}


def versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


# ---- the cases: configs and the library API --------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What one rank's attention layer sees for a config: local heads, head dim, batch, lengths."""

    source: str
    position: str
    heads: int  # local (per TP rank)
    kv_heads: int
    head_dim: int
    batch: int
    seq_len: int
    cp: int
    documents: bool
    goat: tuple  # (pos_rank, abs_rank, key_bias, train_len)


def config_files(root: Path = ROOT) -> list[Path]:
    return sorted((root / "configs").rglob("*.yaml"))


def load_shapes(path: Path) -> list[ModelShape]:
    """The model shapes of a training config, or of each run of a study config."""
    import yaml

    from goat_dist.config import load_config

    spec = yaml.safe_load(path.read_text()) or {}
    if isinstance(spec.get("runs"), dict):  # a study: its training config under each run's overrides
        from goat_dist.evaluation.study.spec import load_study

        study = load_study(path)
        return [
            _shape(f"{path.name}:{name}", load_config(study["train_config"], [*study["overrides"], *runs]))
            for name, runs in study["runs"].items()
        ]
    return [_shape(path.name, load_config(path))]


def _shape(source: str, cfg) -> ModelShape:
    m, tp = cfg.model, cfg.parallel.tp
    kv = m.num_kv_heads or m.num_heads
    g = m.goat
    return ModelShape(
        source=source,
        position=m.position,
        heads=m.num_heads // tp,
        kv_heads=kv // tp,
        head_dim=m.hidden_size // m.num_heads,
        batch=cfg.train.micro_batch_size,
        seq_len=m.seq_len,
        cp=cfg.parallel.cp,
        documents=cfg.data.document_masking,
        goat=(g.pos_rank, g.abs_rank, g.key_bias, g.train_len or m.seq_len),
    )


def _document_positions(batch: int, length: int, documents: bool):
    """(B, L) positions: one document per row, or documents restarting at an eighth, 3/8 and 5/8 of it."""
    import torch

    row = torch.arange(length)
    if documents:
        cuts = [length // 8, 3 * length // 8, 5 * length // 8]
        row = torch.cat([torch.arange(b - a) for a, b in zip([0, *cuts], [*cuts, length])])
    return row.expand(batch, length).contiguous()


def _layer(shape: ModelShape):
    """The model's attention layer for one TP rank of ``shape`` (built at TP = 1 with the local heads)."""
    import torch
    from megatron.core.model_parallel_config import ModelParallelConfig

    from goat_dist import distributed
    from goat_dist.config import GoatConfig, ModelConfig
    from goat_dist.model.attention import ParallelSelfAttention

    R, M, key_bias, train_len = shape.goat
    cfg = ModelConfig(
        seq_len=shape.seq_len,
        num_layers=1,
        hidden_size=shape.heads * shape.head_dim,
        num_heads=shape.heads,
        num_kv_heads=shape.kv_heads,
        position=shape.position,
        attention_backend="sdpa",
        goat=GoatConfig(pos_rank=R, abs_rank=M, key_bias=key_bias, train_len=train_len),
    )
    mp = ModelParallelConfig(tensor_model_parallel_size=1, use_cpu_initialization=True,
                             perform_initialization=False, params_dtype=torch.bfloat16)  # fmt: skip
    tp_group = distributed.current_layout().tp_group
    attn = ParallelSelfAttention(cfg, mp, lambda w: None, lambda w: None, tp_group)
    attn.backend = "flash4"
    return attn


def _mixed(attn, batch: int, length: int, grad: bool):
    """The fused projection's output as ``forward`` splits it: [s, b, width] viewed batch-first."""
    import torch

    width = attn.qkv.weight.shape[0]
    mixed = torch.randn(length, batch, width, dtype=torch.bfloat16).transpose(0, 1)
    return mixed.requires_grad_(grad) if grad else mixed


def _split(attn, mixed):
    from goat_dist.goat import split_grouped_qkv

    return split_grouped_qkv(mixed, attn.local_kv_heads, attn.group, attn.content_dim, attn.head_dim)


def run_model(shape: ModelShape, iface: CompilingInterface) -> list[str]:
    """Training calls of one config's attention: dense rows, packed documents (whether or not the config
    turns ``data.document_masking`` on), CP chunks with and without documents (the varlen calls with
    separate query / key lengths); and the attention diagnostics' forward-only calls.
    Returns notes for paths that do not reach FA4."""
    import torch

    from goat_dist.goat.exact import sequence_origin
    from goat_dist.kernels import FLASH4_ALIBI_ERROR, document_segments
    from goat_dist.parallel import context
    from goat_dist.parallel.context import make_shard

    if shape.position == "alibi":
        return [f"{shape.source}: {FLASH4_ALIBI_ERROR.split(':')[0]} (a clear error, nothing compiled)"]
    attn = _layer(shape)
    L = shape.seq_len
    for documents in (False, True):  # data.document_masking is a data option any config can turn on
        iface.case = f"{shape.source} train{' documents' if documents else ''}" + (
            f" cp={shape.cp}" if shape.cp > 1 else ""
        )
        positions = _document_positions(shape.batch, L, documents)
        if shape.cp > 1:
            # rank 0 holds chunks 0 and 2·cp-1: one against its own keys, one against a long prefix;
            # under documents the varlen calls take each document's keys up to the chunk end
            shard = make_shard(positions, shape.cp, rank=0)
            q, k, v = _split(attn, shard.split(_mixed(attn, shape.batch, L, grad=True)))
            whole_rows = lambda x, shard: torch.cat([x] * shard.cp, dim=1)  # gather: contiguous rows
            saved, context.gather_sequence = context.gather_sequence, whole_rows
            try:
                attn._attend_cp(q, k, v, shard.split(positions), shard)
            finally:
                context.gather_sequence = saved
            continue
        q, k, v = _split(attn, _mixed(attn, shape.batch, L, grad=True))
        attn._attend(q, k, v, positions, document_segments(positions), sequence_origin(positions))
    iface.case = f"{shape.source} diagnostics"
    from goat_dist.observe.attention_stats import attention_probabilities

    q, k, _ = _split(attn, _mixed(attn, 1, L, grad=False))
    positions = _document_positions(1, L, False)
    next(attention_probabilities(attn, q, k, positions))
    return []


def library_modules(shapes: list[ModelShape]):
    """``(name, build)`` of the library API at the configs' GOAT head dims, lanes and GQA ratios:
    ``GoatSelfAttention`` by default and with ``content_dim=head_dim`` (all content dims plus the lanes),
    and ``from_reference`` of the authors' module (content dims ``D - 2R - 1``). The kernel shapes depend
    on (D, R, key bias, ratio) only; ``abs_rank`` is the largest the configs pair with them."""
    from goat_dist.goat import GoatSelfAttention

    ratios = sorted({s.heads // s.kv_heads for s in shapes})
    abs_rank: dict[tuple, int] = {}
    for s in shapes:
        if s.position == "goat":
            key = (s.head_dim, s.goat[0], s.goat[2])
            abs_rank[key] = max(abs_rank.get(key, 0), s.goat[1])
    for (D, R, key_bias), M in sorted(abs_rank.items()):
        for ratio in ratios:
            heads, kv = ratio, 1
            common = dict(pos_rank=R, abs_rank=M, key_bias=key_bias, backend="sdpa")
            tag = f"D={D} R={R} key_bias={key_bias} gqa={ratio}"
            yield f"GoatSelfAttention {tag}", partial(GoatSelfAttention, heads * D, heads, kv, **common)
            yield (
                f"GoatSelfAttention content_dim={D} {tag}",
                partial(GoatSelfAttention, heads * D, heads, kv, content_dim=D, **common),
            )
            yield f"from_reference {tag}", partial(_converted, heads * D, heads, kv, R, M, key_bias)


def _converted(*dims):
    from goat_dist.goat import from_reference

    return from_reference(_reference(*dims), backend="sdpa")


def _reference(embed, heads, kv, R, M, key_bias):
    import goat  # goat-attention, from the test extra

    return goat.GoatAttention(embed_dim=embed, num_heads=heads, kv_num_heads=kv, pos_rank=R, abs_rank=M,
                              enable_key_bias=key_bias, training_seq_len=2048, batch_first=True)  # fmt: skip


def run_module(name: str, module, iface: CompilingInterface, batch: int = 2, length: int = 2048) -> list[str]:
    """A module's forward, causal and not, with inputs that require grad (training)."""
    import torch

    from goat_dist.kernels import backend

    module = module.to(torch.bfloat16)
    module.backend = "flash4"
    notes = []
    for causal in (True, False):
        iface.case = f"{name} causal={causal}"
        x = torch.randn(batch, length, module.embed_dim, dtype=torch.bfloat16, requires_grad=True)
        try:
            module(x, causal=causal)
        except ValueError as exc:  # goat-dist refuses the head dim itself, naming the nearest one
            if "FlashAttention-4" not in str(exc):
                raise
            cap = backend.device_capability()
            notes.append(f"{iface.case}: refused by goat-dist on {cap[0]}.x before the kernel: {exc}")
            break
    return notes


# ---- one architecture ------------------------------------------------------------------------------------
def without_gqa_padding() -> None:
    """Make the project hand FA4 v at its own width under GQA, as it did before it padded v: the check
    must then fail (``test_fa4_compile.py`` shows it does)."""
    from goat_dist.kernels import fa4_dims

    plan = fa4_dims.flash4_head_dims
    fa4_dims.flash4_head_dims = lambda dq, dv, major, gqa=False: plan(dq, dv, major, gqa=False)


def compile_all(arch: str, only: str | None = None) -> dict:
    """Every case for ``arch`` (the FA4 environment must already be set for it), or those whose name
    contains ``only``; the result document."""
    import torch

    from goat_dist import distributed
    from goat_dist.kernels import backend, flash_imports

    distributed.init(tp=1)  # the model's layers are built on its TP group (current_layout)
    torch.manual_seed(0)
    start = time.perf_counter()
    iface = CompilingInterface()
    major = int(arch.split("_")[1]) // 10
    # the machine played: FA4 imports as the compiling interface, the device is of compute capability major.0
    saved = flash_imports._flash_attn_cute, backend.device_capability
    flash_imports._flash_attn_cute = lambda: iface
    backend.device_capability = lambda device=None: (major, 0)
    notes, shapes, errors = [], [], []
    try:
        for path in config_files():
            try:
                shapes += load_shapes(path)
            except Exception as exc:  # noqa: BLE001 - a config that does not load is reported
                errors.append(f"{path.name}: {_first_line(exc)}")
        for shape in dict.fromkeys(shapes):
            if only is None or only in shape.source:
                notes += run_model(shape, iface)
        for name, build in library_modules(shapes):
            if only is not None and only not in name:
                continue
            try:
                module = build()
            except ImportError as exc:  # goat-attention (the test extra) absent: no from_reference cases
                notes.append(f"{name}: not built ({_first_line(exc)})")
                continue
            except Exception as exc:  # noqa: BLE001 - the library cannot build it: reported, not compiled
                (notes if name.startswith("from_reference") else errors).append(
                    f"{name}: not built ({_first_line(exc)})"
                )
                continue
            notes += run_module(name, module, iface)
        rules = argument_rules(iface.real, major * 10)  # the stand-in's checks against the real ones
    finally:
        flash_imports._flash_attn_cute, backend.device_capability = saved
    failed = [c for c in iface.calls if not c["ok"]]
    return {
        "arch": arch,
        "versions": versions(),
        "configs": [str(p.relative_to(ROOT)) for p in config_files()],
        "shapes": [dataclasses.asdict(s) for s in dict.fromkeys(shapes)],
        "calls": iface.calls,
        "distinct_calls": len(
            {json.dumps({k: c[k] for k in c if k not in ("case", "fwd_s", "bwd_s")}) for c in iface.calls}
        ),  # fmt: skip
        "failed": failed,
        "argument_rules": rules,
        "errors": errors,
        "notes": notes,
        "seconds": round(time.perf_counter() - start, 1),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", choices=sorted(ARCHS), required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--only", help="the cases whose name contains this (default: all)")
    p.add_argument("--without-gqa-padding", action="store_true", help="undo the fix, to see the check fail")
    args = p.parse_args(argv)
    for key, value in arch_env(args.arch).items():
        if os.environ.get(key) != value:
            print(f"set {key}={value} before starting (FA4 reads it once)", file=sys.stderr)
            return 2
    sys.path.insert(0, str(ROOT))
    if args.without_gqa_padding:
        without_gqa_padding()
    result = compile_all(args.arch, args.only)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    import torch.distributed as dist

    dist.destroy_process_group()
    print(f"{args.arch}: {len(result['calls'])} calls ({result['distinct_calls']} distinct), "
          f"{len(result['failed'])} refused, {result['seconds']} s")  # fmt: skip
    for c in result["failed"]:
        shapes = f"q {c['q']} k {c['k']} v {c['v']}"
        print(f"  REFUSED {c['case']}: {shapes} {c['stage']}: {c['error']} ({c['where']})")
    unequal = [r for r in result["argument_rules"] if not (r["real"] and r["standin"])]
    for r in unequal:
        print(f"  RULE {r['rule']}: real interface {r['real']!r}, stand-in {r['standin']!r}")
    return 0 if not result["failed"] and not result["errors"] and not unequal else 1


if __name__ == "__main__":
    sys.exit(main())
