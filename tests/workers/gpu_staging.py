"""GPU check of checkpoint staging (goat_dist/checkpoint/staging.py), needing only torch: device-to-host
copies into pinned buffers, storage sharing kept, values frozen, pinned buffers reused by the next save,
and the training loop's pause (staging) vs a synchronous ``torch.save`` of the same state.

    python tests/workers/gpu_staging.py [GB of state, default 1.75: a 7B model's state over 64 ranks]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from goat_dist.checkpoint import staging  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def checks(tmp: Path) -> dict:
    w = torch.randn(1000, 64, device=DEV)
    flat = torch.randn(4096, device=DEV)
    sd = {
        "emb": w,
        "out": w,
        "a": flat[:1000].view(10, 100),
        "b": flat[1000:3000],
        "p": torch.nn.Parameter(torch.ones(3, device=DEV)),
        "n": 3,
        "l": [flat[5:9]],
    }
    buffers = staging.HostBuffers()
    st = staging.stage(sd, buffers)
    staging.synchronize()
    ok = {
        "pinned": all(st[k].is_pinned() for k in ("emb", "a")) if CUDA else None,
        "tied_shared": ptr(st["emb"]) == ptr(st["out"]),
        "views_shared": ptr(st["a"]) == ptr(st["b"]) == ptr(st["l"][0]),
        "values": all(torch.equal(st[k], sd[k].detach().cpu()) for k in ("emb", "a", "b", "p")),
        "parameter_kept": isinstance(st["p"], torch.nn.Parameter),
    }
    w.add_(1.0)
    flat.zero_()
    sync()
    ok["frozen"] = not torch.equal(st["emb"], w.cpu()) and st["b"].abs().sum().item() > 0
    before = sorted(b.data_ptr() for b in buffers.in_use)
    buffers.release()
    again = staging.stage(sd, buffers)
    staging.synchronize()
    ok["pinned_reused"] = sorted(b.data_ptr() for b in buffers.in_use) == before if CUDA else None
    ok["values_after_reuse"] = torch.equal(again["emb"], w.cpu())
    writer = staging.BackgroundWriter(tmp, buffers)
    staging.queue_torch_save(writer, sd, tmp / "x.pt")
    writer.start()
    writer.wait()
    writer.close()
    back = torch.load(tmp / "x.pt", weights_only=True)
    shared = ptr(back["emb"]) == ptr(back["out"])
    ok["written"] = not writer.error and torch.equal(back["emb"], w.cpu()) and shared
    return ok


def timing(tmp: Path, gb: float) -> dict:
    n = int(gb * 1e9 / 4 / 8)
    big = {f"t{i}": torch.randn(n, device=DEV) for i in range(8)}
    sync()
    t0 = time.perf_counter()
    torch.save(big, tmp / "sync.pt")
    os.sync()
    sync_s = time.perf_counter() - t0
    os.remove(tmp / "sync.pt")
    pool, runs = staging.HostBuffers(), []
    for rep in range(3):  # the first allocates (pinned on CUDA), the next reuse
        writer = staging.BackgroundWriter(tmp, pool)
        t0 = time.perf_counter()
        staging.queue_torch_save(writer, big, tmp / f"a{rep}.pt")
        writer.start()
        pause = time.perf_counter() - t0
        writer.wait()
        runs.append({"pause_s": pause, "published_s": time.perf_counter() - t0})
        writer.close()
        os.remove(tmp / f"a{rep}.pt")
    return {
        "gb": 8 * n * 4 / 1e9,
        "sync_torch_save_s": sync_s,
        "async": runs,
        "pause_over_sync_first": runs[0]["pause_s"] / sync_s,
        "pause_over_sync_reused": runs[-1]["pause_s"] / sync_s,
    }


def main() -> None:
    gb = float(sys.argv[1]) if len(sys.argv) > 1 else 1.75
    out = {"device": torch.cuda.get_device_name() if CUDA else "cpu", "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        out["ok"] = checks(Path(tmp))
        out["timing"] = timing(Path(tmp), gb)
    print(json.dumps(out, indent=1))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_staging.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
