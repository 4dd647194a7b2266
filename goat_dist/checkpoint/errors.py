"""Checkpoint errors (their own module: the loaders and the manager both raise them)."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or unsafe; the message names the step and the file."""


def raise_on_every_rank(error: str, fallback: str) -> None:
    """Collective: if any rank found an ``error``, every rank raises (its own message, or ``fallback``),
    so all stop together and none goes on to load a partial checkpoint or hang in a later collective."""
    import torch
    import torch.distributed as dist

    failed = torch.tensor([1 if error else 0])
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item():
        raise CheckpointError(error or fallback)
