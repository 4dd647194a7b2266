"""``KernelRefusal``: the error of an attention stand-in (``flash4_standin``, ``flash_standin``) for a call
the real kernel would refuse, so that a caller (``goat-dist plan --rehearse``, tests) tells it apart from
a stand-in that lacks a feature (NotImplementedError) or a bug (anything else)."""

from __future__ import annotations


class KernelRefusal(AssertionError, RuntimeError):
    """A call the real kernel would refuse: ``kernel`` (which entry point, on which GPU), ``rule`` (the
    real interface's own words, so they can be compared with it) and ``got`` (what this call passed).

    An AssertionError as FlashAttention-4's interface raises (its checks are asserts) and a RuntimeError
    as flash-attn 2's C++ entry raises (``TORCH_CHECK``): code that catches the real kernel's error
    catches this one too."""

    def __init__(self, kernel: str, rule: str, got: str | None = None):
        self.kernel, self.rule, self.got = kernel, rule, got
        detail = f" (got {got})" if got else ""
        super().__init__(f"{kernel} would refuse this call: {rule}{detail}")

    def __reduce__(self):  # pickles across processes with its three fields
        return type(self), (self.kernel, self.rule, self.got)
