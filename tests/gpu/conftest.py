"""With ``GOAT_TESTS_JSONL`` set (``bench/gpu_suite.sh`` sets it), one JSON line per finished test, written
as it finishes: a run cut short by its timeout still leaves every result it reached."""

from __future__ import annotations

import json
import os


def pytest_runtest_logreport(report):
    path = os.environ.get("GOAT_TESTS_JSONL")
    if not path or not (report.when == "call" or report.outcome != "passed"):
        return  # a test's result: its call, or the setup / teardown that failed or skipped it
    line = {"test": report.nodeid, "when": report.when, "outcome": report.outcome,
            "seconds": round(report.duration, 3)}  # fmt: skip
    if report.outcome != "passed":
        line["message"] = str(report.longrepr)[-2000:]
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
