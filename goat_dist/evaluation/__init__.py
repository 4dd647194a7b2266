"""Evaluating trained checkpoints: ``goat-dist eval ppl|passkey`` and ``goat-dist study``.

``checkpoint`` loads a model at any tensor-parallel size through the safetensors path; ``session`` sets
up one evaluation (process groups, device, data); ``perplexity`` and ``passkey`` measure; ``reports``
turns a measurement into JSON and a picture drawn by ``plots``; ``commands`` is the command line;
``study`` runs the extrapolation study end to end; ``data_check`` holds the evaluated data to the model's
tokenizer and names each data set's results file.

May import: torch, ``goat_dist.atomic`` (results written whole), ``goat_dist.collectives``,
``goat_dist.config``, ``goat_dist.precision``, ``goat_dist.distributed``, ``goat_dist.launcher``,
``goat_dist.data``, ``goat_dist.model``, ``goat_dist.checkpoint`` (loading at any TP size),
``goat_dist.inference`` (a Hugging Face export mapped back),
``goat_dist.run_lock`` (a study's ``--force`` deletes no run a trainer holds) and ``goat_dist.observe``
(pictures); never the trainer (a study runs ``goat-dist train`` as a process).
"""


class EvalError(ValueError):
    """An evaluation that cannot run as asked (a length a model cannot represent, too little data)."""
