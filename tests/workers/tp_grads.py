"""torchrun worker: one forward/backward of a tiny GPT under the given TP/SP; rank 0 saves the
gathered (full, TP=1-shaped) gradients and the count of TP-sum all-reduces. Used by
tests/integration/parallel/test_scale_out.py."""

import sys
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402

from goat_dist import distributed  # noqa: E402
from goat_dist.checkpoint.universal import merge, split_meta  # noqa: E402
from goat_dist.config import ModelConfig  # noqa: E402
from goat_dist.model import GPT  # noqa: E402
from goat_dist.parallel import model_parallel  # noqa: E402
from goat_dist.parallel.parallelize import add_tp_grad_allreduce  # noqa: E402

TP_ALL_REDUCES = "_tp_all_reduces"  # the saved count of the backward's TP-sum collectives


def main(out: str, tp: int, sp: bool, position: str) -> None:
    layout = distributed.init(tp=tp)
    cfg = tiny_config(position)
    torch.manual_seed(0)
    model = model_parallel.apply(GPT(cfg, layout, sequence_parallel=sp))
    tp_sum = add_tp_grad_allreduce(model)
    tokens, positions, labels = tiny_batch(cfg)
    model(tokens, positions, labels).backward()
    grads = {name: full_gradient(p) for name, p in model.named_parameters()}
    grads[TP_ALL_REDUCES] = torch.tensor(tp_sum.all_reduces if tp_sum else 0)
    if layout.rank == 0:
        torch.save(grads, out)
    distributed.exit_process(0)


def full_gradient(p: torch.nn.Parameter) -> torch.Tensor:
    """The TP=1-shaped gradient: every TP rank's slice, merged as the universal checkpoint merges them."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(p.grad) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, p.grad.contiguous(), group=group)
    return merge(parts, split_meta(p))


def tiny_config(position: str) -> ModelConfig:
    return ModelConfig(
        vocab_size=300,
        seq_len=32,
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        position=position,
        attention_backend="sdpa",
        tie_embeddings=False,
    )


def tiny_batch(cfg: ModelConfig):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=g)
    positions = torch.arange(cfg.seq_len).expand(2, -1) + torch.tensor([[0], [500]])
    return tokens[:, :-1], positions, tokens[:, 1:]


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "sp", sys.argv[4])
