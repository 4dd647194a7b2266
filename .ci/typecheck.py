#!/usr/bin/env python3
"""mypy on goat_dist/ against a baseline that may only shrink.

    python .ci/typecheck.py            # CI: fail on any error the baseline lacks, or on a baseline left stale
    python .ci/typecheck.py --update   # rewrite .ci/typecheck-baseline.txt from today's errors

mypy's settings are pyproject.toml's [tool.mypy]. The baseline counts errors per (file, error code, message),
without line numbers, so code moving inside a file changes nothing. CI fails when

* a (file, code, message) occurs more often than the baseline says: a new error; fix it (or, where mypy is
  wrong, silence that line with `# type: ignore[code]` and a reason);
* it occurs less often: an error was fixed; run `python .ci/typecheck.py --update` and commit the smaller
  baseline with the fix, so it can only shrink.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = ROOT / ".ci" / "typecheck-baseline.txt"
UPDATE = "python .ci/typecheck.py --update"

Key = tuple[str, str, str]  # (file, error code, message)


def _normalise(message: str) -> str:
    """A message without the line numbers some of mypy's carry ("defined on line 12", "x.py:12")."""
    message = re.sub(r"\bline \d+", "line N", message)
    return re.sub(r"(\.pyi?):\d+", r"\1:N", message)


def parse(output: str) -> tuple[Counter[Key], dict[Key, list[str]], list[str]]:
    """mypy's `-O json` output -> (count per key, where each key occurs, lines that were not JSON)."""
    counts: Counter[Key] = Counter()
    where: dict[Key, list[str]] = {}
    other = []
    for line in output.splitlines():
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            other.append(line)
            continue
        if entry.get("severity") != "error":
            continue
        path = str(entry["file"]).replace("\\", "/")
        key = (path, str(entry.get("code") or "misc"), _normalise(str(entry["message"])))
        counts[key] += 1
        where.setdefault(key, []).append(f"{path}:{entry.get('line')}: error: {entry['message']}  [{key[1]}]")
    return counts, where, other


def read_baseline(text: str) -> Counter[Key]:
    counts: Counter[Key] = Counter()
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        try:
            count, path, code, message = line.split("\t", 3)
            counts[(path, code, message)] += int(count)
        except ValueError as e:
            want = "count<TAB>file<TAB>code<TAB>message"
            raise SystemExit(f"{BASELINE.name}:{n}: not `{want}`: {line!r}") from e
    return counts


def baseline_version(text: str) -> str | None:
    m = re.search(r"^# mypy (\S+)", text, re.M)
    return m.group(1) if m else None


def format_baseline(counts: Counter[Key], version: str) -> str:
    by_code = Counter()
    for (_, code, _), n in counts.items():
        by_code[code] += n
    head = [
        f"# mypy {version} on goat_dist/ (pyproject.toml [tool.mypy]): {sum(counts.values())} errors.",
        "# Known errors, counted per file, error code and message (no line numbers). It may only shrink:",
        f"# .ci/run fails on an error not listed here, and on one listed but fixed. Rewrite: {UPDATE}",
        "# by code: " + ", ".join(f"{code} {n}" for code, n in by_code.most_common()),
        "# count\tfile\tcode\tmessage",
    ]
    body = [f"{n}\t{p}\t{c}\t{m}" for (p, c, m), n in sorted(counts.items()) if n > 0]
    return "\n".join(head + body) + "\n"


def compare(current: Counter[Key], baseline: Counter[Key]) -> tuple[dict[Key, int], dict[Key, int]]:
    """(new: key -> how many more than the baseline, fixed: key -> how many fewer)."""
    new = {k: n - baseline[k] for k, n in current.items() if n > baseline[k]}
    fixed = {k: n - current[k] for k, n in baseline.items() if n > current[k]}
    return new, fixed


def verdict(
    current: Counter[Key], where: dict[Key, list[str]], baseline: Counter[Key], note: str = ""
) -> tuple[int, str]:
    """The exit status and what to print."""
    new, fixed = compare(current, baseline)
    lines = []
    if new:
        lines.append(f"typecheck: {sum(new.values())} new mypy error(s), not in .ci/typecheck-baseline.txt:")
        for key in sorted(new):
            if baseline[key]:
                more = f"{new[key]} more than the baseline's {baseline[key]}; all of them:"
                lines.append(f"  {key[0]}: [{key[1]}] {key[2]} ({more})")
            lines.extend(f"  {w}" for w in where.get(key, [f"{key[0]}: error: {key[2]}  [{key[1]}]"]))
        lines.append(
            "Fix them (where mypy is wrong: `# type: ignore[code]` on that line, saying why). The baseline "
            "only lists errors that were there before it; it is not the place for new ones."
        )
    if fixed:
        lines.append(f"typecheck: {sum(fixed.values())} baselined error(s) no longer occur:")
        for (p, c, m), n in sorted(fixed.items()):
            lines.append(f"  {p}: [{c}] {m}" + (f" (x{n})" if n > 1 else ""))
        lines.append(f"Good: shrink the baseline in the same commit: {UPDATE}")
    if new or fixed:
        if note:
            lines.append(note)
        return 1, "\n".join(lines)
    return 0, f"typecheck: mypy's {sum(current.values())} errors are the baseline's; nothing new."


def run_mypy() -> tuple[int, str, str, str]:
    import mypy.version

    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "-O", "json"], cwd=ROOT, capture_output=True, text=True
    )
    return proc.returncode, proc.stdout, proc.stderr, mypy.version.__version__


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--update", action="store_true", help="rewrite the baseline from today's errors")
    ap.add_argument("--baseline", type=Path, default=BASELINE, help=argparse.SUPPRESS)
    ap.add_argument("--mypy-output", type=Path, help=argparse.SUPPRESS)  # tests: mypy's -O json output
    ap.add_argument("--mypy-version", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.mypy_output is not None:
        rc, out, err, version = 1, args.mypy_output.read_text(), "", args.mypy_version or "test"
    else:
        rc, out, err, version = run_mypy()
    current, where, other = parse(out)
    if rc not in (0, 1) or (rc == 1 and not current):
        # 2: mypy stopped (a file it cannot parse, a bad setting) before checking everything
        print(out + err, end="")
        print(f"typecheck: mypy exited with {rc} without a full report; fix what it says above")
        return 1

    text = args.baseline.read_text() if args.baseline.exists() else ""
    baseline = read_baseline(text)
    if args.update:
        new, fixed = compare(current, baseline)
        args.baseline.write_text(format_baseline(current, version))
        print(
            f"typecheck: wrote {args.baseline.name}: {sum(current.values())} errors "
            f"({sum(fixed.values())} fewer, {sum(new.values())} added)"
        )
        if new and text:
            print("typecheck: added to the baseline (new errors: fix them rather than baseline them?):")
            for key in sorted(new):
                print("\n".join(f"  {w}" for w in where[key]))
        return 0

    note = ""
    was = baseline_version(text)
    if was and was != version:
        note = f"(the baseline was written by mypy {was}, this is mypy {version}: update both)"
    code, message = verdict(current, where, baseline, note)
    print(message)
    return code


if __name__ == "__main__":
    sys.exit(main())
