"""megatron-core on machines without CUDA: the few ``torch.cuda`` calls it makes, redirected to CPU.

Applied once, by ``distributed.init``, and only when CUDA is absent. Each patch names its reason:

* ``torch.cuda.current_device`` -> ``"cpu"``: megatron allocates buffers with
  ``device=torch.cuda.current_device()`` (sequence-parallel all-gather buffer, gather_output, init).
* ``torch.cuda.synchronize`` -> no-op: called around collectives and checkpoint saves.
* ``torch.cuda.get_rng_state`` / ``set_rng_state`` / ``manual_seed``: megatron's model-parallel RNG
  tracker (dropout and activation checkpointing replay) keeps "CUDA" generator states; on CPU the
  CPU generator plays that role. ``manual_seed`` must not call ``torch.manual_seed`` (which calls back
  into ``torch.cuda.manual_seed_all``), so it seeds the default generator directly.

It also holds the torch floor, ``TORCH_FLOOR``: importing this module (which ``goat_dist.distributed`` does,
so every run, evaluation and check that uses torch.distributed) refuses an older torch, naming both
versions. The floor is the version CI installs and tests (``launch/setup.sh``), the same as pyproject.toml's
(``tests/unit/repo/test_torch_floor.py`` holds the three together): the code uses features of recent
releases (torch.compile's ``emulate_precision_casts``, SDPA's ``enable_gqa``, ...) and no older one is run.
"""

from __future__ import annotations

import re

import torch

TORCH_FLOOR = (2, 13)  # pyproject.toml's `torch>=2.13`, and the torch==2.13.0 launch/setup.sh installs


def torch_too_old(version: str) -> str | None:
    """Why torch ``version`` cannot run goat-dist (None when it can, or when the version cannot be read)."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or (int(found.group(1)), int(found.group(2))) >= TORCH_FLOOR:
        return None
    floor = ".".join(map(str, TORCH_FLOOR))
    return (
        f"goat-dist needs torch >= {floor} (the version it is tested with), but torch {version} is "
        f"installed: install torch>={floor} first (launch/setup.sh installs the version CI tests)"
    )


def check_torch(version: str) -> None:
    """Refuse torch ``version`` below ``TORCH_FLOOR`` with an ImportError naming it and the floor."""
    problem = torch_too_old(version)
    if problem is not None:
        raise ImportError(problem)


check_torch(torch.__version__)

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
