"""Training tokens/s of goat-dist against Hugging Face ``LlamaForCausalLM`` of the same shape, on CPU.

One process, fp32, SDPA attention on both sides, the same batch, sequence length and number of steps. Both
models are trained by the same plain ``torch.optim.AdamW`` loop (zero_grad, forward with labels -> mean
loss, backward, step): goat-dist's model is built directly in a single-process world
(``goat_dist.distributed.init(tp=1)``, TP=1 megatron-core layers), without DeepSpeed or the trainer, so the
ratio compares the *models*, not the training engines. Same shape: hidden, layers, heads, SwiGLU FFN width,
RMSNorm, tied embeddings, no biases, vocabulary (a multiple of 128, so goat-dist pads nothing).

goat-dist runs with ``position=rope`` for the like-for-like ratio, and with ``position=goat`` (its GOAT
prior) as a second line. Each runs eager and compiled: HF as ``model.compile(dynamic=False)`` (the whole
model, loss included), goat-dist with ``model.compile=true`` (each transformer block); every model is
compared with HF eager and with HF compiled (the fair comparison for a compiled model). Repeats interleave
the six models, each repeat timing ``--steps`` optimizer steps after warm-up steps (the first of which
compiles), so machine noise hits all alike; medians are reported and a ratio is the median of the
per-repeat paired ratios. Targets: goat-dist (rope) / HF >= 1.10 eager; compiled goat-dist (rope) >= 1.20x
HF eager and >= 1.00x HF compiled. Last line: the eager ratio. ``--profile``: where each model's step time
goes (matmuls, SDPA, compiled graphs, the rest).

    pip install 'goat-dist[bench]'   # transformers
    python bench/vs_hf.py [--hidden 512 --layers 8 --seq 512] [--repeats 5] [--clock process] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

os.environ.setdefault("DS_ACCELERATOR", "cpu")
warnings.filterwarnings("ignore", module="megatron")

import torch  # noqa: E402
from timing import CLOCKS, add_clock_args, apply_threads, seconds_per_call  # noqa: E402

from goat_dist import distributed  # noqa: E402
from goat_dist.config import ModelConfig  # noqa: E402
from goat_dist.model.gpt import GPT, ffn_size  # noqa: E402


def goat_model(args, position: str, compile: bool = False) -> torch.nn.Module:
    cfg = ModelConfig(
        compile=compile,
        vocab_size=args.vocab,
        seq_len=args.seq,
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_heads=args.heads,
        position=position,
        attention_backend="sdpa",
    )
    torch.manual_seed(0)
    return GPT(cfg).train()


def hf_model(args, ffn: int, compile: bool = False) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.seq,
        rms_norm_eps=1e-5,
        rope_theta=10_000.0,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).train()
    if compile:  # the whole model, loss included: the most a user of HF gets from one torch.compile call
        model.compile(dynamic=False)
    return model


def make_step(model, kind: str, tokens: torch.Tensor):
    """One plain AdamW step over ``tokens`` (b, s): the same loop for every model."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95))
    b, s = tokens.shape
    positions = torch.arange(s).expand(b, s)
    labels = torch.roll(tokens, -1, dims=1)  # next token (last wraps: the same count of loss terms)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        if kind == "hf":
            # HF shifts labels itself (s - 1 loss terms); the forward/backward work is the same s tokens
            loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss
        else:
            loss = model(tokens, positions, labels)
        loss.backward()
        opt.step()
        return loss.item()

    return step


