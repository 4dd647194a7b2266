"""torchrun worker: several layouts checked in one world (one launch: a process start on 2 cores costs more
than a tiny model's 10 steps). tests/integration/parallel/conftest.py launches it once with 2 ranks and
once with 4.

    layout_runs.py <out_dir> <cache_dir> <job> [<job> ...]

Jobs, run in order (megatron's groups are rebuilt when a job needs another TP/CP split):

* ``grads:<tp>:<cp>``: one forward/backward of tests/workers/tp_grads.py's tiny GOAT model under TP x CP
  with SP, for plain rows and for rows of packed documents, with the sdpa CP path and with the flash CP
  path (tests/harness/flash_standin.py, fp32); rank 0 saves the TP=1-shaped gradients and losses to
  ``<out_dir>/grads.pt``;
* ``tpgrads:<position>``: tests/workers/tp_grads.py's forward/backward under TP=world with SP (no CP);
  rank 0 saves the gradients and the count of TP-sum all-reduces to ``<out_dir>/tpgrads-<position>.pt``;
* ``train:<name>:<override>,<override>...``: ``goat-dist train`` (the Trainer) on multiproc.TINY with
  these overrides for 10 steps; metrics.jsonl in ``<out_dir>/<name>``. Dynamo's caches and counters are
  reset first, and rank 0 writes the number of graphs dynamo compiled during the job to
  ``<out_dir>/<name>/dynamo_graphs``: the tests hold a compiled layout to having compiled its own blocks
  (one process trains several models, and a frame past dynamo's recompile limit runs eagerly).

A job that raises prints its name before the traceback.
"""

import os
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import torch  # noqa: E402
from megatron.core import parallel_state  # noqa: E402

from goat_dist import distributed  # noqa: E402


def relayout(tp: int, cp: int) -> None:
    if parallel_state.model_parallel_is_initialized():
        if (
            parallel_state.get_tensor_model_parallel_world_size() == tp
            and parallel_state.get_context_parallel_world_size() == cp
        ):
            return
        parallel_state.destroy_model_parallel()
    distributed.init(tp=tp, cp=cp)


def document_batch(cfg):
    """tp_grads.tiny_batch with packed documents: row 0 restarts at 5 and 19 (19 lies in a later chunk)."""
    from tp_grads import tiny_batch

    tokens, positions, labels = tiny_batch(cfg)
    positions = positions.clone()
    positions[0, 5:] = torch.arange(cfg.seq_len - 5)
    positions[0, 19:] = torch.arange(cfg.seq_len - 19) + 100
    return tokens, positions, labels


def grads(out: Path, tp: int, cp: int) -> None:
    from harness.flash_standin import FlashStandin, installed
    from tp_grads import full_gradient, tiny_batch, tiny_config

    from goat_dist.model import GPT
    from goat_dist.parallel import model_parallel
    from goat_dist.parallel.parallelize import add_tp_grad_allreduce

    relayout(tp, cp)
    cp_group = parallel_state.get_context_parallel_group()
    result = {}
    for backend in ("sdpa", "flash"):
        cfg = tiny_config("goat")
        cfg.attention_backend = backend
        standin = FlashStandin(allow_fp32=True)
        with installed(standin):
            torch.manual_seed(0)
            model = model_parallel.apply(GPT(cfg, sequence_parallel=tp > 1))
            add_tp_grad_allreduce(model)
            for batch_name, batch in (("plain", tiny_batch(cfg)), ("documents", document_batch(cfg))):
                model.zero_grad()
                loss = model(*batch)
                loss.backward()
                # CP ranks' gradients are partial sums of one loss: reduced over the CP group (the
                # trainer does it in DeepSpeed's DP x CP average, with the factor cp in the loss)
                for p in model.parameters():
                    torch.distributed.all_reduce(p.grad, group=cp_group)
                    p.grad /= cp
                mean_loss = loss.detach().clone()
                torch.distributed.all_reduce(mean_loss, group=cp_group)
                result[f"{backend}/{batch_name}"] = {
                    "loss": float(mean_loss) / cp,
                    "grads": {name: full_gradient(p) for name, p in model.named_parameters()},
                }
        if backend == "flash":
            assert standin.calls, "the flash CP path did not reach the flash module"
            result["flash_calls"] = sorted(set(standin.calls))
    if torch.distributed.get_rank() == 0:
        torch.save(result, out / "grads.pt")


def tp_grads(out: Path, position: str) -> None:
    from tp_grads import TP_ALL_REDUCES, full_gradient, tiny_batch, tiny_config

    from goat_dist.model import GPT
    from goat_dist.parallel import model_parallel
    from goat_dist.parallel.parallelize import add_tp_grad_allreduce

    relayout(int(os.environ["WORLD_SIZE"]), 1)
    cfg = tiny_config(position)
    torch.manual_seed(0)
    model = model_parallel.apply(GPT(cfg, sequence_parallel=True))
    tp_sum = add_tp_grad_allreduce(model)
    model(*tiny_batch(cfg)).backward()
    grads = {name: full_gradient(p) for name, p in model.named_parameters()}
    grads[TP_ALL_REDUCES] = torch.tensor(tp_sum.all_reduces if tp_sum else 0)
    if torch.distributed.get_rank() == 0:
        torch.save(grads, out / f"tpgrads-{position}.pt")


def train(out: Path, cache: str, name: str, overrides: list[str]) -> None:
    from harness.layouts import layout_config
    from torch._dynamo.utils import counters

    from goat_dist.trainer import Trainer

    cfg = layout_config(cache, out / name, *overrides)
    relayout(cfg.parallel.tp, cfg.parallel.cp)
    torch._dynamo.reset()
    counters.clear()
    Trainer(cfg).fit()
    if torch.distributed.get_rank() == 0:
        (out / name / "dynamo_graphs").write_text(f"{counters['stats']['unique_graphs']}\n")


def main(out: str, cache: str, jobs: list[str]) -> None:
    out_dir = Path(out)
    for job in jobs:
        kind, _, rest = job.partition(":")
        try:
            if kind == "grads":
                tp, cp = (int(x) for x in rest.split(":"))
                grads(out_dir, tp, cp)
            elif kind == "tpgrads":
                tp_grads(out_dir, rest)
            elif kind == "train":
                name, _, overrides = rest.partition(":")
                train(out_dir, cache, name, [o for o in overrides.split(",") if o])
            else:
                raise SystemExit(f"unknown job {job!r}")
        except BaseException:
            print(f"layout_runs: job {job!r} failed on rank {os.environ.get('RANK')}", file=sys.stderr)
            raise
        torch.distributed.barrier()
    distributed.exit_process(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
