"""What one rank reads to resume on another layout: files opened and bytes against its share, per change.

Two worlds, through the real read path (``tests/workers/share_reads.py``):

* **4 ranks, real files**: a 16.5M-parameter model saved by 4 ranks (the real writer: every state file,
  RNG file, index and manifest), resumed by every rank of each new layout in one process: the manifest,
  run state and RNG file (``manager.read_run_files``), then the rank's ranges (``universal.read_into``), or
  its reads by file for a ZeRO-stage change (``exchange.Exchange``, the all-to-all played in process).
  Counted per rank: files opened (Python's audit hook), bytes read (``/proc/self/io`` ``rchar``).
* **512 ranks, planned**: configs/models/goat_30b.yaml saved by 512 ranks, its state files stood in for
  (their header and checksum sizes computed by the writer's own code), the real index and reader; sampled
  ranks. The manifest read (``manifest.json`` and the parts of the files a rank opens) is measured on a
  real manifest of the 512 ranks' file names.

Prints one row per layout change: state files opened per rank (min-max), manifest bytes read per rank,
and bytes read / the rank's share (the fp32 value and both Adam moments of what it holds).

    python bench/resume_reads.py [--skip-512]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

# (label, saved (dp, tp, stage), resumed (dp, tp, stage), by file)
CHANGES_4 = [
    ("same layout", (4, 1, 3), (4, 1, 3), False),
    ("DP 4 -> 2", (4, 1, 3), (2, 1, 3), False),
    ("DP 4 -> 8", (4, 1, 3), (8, 1, 3), False),
    ("TP 1 -> 2", (4, 1, 3), (2, 2, 3), False),
    ("TP 1 -> 4", (4, 1, 3), (1, 4, 3), False),
    ("TP 4 -> 1", (1, 4, 3), (4, 1, 3), False),
    ("ZeRO 1 -> 3", (4, 1, 1), (4, 1, 3), True),
    ("ZeRO 3 -> 1", (4, 1, 3), (4, 1, 1), True),
]
CHANGES_512 = [
    ("same layout", (512, 1, 3), (512, 1, 3), False, (0, 1, 511)),
    ("DP 512 -> 1024", (512, 1, 3), (1024, 1, 3), False, (0, 1, 1023)),
    ("TP 1 -> 8", (512, 1, 3), (64, 8, 3), False, (7,)),
    ("TP 8 -> 1", (64, 8, 3), (512, 1, 3), False, (511,)),
    ("ZeRO 1 -> 3", (512, 1, 1), (512, 1, 3), True, (0, 255)),
    ("ZeRO 3 -> 1", (512, 1, 3), (512, 1, 1), True, (0, 255)),
]


def _manifest_bytes(step_dir: Path, opened: list[str]) -> int:
    return sum(
        (step_dir / n).stat().st_size for n in set(opened) if n == "manifest.json" or n.startswith("digests/")
    )


def _row(label: str, files: list[int], manifest: list[int], ratios: list[float], ranks: str) -> None:
    print(
        f"  {label:<15} {ranks:>10}  state files {min(files)}-{max(files):<4} manifest "
        f"{min(manifest):,}-{max(manifest):,} B   read/share {min(ratios):.3f}-{max(ratios):.3f}"
    )


def four_ranks(tmp: Path) -> None:
    from workers import share_reads

    from goat_dist import distributed

    distributed.init(tp=1)
    params = share_reads.inventory()
    print(f"4 ranks, real files ({sum(1 for _ in params)} parameters, 16.5M elements):")
    saved_dirs: dict = {}
    for label, saved, new, by_file in CHANGES_4:
        step_dir = saved_dirs.get(saved)
        if step_dir is None:
            dp, tp, stage = saved
            step_dir = saved_dirs[saved] = tmp / f"dp{dp}tp{tp}z{stage}" / "step_00000007"
            share_reads.write_world(step_dir, params, dp, tp=tp, stage=stage)
        dp, tp, stage = new
        if by_file:
            reads = share_reads.read_world_by_file(step_dir, params, dp, stage, tp=tp)
        else:
            reads = [
                share_reads.read_rank(step_dir, params, dp, r, tp=tp, stage=stage) for r in range(dp * tp)
            ]
        assert all(r["exact"] for r in reads), label
        _row(
            label,
            [len(r["state_files"]) for r in reads],
            [_manifest_bytes(step_dir, r["opened"]) for r in reads],
            [r["bytes"] / r["share_bytes"] for r in reads],
            f"{len(reads)} ranks",
        )


def planned_512(tmp: Path) -> None:
    from workers import share_reads

    from goat_dist.checkpoint.digests import read_manifest
    from goat_dist.checkpoint.manager import write_manifest

    params = share_reads.inventory_30b()
    print("512 ranks, planned (configs/models/goat_30b.yaml, 30.0B parameters; sampled ranks):")
    for label, saved, new, by_file, ranks in CHANGES_512:
        dp, tp, stage = saved
        root = tmp / f"plan-dp{dp}tp{tp}z{stage}"
        if not (root / "universal" / "index.json").is_file():
            _, planned = share_reads.plan_world(root, params, dp, tp=tp, stage=stage)
            stand_in = {"bytes": 700_000_000, "sha256": "0" * 64, "header_sha256": "0" * 64}
            files = {name: stand_in for name in planned["files"]}
            files.update({f"rng_rank{r}.pt": {"bytes": 1500, "sha256": "0" * 64} for r in range(dp * tp)})
            files.update({"trainer_state.json": {"bytes": 300, "sha256": "0" * 64}})
            write_manifest(root, {"step": 7}, files=files)
            (root / "planned.json").write_text(json.dumps(planned))
        planned = json.loads((root / "planned.json").read_text())
        ndp, ntp, nstage = new
        files_n, manifest_n, ratios = [], [], []
        for rank in ranks:
            plan = share_reads.plan_rank(
                root, params, planned, ndp, rank, tp=ntp, stage=nstage, by_file=by_file
            )
            manifest = read_manifest(root)  # what this rank reads of the manifest: the top and its parts
            for name in {"trainer_state.json", "universal/index.json", *plan["files"]}:
                manifest["files"][name]
            if (ndp, ntp, nstage) == saved:
                manifest["files"][f"rng_rank{rank}.pt"]
            manifest_n.append(_manifest_bytes(root, ["manifest.json", *manifest["files"].parts_read()]))
            files_n.append(len(plan["files"]))
            ratios.append(plan["bytes"] / plan["share_bytes"])
        _row(label, files_n, manifest_n, ratios, f"{len(ranks)} sampled")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-512", action="store_true", help="the 4-rank table only")
    args = ap.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        four_ranks(Path(tmp))
        if not args.skip_512:
            planned_512(Path(tmp))
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
