"""Training tokens/s of goat-dist against Hugging Face ``LlamaForCausalLM`` of the same shape, on CPU.

One process, fp32, SDPA attention on both sides, the same batch, sequence length and number of steps. Both
models are trained by the same plain ``torch.optim.AdamW`` loop (zero_grad, forward with labels -> mean
loss, backward, step): goat-dist's model is built directly in a single-process world
(``goat_dist.distributed.init(tp=1)``, TP=1 megatron-core layers), without DeepSpeed or the trainer, so the
ratio compares the *models*, not the training engines. Same shape: hidden, layers, heads, SwiGLU FFN width,
RMSNorm, tied embeddings, no biases, vocabulary (a multiple of 128, so goat-dist pads nothing).

goat-dist runs with ``position=rope`` for the like-for-like ratio, and with ``position=goat`` (its GOAT
prior) as a second line. Repeats interleave the three models (HF, rope, GOAT, HF, ...), each repeat timing
``--steps`` optimizer steps after warm-up steps, so machine noise hits all alike; medians are reported and
the ratio is the median of the per-repeat paired ratios. Target: goat-dist (rope) / HF >= 1.10. Last line:
that ratio.

    pip install 'goat-dist[bench]'   # transformers
    python bench/vs_hf.py [--hidden 512 --layers 8 --seq 512] [--repeats 5] [--clock process]
"""

from __future__ import annotations

import argparse
import os
import statistics
import warnings

os.environ.setdefault("DS_ACCELERATOR", "cpu")
warnings.filterwarnings("ignore", module="megatron")

import torch  # noqa: E402
from timing import CLOCKS, add_clock_args, apply_threads, seconds_per_call  # noqa: E402

from goat_dist import distributed  # noqa: E402
from goat_dist.config import ModelConfig  # noqa: E402
from goat_dist.model.gpt import GPT, ffn_size  # noqa: E402


def goat_model(args, position: str) -> torch.nn.Module:
    cfg = ModelConfig(
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


def hf_model(args, ffn: int) -> torch.nn.Module:
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
    model = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    return model.train()


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per timed repeat")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    add_clock_args(ap)
    args = ap.parse_args()
    apply_threads(args)
    import transformers

    distributed.init(tp=1)
    rope, goat = goat_model(args, "rope"), goat_model(args, "goat")
    ffn = ffn_size(rope.cfg)
    hf = hf_model(args, ffn)
    counts = {name: sum(p.numel() for p in m.parameters()) for name, m in (("hf", hf), ("rope", rope))}
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} "
        f"threads, fp32, CPU, SDPA, AdamW, {args.clock} clock; h={args.hidden} layers={args.layers} "
        f"heads={args.heads} "
        f"ffn={ffn} V={args.vocab} b={args.batch} s={args.seq}; params HF {counts['hf'] / 1e6:.2f}M, "
        f"goat-dist {counts['rope'] / 1e6:.2f}M"
    )
    torch.manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq))
    steps = {"hf": make_step(hf, "hf", tokens), "rope": make_step(rope, "rope", tokens)}
    steps["goat"] = make_step(goat, "goat", tokens)
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, step in steps.items():
            times[name].append(seconds_per_call(step, args.steps, CLOCKS[args.clock]))
    tokens_per_step = args.batch * args.seq
    tps = {n: [tokens_per_step / t for t in ts] for n, ts in times.items()}
    print(f"{'model':<22} {'tokens/s (median)':>18} {'min':>9} {'max':>9} {'vs HF (paired)':>15}")
    ratios = {}
    labels = {"hf": "HF LlamaForCausalLM", "rope": "goat-dist rope", "goat": "goat-dist GOAT"}
    for name, label in labels.items():
        ratios[name] = statistics.median(a / b for a, b in zip(tps[name], tps["hf"]))
        print(
            f"{label:<22} {statistics.median(tps[name]):>18.0f} {min(tps[name]):>9.0f} "
            f"{max(tps[name]):>9.0f} {ratios[name]:>15.3f}"
        )
    print(f"goat-dist GOAT / HF: {ratios['goat']:.3f}")
    print(f"ratio goat-dist (rope) / HF tokens/s: {ratios['rope']:.3f} (target >= 1.10)")


if __name__ == "__main__":
    main()
