"""``model.compile``: each block's training forward through torch.compile (``goat_dist/model/compile.py``).

The promise: the same training as eager, to fp32 rounding. Each case builds the model twice from one seed,
one compiled, trains both 20 AdamW steps on one batch stream and compares the per-step losses (rtol 1e-5;
measured 1e-7 to 2e-7), and checks the blocks really ran compiled (one graph for every block, no graph
break at TP=1) and the compile time was printed once. Multi-process layouts run compiled against the eager
single process in ``tests/integration/parallel/test_scale_out.py`` (TP=2 + SP, ZeRO-3 over DP=2) and
``test_context_parallel_runs.py`` (CP=2 with documents).
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from goat_dist.config import ConfigError, ModelConfig, load_config
from goat_dist.goat import GoatPrior
from goat_dist.goat.exact import SPLIT_PARTS
from goat_dist.model import GPT
from goat_dist.model.compile import OPTIONS
from goat_dist.parallel import model_parallel
from goat_dist.parallel.model_parallel import resolve_compile

STEPS = 20
RTOL = 1e-5


def tiny(position: str, **extra) -> ModelConfig:
    shape = dict(vocab_size=256, seq_len=32, num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2)
    return ModelConfig(**shape, position=position, **{"attention_backend": "sdpa", **extra})


def batches(documents: bool):
    """A fixed stream of (tokens, positions, labels), four batches in turn; with ``documents`` every other
    batch packs documents (positions restart), so both graphs (with and without segments) are used."""
    g = torch.Generator().manual_seed(1)
    stream = [torch.randint(0, 256, (2, 33), generator=g) for _ in range(4)]  # repeated: it learns them
    for step in range(STEPS):
        tokens = stream[step % 4]
        positions = torch.arange(32).expand(2, -1).clone()
        if documents and step % 2:
            positions[0, 10:] = torch.arange(22)
            positions[1, 20:] = torch.arange(12) + 40  # a document continued from a previous window
        yield tokens[:, :-1], positions, tokens[:, 1:]


def train(cfg: ModelConfig, compile: bool, documents: bool, checkpointing: str = "none") -> list[float]:
    torch.manual_seed(0)
    model = GPT(cfg, documents=documents)
    model_parallel.apply(model, compile=compile, activation_checkpointing=checkpointing)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for tokens, positions, labels in batches(documents):
        loss = model(tokens, positions, labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if compile:
        assert model.compile_clock.seconds is not None  # timed and reported
    return losses


CASES = [
    pytest.param("goat", False, "none", id="goat"),
    pytest.param("rope", False, "selective", id="rope-selective-ckpt"),
    pytest.param("goat", True, "full", id="goat-documents-full-ckpt"),
]


@pytest.mark.parametrize("position,documents,checkpointing", CASES)
def test_compiled_training_equals_eager(world1, capsys, position, documents, checkpointing):
    cfg = tiny(position)
    eager = train(cfg, False, documents, checkpointing)
    torch._dynamo.reset()
    counters.clear()
    compiled = train(cfg, True, documents, checkpointing)
    # one graph serves both blocks (compiling costs one block's, whatever the depth); documents add the
    # variant with segments. TP=1: no graph break inside it.
    assert counters["stats"]["unique_graphs"] == (2 if documents else 1)
    assert not counters["graph_break"], dict(counters["graph_break"])
    for step, (a, b) in enumerate(zip(eager, compiled), start=1):
        assert abs(a - b) <= RTOL * abs(a), f"step {step}: compiled {b} vs eager {a}"
    assert eager[-1] < eager[0]
    printed = capsys.readouterr().out
    assert printed.count("model.compile: compiled 2 transformer blocks in ") == 1, printed


@pytest.mark.slow  # ~20 s of compiling from a cold cache
def test_flash_kernels_run_eagerly_between_graphs(world1, fa4):
    """FlashAttention (here the FA4 stand-in) is called outside the compiled graphs, with equal losses."""
    cfg = tiny("goat", attention_backend="flash4")
    eager = train(cfg, False, True)
    calls = len(fa4.calls)
    torch._dynamo.reset()
    compiled = train(cfg, True, True)
    assert len(fa4.calls) == 2 * calls > 0
    for a, b in zip(eager, compiled):
        assert abs(a - b) <= RTOL * abs(a)


def test_communicating_parallel_layers_run_eagerly(world1):
    """Under TP > 1 megatron's parallel linear layers (their collectives) run between graphs. Played at
    TP=1 by marking the layers as communicating: each is a graph break, and training is eager's."""

    def communicating(model):
        for block in model.blocks:
            for layer in (block.attn.qkv, block.attn.proj, block.mlp.fc1, block.mlp.fc2):
                layer.communicates = True
        return model

    def train3(compile: bool) -> list[float]:
        torch.manual_seed(0)
        model = communicating(model_parallel.apply(GPT(tiny("goat"), documents=False), compile=compile))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for tokens, positions, labels in list(batches(False))[:3]:
            loss = model(tokens, positions, labels)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    eager = train3(False)
    torch._dynamo.reset()
    counters.clear()
    compiled = train3(True)
    assert counters["stats"]["unique_graphs"] >= 2  # the pieces between the layers
    assert any("disable" in reason for reason in counters["graph_break"]), dict(counters["graph_break"])
    for a, b in zip(eager, compiled):
        assert abs(a - b) <= RTOL * abs(a)


def test_evaluation_runs_eagerly(world1):
    """Only training forwards are compiled: evaluation shapes (lengths, batches, probes) compile nothing."""
    torch._dynamo.reset()
    counters.clear()
    model = model_parallel.apply(GPT(tiny("goat")), compile=True).eval()
    with torch.no_grad():
        for length in (8, 16, 24):
            model(torch.randint(0, 256, (1, length)), torch.arange(length)[None])
    assert not counters["stats"]["unique_graphs"]
    assert model.compile_clock.waiting  # nothing timed or printed yet


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_exact_lanes_survive_the_compiler(dtype):
    """GOAT's low-precision lanes rely on every rounding happening (``goat.exact``): by default inductor
    keeps the intermediates in fp32 and the three parts of a per-key value collapse into one. Compiled
    with the blocks' options (``model.compile.OPTIONS``), the lanes are eager's to the bit."""
    prior = GoatPrior(2, pos_rank=4, abs_rank=4, training_seq_len=256)
    positions = torch.arange(512).expand(2, -1) + torch.tensor([[0], [40_000]])

    def lanes(position_ids):
        return prior.lanes(position_ids, True, scale=0.125, dtype=dtype)

    eager = lanes(positions)
    torch._dynamo.reset()
    compiled = torch.compile(lanes, dynamic=False, options=OPTIONS)(positions)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)
    parts = eager[1][..., -SPLIT_PARTS:]
    assert parts[..., 1:].abs().amax() > 0  # the value really is carried by more than one part


def test_compile_choice():
    assert resolve_compile("auto", cuda=True) and not resolve_compile("auto", cuda=False)
    assert resolve_compile(True, cuda=False) and not resolve_compile(False, cuda=True)
    assert load_config(None, ["model.compile=true"]).model.compile is True
    assert load_config(None, []).model.compile == "auto"
    with pytest.raises(ConfigError, match="model.compile"):
        load_config(None, ["model.compile=sometimes"])
