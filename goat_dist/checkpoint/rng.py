"""Every random generator a step can touch, captured and restored per rank (weights_only-safe)."""

from __future__ import annotations

import random

import numpy as np
import torch


def capture() -> dict:
    np_state = np.random.get_state()
    version, internal, gauss = random.getstate()
    state = {
        "python": [version, list(internal), gauss],
        "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_pos": np_state[2],
        "numpy_gauss": [np_state[3], np_state[4]],
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    try:  # megatron's model-parallel tracker (dropout under TP); absent when never seeded
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        state["megatron_tracker"] = get_cuda_rng_tracker().get_states()
    except Exception:  # noqa: BLE001
        pass
    return state


def restore(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(
        (
            "MT19937",
            state["numpy_keys"].numpy().astype(np.uint32),
            int(state["numpy_pos"]),
            int(state["numpy_gauss"][0]),
            float(state["numpy_gauss"][1]),
        )
    )
    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["torch_cuda"])
    if state.get("megatron_tracker"):
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        get_cuda_rng_tracker().set_states(state["megatron_tracker"])
