"""``goat-dist study <config>``: train several position schemes identically over several seeds, evaluate
each at multiples of the training length, and write tables, JSON and plots with error bars.

Why one command: the claim under test (a learned prior extrapolates; RoPE does not) is a comparison, and
a comparison is only fair when every run shares the config, data, schedule and evaluation protocol, and
only believable when the differences exceed what a change of seed does. The study config:

    out: runs/study-extrapolation       # relative to the working directory
    train_config: base.yaml             # relative to the study config
    overrides: []                       # shared by every run
    seeds: [1, 2, 3]                    # train.seed of each repetition (default: the config's own seed)
    runs: {goat: [model.position=goat], rope: [model.position=rope], ...}
    compare: [[goat, alibi], ...]       # paired differences to test (default: every pair)
    plots: {study: [goat, alibi, ...]}  # one picture per entry (default: study: every run)
    eval: {task: ppl, multiples: [1, 2, 4, 8], tokens: 16384, split: val, batch_tokens: 8192}
    quick: {seeds: [1], overrides: [train.max_steps=40], eval: {tokens: 4096}}   # --quick
    jobs: 2                             # trainings at once (default 1)
    threads: 1                          # torch threads per training and for evaluation (CPUs / jobs)

``eval.task: passkey`` (``multiples, depths, samples, seed, batch_tokens``) scores passkey retrieval
instead of perplexity. Why ``jobs`` and ``threads``: on a shared machine a two-thread training waits at
every parallel region for its descheduled other thread (measured on the loaded 2-core development
machine: 1.1k tokens/s with 2 threads, 4-5k with 1, at the same time); one-thread jobs side by side
lose nothing to that. Each (run, seed) trains in its own ``goat-dist train`` process into
``<out>/<run>/seed<k>`` (``<out>/<run>`` without ``seeds``); a finished run is reused when its settings
are unchanged, an interrupted one resumes, ``--force`` retrains. Evaluation runs in this process (TP = 1).

The statistics: every number is reported as mean +- standard deviation over seeds (and per seed). A
difference between two runs is *resolved* only when the mean of the paired per-seed differences
exceeds 2 standard errors of those differences (the same seed gives every run the same data order, so
pairing removes the part of the seed noise the runs have in common); one seed resolves nothing.
"""

from .main import run_study
from .spec import StudyError, load_study

__all__ = ["StudyError", "load_study", "run_study"]