LABELS = {
    "hf": "HF LlamaForCausalLM",
    "hf-c": "HF compiled",
    "rope": "goat-dist rope",
    "rope-c": "goat-dist rope compiled",
    "goat": "goat-dist GOAT",
    "goat-c": "goat-dist GOAT compiled",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per timed repeat")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (compiled models: >= 2)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--eager-only", action="store_true", help="leave out the compiled models")
    ap.add_argument("--profile", action="store_true", help="then where each model's step time goes")
    add_clock_args(ap)
    args = ap.parse_args()
    apply_threads(args)
    import transformers

    distributed.init(tp=1)
    names = [n for n in LABELS if not (args.eager_only and n.endswith("-c"))]
    models = {}
    for name in names:
        compiled = name.endswith("-c")
        kind = name.removesuffix("-c")
        if kind == "hf":
            ffn = ffn_size(goat_model(args, "rope").cfg)
            models[name] = hf_model(args, ffn, compile=compiled)
        else:
            models[name] = goat_model(args, kind, compile=compiled)
    counts = {name: sum(p.numel() for p in models[name].parameters()) for name in ("hf", "rope")}
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} "
        f"threads, fp32, CPU, SDPA, AdamW, {args.clock} clock; h={args.hidden} layers={args.layers} "
        f"heads={args.heads} "
        f"ffn={ffn} V={args.vocab} b={args.batch} s={args.seq}; params HF {counts['hf'] / 1e6:.2f}M, "
        f"goat-dist {counts['rope'] / 1e6:.2f}M; compiled: torch.compile(dynamic=False), HF the whole "
        "model, goat-dist each block (model.compile)"
    )
    torch.manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq))
    steps = {name: make_step(models[name], name.removesuffix("-c"), tokens) for name in names}
    for name, step in steps.items():
        start = time.perf_counter()
        step()  # a compiled model compiles its forward and backward here
        first = time.perf_counter() - start
        for _ in range(args.warmup - 1):
            step()
        if name.endswith("-c"):
            print(f"{LABELS[name]}: first step (compilation) {first:.1f} s")
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, step in steps.items():
            times[name].append(seconds_per_call(step, args.steps, CLOCKS[args.clock]))
    tokens_per_step = args.batch * args.seq
    tps = {n: [tokens_per_step / t for t in ts] for n, ts in times.items()}
    bases = [b for b in ("hf", "hf-c") if b in tps]

    def paired(name, base):
        return statistics.median(a / b for a, b in zip(tps[name], tps[base]))

    head = "".join(f" {'vs ' + LABELS[b].replace('HF LlamaForCausalLM', 'HF eager'):>17}" for b in bases)
    print(f"{'model':<25} {'tokens/s (median)':>18} {'min':>9} {'max':>9}{head}")
    for name in names:
        ratios = "".join(f" {paired(name, b):>17.3f}" for b in bases)
        print(
            f"{LABELS[name]:<25} {statistics.median(tps[name]):>18.0f} {min(tps[name]):>9.0f} "
            f"{max(tps[name]):>9.0f}{ratios}"
        )
    if args.profile:
        profile(steps)
    print(f"goat-dist GOAT / HF: {paired('goat', 'hf'):.3f}")
    if "goat-c" in tps:
        print(f"goat-dist GOAT compiled / GOAT eager: {paired('goat-c', 'goat'):.3f}")
        print(
            f"goat-dist rope compiled / HF eager: {paired('rope-c', 'hf'):.3f} (target >= 1.20), "
            f"/ HF compiled: {paired('rope-c', 'hf-c'):.3f} (target >= 1.00)"
        )
    print(f"ratio goat-dist (rope) / HF tokens/s: {paired('rope', 'hf'):.3f} (target >= 1.10)")


def profile(steps: dict, rounds: int = 3) -> None:
    """Where one step's CPU time goes, per model (torch.profiler self time, ms per step, the mean of
    ``rounds`` steps interleaved across the models): matmuls and SDPA are the same work compiled or not;
    a compiler can only shrink the rest."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    groups = ("matmuls", "SDPA", "compiled graphs", "other", "step")
    ms = {name: dict.fromkeys(groups, 0.0) for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                step()
            for e in prof.key_averages():
                t = e.self_cpu_time_total / 1e3 / rounds
                if e.key in ("aten::mm", "aten::addmm", "aten::bmm"):
                    group = "matmuls"
                elif "scaled_dot_product" in e.key:
                    group = "SDPA"
                elif e.key.startswith("## Call CompiledFxGraph"):
                    group = "compiled graphs"
                else:
                    group = "other"
                ms[name][group] += t
                ms[name]["step"] += t
    print("profile: self CPU ms per step")
    print(f"{'':<16}" + "".join(f" {LABELS[n][:24]:>24}" for n in steps))
    for group in groups:
        print(f"{group:<16}" + "".join(f" {ms[n][group]:>24.1f}" for n in steps))


if __name__ == "__main__":
    main()
