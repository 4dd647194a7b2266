#!/usr/bin/env bash
# Submit N jobs that run one after another (--dependency=afterany), each continuing the run from its
# latest checkpoint: for clusters with a wall-time limit per job and no (or slow) requeue.
#
#   slurm/chain.sh N [sbatch options ...] slurm/train.sbatch [--max-restarts N] <config.yaml> [overrides ...]
#
# Every job gets the same arguments. GOAT_REQUEUE=0 is exported to the jobs (override by setting it):
# a job that checkpoints at its time limit ends, and the next one continues; a crashed job ends too, so the
# chain's length bounds the retries. Prints the job ids, one per line. SBATCH_PARTITION/SBATCH_ACCOUNT and
# the rest of slurm/site.env apply when it is sourced first (`source slurm/site.env`).
set -euo pipefail

die() {
    echo "chain.sh: $*" >&2
    exit 2
}
[[ $# -ge 2 ]] || die "usage: slurm/chain.sh N [sbatch options ...] <job script> [script arguments ...]"
N="$1"
shift
[[ "$N" =~ ^[1-9][0-9]*$ ]] || die "N must be a positive integer, got '$N'"
export GOAT_REQUEUE="${GOAT_REQUEUE:-0}"

PREV=""
for ((i = 1; i <= N; i++)); do
    DEP=()
    [[ -z "$PREV" ]] || DEP=(--dependency="afterany:$PREV")
    OUT=$(sbatch --parsable "${DEP[@]}" "$@") || die "sbatch failed for link $i of $N"
    PREV="${OUT%%;*}"
    echo "$PREV"
done
