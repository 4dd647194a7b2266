"""megatron-core on machines without CUDA: the few ``torch.cuda`` calls it makes, redirected to CPU.

Applied once, by ``distributed.init``, and only when CUDA is absent. Each patch names its reason:

* ``torch.cuda.current_device`` -> ``"cpu"``: megatron allocates buffers with
  ``device=torch.cuda.current_device()`` (sequence-parallel all-gather buffer, gather_output, init).
* ``torch.cuda.synchronize`` -> no-op: called around collectives and checkpoint saves.
* ``torch.cuda.get_rng_state`` / ``set_rng_state`` / ``manual_seed``: megatron's model-parallel RNG
  tracker (dropout and activation checkpointing replay) keeps "CUDA" generator states; on CPU the
  CPU generator plays that role. ``manual_seed`` must not call ``torch.manual_seed`` (which calls back
  into ``torch.cuda.manual_seed_all``), so it seeds the default generator directly.
"""

from __future__ import annotations

import torch

_APPLIED = False


def apply_cpu_compat() -> bool:
    """Patch when CUDA is unavailable; returns whether patches are active. Idempotent."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    _APPLIED = True
    return True
