"""``goat-dist study <config>``: train several position schemes identically over several seeds, evaluate
each at multiples of the training length, and write tables, JSON and plots with error bars.

Why one command: the claim under test (a learned prior extrapolates; RoPE does not) is a comparison, and
a comparison is only fair when every run shares the config, data, schedule and evaluation protocol, and
only believable when the differences exceed what a change of seed does. The study config:

    out: runs/study-extrapolation       # relative to the working directory
    train_config: base.yaml             # relative to the study config
    overrides: []                       # shared by every run
    seeds: [1, 2, 3]                    # train.seed of each repetition (default: the config's own seed)
    # or sequential: seeds 1..max, looks at min..max, stop when the primary comparison crosses
    # seeds: {min: 3, max: 10, stop_when: resolved, boundary: obrien-fleming}   (or pocock; looks: [...])
    runs: {goat: [model.position=goat], rope: [model.position=rope], ...}
    compare: [[goat, alibi], ...]       # paired differences to test (default: every pair)
    primary: {a: goat, b: alibi, length: 1}   # the comparison the study decides (metric: loss)
    alpha: 0.05                         # the level of every paired t-test (and of the sequential rule)
    effect_size_nats: 0.065             # power is reported at this difference (passkey: effect_size_accuracy)
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
are unchanged, an interrupted one resumes, ``--force`` retrains (it deletes only run dirs the study created,
marked by their ``study_run.json``, and none a trainer holds: ``runs.py``). Evaluation runs in this
process (TP = 1).

The statistics: every number is reported as mean +- standard deviation over seeds (and per seed). A
difference between two runs is tested on the paired per-seed differences (the same seed gives every
run the same data order, so pairing removes the part of the seed noise the runs have in common): a
two-sided paired t-test at ``alpha``, with its p-value, the (1 - alpha) interval, and the power at the
effect size for the seeds run at the scatter seen; *resolved* means p < alpha; one seed resolves
nothing. With sequential seeds the primary comparison is judged by a group-sequential boundary that
keeps the chance of a false "resolved" at alpha over all looks (``sequential.py``, docs/study.md).
"""

from .main import run_study
from .spec import StudyError, load_study

__all__ = ["StudyError", "load_study", "run_study"]
