"""Evaluating trained checkpoints: ``goat-dist eval ppl|passkey`` and ``goat-dist study``.

``checkpoint`` loads a model at any tensor-parallel size through the safetensors path; ``session`` sets
up one evaluation (process groups, device, data); ``perplexity`` and ``passkey`` measure; ``reports``
turns a measurement into JSON and a picture drawn by ``plots``; ``commands`` is the command line;
``study`` runs the extrapolation study end to end.
"""


class EvalError(ValueError):
    """An evaluation that cannot run as asked (a length a model cannot represent, too little data)."""
