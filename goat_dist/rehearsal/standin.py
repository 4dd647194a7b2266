"""The meta device standing in for CUDA, and the host syncs it lets us count.

Meta tensors have shapes and dtypes and no data: a step of any model costs nothing on them, and a CPU
tensor meeting one raises, as a CPU tensor meeting a CUDA tensor does. So the rehearsal points what
megatron-core and goat_dist ask of ``torch.cuda`` at meta (``accelerator_on_meta``): the current device,
the device a collective moves a host tensor to, the GPU's compute capability (which picks the kernel).

A host sync is a value read back from the device: ``.item()``, ``.tolist()``, ``bool()``, ``int()``,
``float()`` of a device tensor, and ops whose result's shape depends on its values (``nonzero``). On a GPU
each one stalls the stream. ``HostSyncs`` intercepts them on meta tensors, counts them by the goat_dist
line that asked, and answers with a stand-in value (zeros, True for ``bool``; ``nonzero`` one index per
row), since a meta tensor has none. Code that branches on such a value follows one branch only.

What meta accepts and CUDA refuses (the stand-in cannot see these): an index tensor on the CPU indexing a
device tensor, and a CPU tensor given to ``torch.where``/``index_select``-style ops as an index; a 0-d CPU
tensor is accepted by both, as it should be.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch

from .world import caller

META = torch.device("meta")


def patch(owner, name: str, value) -> None:
    """``owner.name = value`` for a rehearsal's duration (its caller restores it): module functions and
    tensor methods swapped at run time, which a type checker cannot follow."""
    setattr(owner, name, value)


class HostSyncs:
    """Host syncs on meta tensors, counted by ``file:line`` while active (``with HostSyncs() as syncs``)."""

    def __init__(self, answers: dict | None = None):
        """``answers``: stand-in values by method name (``tolist``: a function of the tensor) where the
        default (zeros) would send the code down a path a real step does not take."""
        self.counts: Counter[str] = Counter()
        self.answers = answers or {}
        self._saved: dict = {}

    def _count(self) -> None:
        self.counts[caller()] += 1

    def __enter__(self) -> HostSyncs:
        T = torch.Tensor
        names = (
            "item",
            "tolist",
            "__bool__",
            "__int__",
            "__float__",
            "__index__",
            "nonzero",
            "copy_",
            "to",
            "cpu",
        )
        self._saved = {name: getattr(T, name) for name in names}
        self._saved_nonzero = torch.nonzero
        syncs, saved = self, self._saved

        def reader(name, answer):
            original = saved[name]

            def read(t, *args, **kwargs):
                if t.device.type != "meta":
                    return original(t, *args, **kwargs)
                syncs._count()
                return answer(t)

            return read

        patch(T, "item", reader("item", lambda t: False if t.dtype == torch.bool else 0))
        zeros = lambda t: torch.zeros(t.shape, dtype=t.dtype).tolist()
        patch(T, "tolist", reader("tolist", self.answers.get("tolist", zeros)))
        patch(T, "__bool__", reader("__bool__", lambda t: True))
        patch(T, "__int__", reader("__int__", lambda t: 1))
        patch(T, "__index__", reader("__index__", lambda t: 1))
        patch(T, "__float__", reader("__float__", lambda t: 0.0))

        def nonzero(t, *args, **kwargs):
            if t.device.type != "meta":
                return syncs._saved_nonzero(t, *args, **kwargs)
            syncs._count()  # the result's length is the data's: read on the host
            rows = t.shape[0] if t.dim() else 1
            return torch.zeros(rows, max(t.dim(), 1), dtype=torch.long, device=t.device)

        patch(T, "nonzero", nonzero)
        patch(torch, "nonzero", nonzero)
        patch(T, "cpu", reader("cpu", lambda t: torch.zeros(t.shape, dtype=t.dtype)))

        def copy_(t, src, *args, **kwargs):
            if t.device.type != "meta" and isinstance(src, torch.Tensor) and src.device.type == "meta":
                syncs._count()  # a device-to-host copy: the stream waits for it
                return t
            return saved["copy_"](t, src, *args, **kwargs)

        def to(t, *args, **kwargs):
            if t.device.type == "meta":
                device = torch._C._nn._parse_to(*args, **kwargs)[0]
                if device is not None and device.type != "meta":
                    syncs._count()
                    dtype = torch._C._nn._parse_to(*args, **kwargs)[1] or t.dtype
                    return torch.zeros(t.shape, dtype=dtype, device=device)
            return saved["to"](t, *args, **kwargs)

        patch(T, "copy_", copy_)
        patch(T, "to", to)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        patch(torch, "nonzero", self._saved_nonzero)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@contextlib.contextmanager
def accelerator_on_meta(capability: tuple[int, int] | None):
    """What goat_dist and megatron-core ask of CUDA, answered with the meta device: ``torch.cuda``'s
    current device (megatron allocates its TP weights and buffers there), the accelerator a collective
    moves a host tensor to and the device types a group serves (``collectives``: NCCL serves only the
    device, the world's group also the host), and the GPU's compute ``capability`` (the kernels')."""
    from .. import collectives
    from ..kernels import backend

    saved = (
        torch.cuda.current_device,
        collectives.accelerator,
        collectives.served_device_types,
        backend.device_capability,
        torch.autocast,
    )
    autocast = torch.autocast

    def served(group=None):
        import torch.distributed as dist

        world = group is None or group is dist.group.WORLD
        return {"cpu", "meta"} if world else {"meta"}

    patch(torch.cuda, "current_device", lambda: "meta")
    patch(collectives, "accelerator", lambda: META)
    patch(collectives, "served_device_types", served)
    patch(backend, "device_capability", lambda device=None: capability)
    # torch.autocast knows no meta device: the CPU's stands in (the code's own device_type is meta)
    patch(
        torch,
        "autocast",
        lambda device_type, *a, **k: autocast("cpu" if device_type == "meta" else device_type, *a, **k),
    )
    try:
        yield
    finally:
        for owner, name, value in zip(
            (torch.cuda, collectives, collectives, backend, torch),
            ("current_device", "accelerator", "served_device_types", "device_capability", "autocast"),
            saved,
        ):
            setattr(owner, name, value)
