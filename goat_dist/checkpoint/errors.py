"""Checkpoint errors (their own module: the loaders and the manager both raise them)."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or unsafe; the message names the step and the file."""
