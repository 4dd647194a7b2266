"""Every collective outside ``goat_dist/engine/`` goes through ``goat_dist.collectives``, which puts a
tensor where the group's backend can reduce it.

NCCL reduces only device tensors. On a CPU machine a group whose backend is registered for the ``cuda``
device type only (``backend="cuda:gloo"``) refuses a host tensor exactly as an NCCL group does on a GPU
machine ("No backend type associated with device type cpu"): that stand-in is the group these tests
declare NCCL-only. The device move itself needs a GPU, so the last test mocks it and checks the path a
host tensor takes: to the device, through the collective, back into the caller's tensor."""

from __future__ import annotations

import ast
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from goat_dist import collectives

PACKAGE = Path(collectives.__file__).resolve().parent
EXEMPT = {PACKAGE / "collectives.py"}
EXEMPT_DIRS = {PACKAGE / "engine"}  # DeepSpeed's own tensors, on the engine's device


def direct_collectives(source: str) -> list[str]:
    """``line: call`` for each ``torch.distributed`` collective called directly in ``source``: through an
    alias of the module (``import torch.distributed as dist``; ``from torch import distributed``), the
    full dotted name, or a name imported from it (``from torch.distributed import all_reduce``)."""
    tree = ast.parse(source)
    aliases, names = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed" and a.asname:
                    aliases.add(a.asname)
        elif isinstance(node, ast.ImportFrom):
            if node.module == "torch":
                aliases.update(a.asname or a.name for a in node.names if a.name == "distributed")
            elif node.module == "torch.distributed":
                names.update(a.asname or a.name for a in node.names if a.name in collectives.COLLECTIVES)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in collectives.COLLECTIVES:
            owner = ast.unparse(func.value)
            if owner in aliases or owner == "torch.distributed":
                found.append(f"{node.lineno}: {ast.unparse(func)}")
        elif isinstance(func, ast.Name) and func.id in names:
            found.append(f"{node.lineno}: {func.id}")
    return found


def product_sources() -> list[Path]:
    return [
        p
        for p in sorted(PACKAGE.rglob("*.py"))
        if p not in EXEMPT and not any(d in p.parents for d in EXEMPT_DIRS)
    ]


def test_no_direct_collective_outside_the_home():
    offenders = {
        str(p.relative_to(PACKAGE.parent)): calls
        for p in product_sources()
        if (calls := direct_collectives(p.read_text()))
    }
    assert not offenders, f"call these through goat_dist.collectives: {offenders}"


@pytest.mark.parametrize(
    "planted",
    [
        "import torch.distributed as dist\ndef f(t, g):\n    dist.all_reduce(t, group=g)\n",
        "import torch\ndef f(t):\n    torch.distributed.broadcast(t, src=0)\n",
        "from torch import distributed as d\ndef f(xs, t):\n    d.all_gather(xs, t)\n",
        "from torch.distributed import reduce_scatter_tensor as rs\ndef f(a, b):\n    rs(a, b)\n",
        "def f():\n    import torch.distributed as dist\n    dist.barrier()\n",
    ],
)
def test_a_planted_direct_call_is_found(planted):
    assert direct_collectives(planted)


def test_calls_through_the_home_and_non_collectives_pass():
    ok = (
        "import torch.distributed as dist\nfrom goat_dist import collectives\n"
        "def f(t):\n    collectives.all_reduce(t)\n    return dist.get_world_size(), dist.get_rank()\n"
    )
    assert direct_collectives(ok) == []


def test_the_stand_in_refuses_a_host_tensor_as_nccl_does(world1):
    nccl_like = dist.new_group([0], backend="cuda:gloo")
    assert collectives.served_device_types(nccl_like) == {"cuda"}
    assert "cpu" in collectives.served_device_types(None)  # the world group's gloo side (CPU: gloo only)
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        dist.all_reduce(torch.ones(2), group=nccl_like)


def test_a_host_tensor_is_placed_on_the_device_of_an_nccl_only_group(world1, monkeypatch):
    nccl_like = dist.new_group([0], backend="cuda:gloo")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    host = torch.tensor([1.0, 2.0], dtype=torch.float64)
    assert collectives.placement(host, nccl_like) == torch.device("cuda", 3)
    assert collectives.placement(host, None) == torch.device("cpu")  # the world group serves the host

    moves, calls = [], []

    def fake_move(tensor, device):  # a mocked device: record the target, hand back a copy
        moves.append(device)
        return tensor.clone()

    def fake_all_reduce(tensor, op=None, group=None):
        calls.append((tensor, group))
        tensor.mul_(3)  # what the other ranks would have added

    monkeypatch.setattr(collectives, "_move", fake_move)
    monkeypatch.setattr(collectives, "dist", types.SimpleNamespace(all_reduce=fake_all_reduce))
    out = collectives.all_reduce(host, group=nccl_like)
    assert moves == [torch.device("cuda", 3)]
    ((reduced, group),) = calls
    assert reduced is not host and group is nccl_like  # the collective saw the device copy
    assert out is host and host.tolist() == [3.0, 6.0]  # the result is back in the caller's host tensor


def test_a_tensor_on_a_served_device_is_not_copied(world1, monkeypatch):
    monkeypatch.setattr(collectives, "_move", lambda *a: pytest.fail("a served tensor was copied"))
    t = torch.ones(3)
    assert collectives.all_reduce(t) is t and t.tolist() == [1.0, 1.0, 1.0]  # world of one: the sum
    assert [p.tolist() for p in collectives.all_gather(t)] == [[1.0, 1.0, 1.0]]
