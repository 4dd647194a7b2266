"""Run a pytest selection several times in a row, optionally under a CPU load this script adds itself.

Why: a test whose premise depends on the machine's speed passes on a quiet machine and fails on a busy
one (or the other way round). Repeating it idle and loaded is how such a premise shows.

    python bench/repeat_tests.py tests/integration/slurm/test_slurm.py --runs 5 --loaded 2

The first ``--loaded`` runs have one busy-loop process per core (started before, ended after each run);
the rest run on the machine as it is. Prints one line per run and a summary; exit 1 if any run failed.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import subprocess
import sys
import time


def _spin() -> None:
    while True:
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tests", nargs="+", help="pytest arguments (files, -k ...)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--loaded", type=int, default=2, help="how many of the runs get a busy loop per core")
    ap.add_argument("--log-dir", default="repeat-logs", help="each run's pytest output goes here")
    args = ap.parse_args()
    os.makedirs(args.log_dir, exist_ok=True)
    # as if this Python's environment were activated: scripts the tests start find its `python`
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    results = []
    for run in range(args.runs):
        loaded = run < args.loaded
        spinners = []
        if loaded:
            spinners = [
                multiprocessing.Process(target=_spin, daemon=True) for _ in range(os.cpu_count() or 1)
            ]
            for p in spinners:
                p.start()
        load_before = os.getloadavg()[0]
        start = time.monotonic()
        log = os.path.join(args.log_dir, f"run{run + 1}.log")
        with open(log, "w") as out:
            proc = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", *args.tests],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        seconds = time.monotonic() - start
        load_after = os.getloadavg()[0]
        for p in spinners:
            p.terminate()
            p.join()
        text = open(log).read()
        summary = re.findall(r"^=*\s*(\d+ (?:passed|failed).*?) in [\d.]+s", text, re.M)
        line = (
            f"run {run + 1}: {'loaded (1 busy loop per core)' if loaded else 'as is'}; "
            f"load {load_before:.1f} -> {load_after:.1f}; exit {proc.returncode}; "
            f"{summary[-1] if summary else '?'}; {seconds:.0f} s"
        )
        print(line, flush=True)
        results.append(proc.returncode)
    failed = sum(1 for rc in results if rc)
    print(f"{args.runs - failed} of {args.runs} runs passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
