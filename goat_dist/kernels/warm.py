"""``goat-dist kernels warm``: FlashAttention-4's kernels for a config's training, compiled into FA4's disk
cache before the training processes start.

FA4 JIT-compiles each kernel at its first call (seconds to a minute per kernel, forward and backward),
so without a warm cache step 1 of every rank carries the compile of every kernel the run uses.
``slurm/train.sbatch`` runs this command as one task per node after the preflight: it compiles once into
``FLASH_ATTENTION_CUTE_DSL_CACHE_DIR`` (the directory the node's ranks share), and the training step,
which starts when every node's task has ended, loads the kernels from there.

The calls are those of one rank's attention in the config's training (``warm_calls``): per TP rank's
heads and KV heads, the head dim FA4 is handed (GOAT's lanes folded into q/k give the full head width),
micro-batch and sequence length, bf16, causal; forward and backward. Dense rows always; with
``data.document_masking`` also the packed-document (varlen) kernel; under context parallelism a chunk's
queries against their key prefix (and its varlen form under documents). Shapes met only elsewhere (the
attention diagnostics' forward-only calls, another rank's prefix lengths where FA4 picks other tiles)
are compiled by the run that meets them, as without this step.

Where there is nothing to compile the command says why and exits 0: no CUDA, a precision or position
scheme FA4 does not serve, an attention backend that resolves to another kernel on this machine, FA4
not importable, or FA4's disk cache off (a compile would stay in this process).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

PROG = "goat-dist kernels warm"
CACHE_ENABLED = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"
CACHE_DIR = "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"


@dataclass(frozen=True)
class WarmCall:
    """One FA4 call of a training step: q (batch, q_len, heads, head_dim) against k/v (batch, k_len,
    kv_heads, head_dim); ``documents``: through the varlen kernel, as packed documents are."""

    what: str
    batch: int
    q_len: int
    k_len: int
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    documents: bool = False

    def describe(self) -> str:
        lengths = f"L={self.q_len}" if self.q_len == self.k_len else f"Lq={self.q_len} Lk={self.k_len}"
        return f"{self.what}: B={self.batch} {lengths} heads {self.heads}/{self.kv_heads} dim {self.head_dim}"


def warm_calls(cfg) -> list[WarmCall]:
    """The FA4 calls of one rank's training step under ``cfg`` (a ``Config``), one of each kind."""
    from ..shapes import head_dims, resolve_key_bias_lanes

    m, tp, cp = cfg.model, cfg.parallel.tp, cfg.parallel.cp
    resolve_key_bias_lanes(m, cfg.train.precision)  # GOAT's lanes, as the run resolves them
    heads, kv, head_dim, content = head_dims(m)
    common = dict(heads=heads // tp, kv_heads=kv // tp, head_dim=head_dim, scale=content**-0.5)
    B, L = cfg.train.micro_batch_size, m.seq_len
    documents = bool(cfg.data.document_masking)
    if cp == 1:
        calls = [WarmCall("dense", B, L, L, **common)]
        if documents:
            calls.append(WarmCall("documents", B, L, L, documents=True, **common))
        return calls
    c = L // (2 * cp)  # rank 0's chunks: [0, c) against its own keys, the last one against the whole row
    calls = [WarmCall("cp chunk", B, c, c, **common), WarmCall("cp chunk", B, c, L, **common)]
    if documents:
        calls.append(WarmCall("cp chunk documents", B, c, L, documents=True, **common))
    return calls


def skip_reason(cfg, environ, capability=None) -> str | None:
    """Why this machine has no FA4 kernel of ``cfg``'s training to compile, or None. ``capability``: the
    GPU's (major, minor) (default: the current device's; None without CUDA)."""
    from ..precision import resolve_precision
    from . import backend

    if not torch.cuda.is_available():
        return "CUDA is not available: no FlashAttention-4 kernel to compile on this machine"
    if environ.get(CACHE_ENABLED) != "1":
        return (
            f"FA4's disk cache is off ({CACHE_ENABLED}={environ.get(CACHE_ENABLED, '<unset>')}): kernels "
            f"compiled here would stay in this process; set {CACHE_ENABLED}=1 and {CACHE_DIR}"
        )
    m = cfg.model
    precision = resolve_precision(cfg.train.precision, torch.device("cuda"))
    if precision != "bf16":
        return f"train.precision={cfg.train.precision} is {precision} here: FlashAttention-4 is not called"
    cap = backend.device_capability() if capability is None else capability
    head_dim = m.hidden_size // m.num_heads
    try:
        chosen = backend.resolve_backend(
            m.attention_backend, position=m.position, head_dim=head_dim, capability=cap
        )
    except (RuntimeError, ValueError) as e:  # training will refuse it the same way
        return f"model.attention_backend={m.attention_backend} cannot run here: {e}"
    if chosen != "flash4":
        return f"model.attention_backend={m.attention_backend} resolves to {chosen} here, not flash4"
    return None


def run_call(call: WarmCall, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> None:
    """``call``'s forward and backward through the project's own FA4 entry points (``fa4``), which pad
    or slice the head widths as training does."""
    from .fa4 import flash4_attention, flash4_varlen
    from .masks import document_segments

    def rand(length, heads, grad=True):
        x = torch.randn(call.batch, length, heads, call.head_dim, device=device, dtype=dtype)
        return x.requires_grad_(grad)

    q, k, v = rand(call.q_len, call.heads), rand(call.k_len, call.kv_heads), rand(call.k_len, call.kv_heads)
    if not call.documents:
        out = flash4_attention(q, k, v, causal=True, scale=call.scale)
    elif call.q_len == call.k_len:  # documents restarting at a quarter and half of each row
        positions = torch.cat([torch.arange(n) for n in _pieces(call.q_len)]).expand(call.batch, -1)
        segments = document_segments(positions.to(device))
        out = flash4_attention(q, k, v, causal=True, scale=call.scale, segments=segments)
    else:  # each row's chunk against its key prefix, one sequence per row (packed back to back)
        cu_q = torch.arange(call.batch + 1, device=device, dtype=torch.int32) * call.q_len
        cu_k = torch.arange(call.batch + 1, device=device, dtype=torch.int32) * call.k_len
        out = flash4_varlen(
            q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, call.q_len, call.k_len,
            causal=True, scale=call.scale,
        )  # fmt: skip
    out.backward(torch.randn_like(out))
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pieces(length: int) -> list[int]:
    cuts = [0, length // 4, length // 2, length]
    return [b - a for a, b in zip(cuts, cuts[1:]) if b > a]


def warm(cfg, environ=os.environ, out: Callable[[str], None] = print) -> int:
    """Compile ``cfg``'s training kernels on this machine (``skip_reason`` first); exit status 0, or 1
    when a compile fails (the error is printed; training would meet it at its first step)."""
    reason = skip_reason(cfg, environ)
    if reason is not None:
        out(f"{PROG}: skipped: {reason}")
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    where = environ.get(CACHE_DIR, "<FA4's default directory>")
    name = torch.cuda.get_device_name(device)
    calls = warm_calls(cfg)
    out(f"{PROG}: {len(calls)} call(s), forward and backward, on {name} into {where}")
    started = time.perf_counter()
    for call in calls:
        t0 = time.perf_counter()
        try:
            run_call(call, device)
        except Exception as e:  # noqa: BLE001 - named, and the step goes on to training
            out(f"{PROG}: FAILED {call.describe()}: {type(e).__name__}: {e}")
            return 1
        out(f"{PROG}: {call.describe()}: {time.perf_counter() - t0:.1f} s")
    out(f"{PROG}: done in {time.perf_counter() - started:.1f} s")
    return 0


def cmd_warm(args: argparse.Namespace) -> int:
    from ..config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    status = warm(cfg)
    sys.stdout.flush()
    return status


def register(sub) -> None:
    """``goat-dist kernels warm --config FILE [overrides]``."""
    from ..config import add_config_arguments

    p = sub.add_parser("kernels", help="attention kernels: warm (compile FA4's kernels of a config)")
    kernels = p.add_subparsers(dest="kernels_command", required=True)
    w = kernels.add_parser(
        "warm",
        help="compile the config's FlashAttention-4 kernels (forward and backward) into FA4's disk cache "
        "(FLASH_ATTENTION_CUTE_DSL_CACHE_DIR); says why and exits 0 where there is nothing to compile",
        description=__doc__.split("\n\n")[0],
    )
    add_config_arguments(w)
    w.set_defaults(func=cmd_warm)
