"""The lazy imports of both flash-attn generations, and why FlashAttention-4 is not usable, in words a
user can act on.

Two packages write ``flash_attn/cute/``: FlashAttention-4 (PyPI ``flash-attn-4``) and the FlashAttention-2
sdist (``flash-attn`` 2.8.3.post2 ships an older ``flash_attn/cute/interface.py`` whose
``flash_attn_func(q, k, v, softmax_scale, causal, window_size, learnable_sink, softcap, pack_gqa)`` has no
``return_lse``). Installed into one environment, whichever came last overwrites the other's files, and
uninstalling either removes files the other needs. An import that succeeds but lacks FA4's API is that
case; the message says so and how to repair the environment.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys

COINSTALL_FIX = (
    "install the two extras into separate environments: here, pip uninstall -y flash-attn flash-attn-4 "
    "&& pip install 'goat-dist[gpu]' (FlashAttention-4); FlashAttention-2 ('goat-dist[flash2]') in another "
    "environment"
)


@functools.cache
def _flash_attn():
    """The ``flash_attn`` module, or None. Decided by importing: a kernel-less install can have a spec.

    Cached; the stand-in (``flash_standin.installed``: the rehearsal, CPU tests) puts itself in
    ``sys.modules["flash_attn"]`` and clears this cache, so the flash paths run without CUDA.
    """
    try:
        import flash_attn
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    needed = ("flash_attn_func", "flash_attn_varlen_func")
    return flash_attn if all(hasattr(flash_attn, name) for name in needed) else None


_FLASH4_IMPORT_ERROR: list[str] = []  # why flash_attn.cute is not usable (for the messages)


@functools.cache
def _flash_attn_cute():
    """FlashAttention-4's ``flash_attn.cute.interface`` module, or None (cached, like ``_flash_attn``;
    ``flash4_standin.installed`` puts the stand-in there). The PyPI package is ``flash-attn-4``."""
    _FLASH4_IMPORT_ERROR.clear()
    try:
        interface = importlib.import_module("flash_attn.cute.interface")
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        _FLASH4_IMPORT_ERROR.append(import_failure(exc))
        return None
    problem = flash4_api_problem(interface)  # e.g. FlashAttention-2's older flash_attn/cute/
    if problem:
        _FLASH4_IMPORT_ERROR.append(problem)
        return None
    return interface


def flash4_unusable() -> str:
    """Why FA4 is not used, for the messages (the import's own error when there was one)."""
    default = "flash_attn.cute (PyPI flash-attn-4) does not import"
    return _FLASH4_IMPORT_ERROR[0] if _FLASH4_IMPORT_ERROR else default


def flash4_api_problem(interface) -> str | None:
    """None when ``interface`` (``flash_attn.cute.interface``) has FlashAttention-4's API, else why not."""
    where = getattr(interface, "__file__", None) or "?"
    missing = [name for name in ("flash_attn_func", "flash_attn_varlen_func") if not hasattr(interface, name)]
    if missing:
        return f"flash_attn.cute.interface ({where}) has no {', '.join(missing)}"
    try:
        params = inspect.signature(interface.flash_attn_func).parameters
    except (TypeError, ValueError):  # not introspectable: trust it
        return None
    if "return_lse" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    return (
        f"flash_attn.cute.interface ({where}) is not FlashAttention-4's: its flash_attn_func takes no "
        "return_lse. This is the older flash_attn/cute/ that the FlashAttention-2 sdist (flash-attn) "
        "installs; it replaced FlashAttention-4's files because both packages are in this environment. "
        f"Fix: {COINSTALL_FIX}"
    )


def both_installed() -> bool:
    """Both distributions that write ``flash_attn/cute/`` are installed here."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("flash-attn")
        version("flash-attn-4")
    except PackageNotFoundError:
        return False
    return True


def import_failure(exc: BaseException) -> str:
    """Why ``flash_attn.cute.interface`` did not import, with the co-install fix where it applies."""
    text = f"flash_attn.cute (PyPI flash-attn-4) does not import ({type(exc).__name__}: {exc})"
    if both_installed():
        text += (
            "; flash-attn (FlashAttention-2) and flash-attn-4 are both installed and overwrite each "
            f"other's flash_attn/cute/. Fix: {COINSTALL_FIX}"
        )
    return text


_NOTICE_GIVEN: list[bool] = []


def notice_auto_fallback(choice: str, why: str) -> None:
    """Say once per process (rank 0 under a launcher) that ``auto`` passed over flash4 and why."""
    if _NOTICE_GIVEN or os.environ.get("RANK", "0") != "0":
        return
    _NOTICE_GIVEN.append(True)
    print(
        f"goat-dist: attention_backend=auto takes {choice}, not flash4: {why}. For FlashAttention-4 on "
        "this GPU: pip install 'goat-dist[gpu]' (it needs triton, which CUDA builds of torch bring)",
        file=sys.stderr,
        flush=True,
    )
