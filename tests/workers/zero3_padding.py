"""torchrun worker (DP=2, ZeRO-3, bf16): DeepSpeed pads partitions with uninitialised memory. NaN written
into every partition's padding (forward weights and fp32 masters) must not be seen by the non-finite-weight
check, the weight norm or the prior's fp32 forward values (engine/zero3.py), while an Inf in a real element
must be. Writes one JSON per rank."""

import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: multiproc

import torch  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param  # noqa: E402
from multiproc import one_layer_config  # noqa: E402

from goat_dist import distributed  # noqa: E402
from goat_dist.engine.zero3 import partition_span  # noqa: E402
from goat_dist.model import GPT  # noqa: E402
from goat_dist.observe.step_metrics import param_sumsq_share  # noqa: E402
from goat_dist.parallel.parallelize import parallelize  # noqa: E402
from goat_dist.trainer.nonfinite import first_nonfinite_weight  # noqa: E402


def main(out: str) -> None:
    layout = distributed.init(tp=1)
    cfg = one_layer_config(
        "train.micro_batch_size=1", "parallel.zero_stage=3", "train.precision=bf16"
    )  # one sequence per DP rank
    torch.manual_seed(0)
    model = GPT(cfg.model)
    engine = parallelize(model, cfg, grad_accum=1)
    padded = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            _, real = partition_span(p)
            master = engine.optimizer._get_fp32_opt_state_partition(p, release_swap_buffers=False)[0]
            if real < p.ds_tensor.numel():
                p.ds_tensor.view(-1)[real:] = float("nan")
                master.view(-1)[real:] = float("nan")
                padded.append(name)
    engine.module.sync_prior_masters()
    prior = [(n, p) for n, p in model.named_parameters() if ".prior." in n]
    result = {
        "prior_forward_is_master": [
            n for n, p in prior if torch.equal(p.fp32_forward, safe_get_full_fp32_param(p))
        ],
        "prior": [n for n, _ in prior],
        "padded": padded,
        "bad_with_padding_nan": first_nonfinite_weight(model),
        "norm_share": param_sumsq_share(model, 1, layout.dp, layout.dp_rank),
    }
    victim = next(n for n, p in model.named_parameters() if partition_span(p)[1] > 0 and n not in padded)
    with torch.no_grad():
        dict(model.named_parameters())[victim].ds_tensor.view(-1)[0] = float("inf")
    result["victim"], result["bad_with_real_inf"] = victim, first_nonfinite_weight(model)
    with open(f"{out}.{layout.rank}", "w") as f:
        json.dump(result, f)
    distributed.exit_process(0)


if __name__ == "__main__":
    main(sys.argv[1])
