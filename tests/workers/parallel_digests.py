"""Worker of tests/integration/checkpoint/test_checkpoint_scale.py (2 ranks over gloo, no model): the
manifest's digests and the resume check are computed in parallel shares, and a problem found on any rank is
raised on every rank.

    torchrun --nproc_per_node=2 tests/workers/parallel_digests.py <step_dir> <out_dir>
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

# only what the digests need (the manager pulls in megatron: seconds of imports per rank)
from goat_dist.checkpoint import digests
from goat_dist.checkpoint.errors import CheckpointError
from goat_dist.checkpoint.names import MANIFEST


def outcome(fn) -> str:
    try:
        fn()
    except CheckpointError as e:
        return str(e)
    return "ok"


def main() -> None:
    step_dir, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    hashed: list[str] = []
    original = digests.digest

    def recording(path):
        hashed.append(str(Path(path).relative_to(step_dir)))
        return original(path)

    digests.digest = recording
    files = digests.digest_files(step_dir)  # rank 0's; the others receive none
    everything = [files]
    dist.broadcast_object_list(everything, src=0)
    # a file its writer already hashed (rank 1 here) is not read again; a wrong size for one is an error
    before = len(hashed)
    known = {"a.pt": everything[0]["a.pt"]} if rank == 1 else {}
    again = digests.digest_files(step_dir, known=known)
    rehashed = hashed[before:]
    wrong = {"a.pt": {**everything[0]["a.pt"], "bytes": 1}} if rank == 1 else {}
    resized = outcome(lambda: digests.digest_files(step_dir, known=wrong))
    del hashed[before:]
    digests.digest = original
    if rank == 0:
        (step_dir / MANIFEST).write_text(json.dumps({"files": files, "step": 7}))
    dist.barrier()
    intact = outcome(lambda: digests.verify(step_dir, parallel=True))
    dist.barrier()
    if rank == 0:  # the same size, one byte flipped: only a checksum finds it
        victim = step_dir / "b.bin"
        data = bytearray(victim.read_bytes())
        data[10] ^= 0xFF
        victim.write_bytes(bytes(data))
    dist.barrier()
    corrupt = outcome(lambda: digests.verify(step_dir, parallel=True))
    sizes_only = outcome(lambda: digests.verify(step_dir, checksums=False, parallel=True))
    writer_failed = outcome(lambda: digests.digest_files(step_dir, error="disk full" if rank == 1 else ""))
    result = {
        "files": files,
        "hashed": hashed,
        "again_same": again == files,
        "rehashed": rehashed,
        "resized": resized,
        "intact": intact,
        "corrupt": corrupt,
        "sizes_only": sizes_only,
        "writer_failed": writer_failed,
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
