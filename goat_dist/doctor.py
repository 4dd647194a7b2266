"""``goat-dist doctor``: a preflight that fails fast, naming what is wrong, before hours of queueing are
spent on a job that cannot train.

Run it alone (``goat-dist doctor --config cfg.yaml [overrides]``), under ``torchrun``, or as every rank of a
Slurm job (``slurm/train.sbatch`` runs it first). It checks, in this order:

* devices: CUDA devices are visible to every rank (``LOCAL_RANK`` has a device, a small allocation works),
  and GPUs that Slurm allocated are not invisible to torch; on a CPU-only machine: CPU with gloo;
* all-reduce: a correctness check and a timed all-reduce across all ranks (device tensors with NCCL on
  CUDA, gloo on CPU), printing the measured algorithm and bus bandwidth (nccl-tests' definitions);
* run dir: writable from every node, and the same directory on all of them (a file rank 0 writes is
  visible to every node's first rank);
* data: the configured source(s) are reachable (manifest readable, shard files present), or for the
  builtin corpus, its cache is ready or can be built; a local data set's shards (every split) have the
  size its manifest records (a stat per shard, no reads: a truncated copy fails here, not hours into
  training);
* disk: free space on the run dir's file system for the next checkpoint, estimated from the model's
  parameter count (``checkpoint_bytes``);
* write: rank 0 times one process writing a temporary file in the run dir (``--write-mb``, at most a
  quarter of the free space; fsync'd, then deleted) and records the bandwidth in
  ``<run_dir>/checkpoints/write_bandwidth.json``, which the trainer's deadline uses for the first save's
  time until a save has been measured (``trainer/deadline.py``).

Exit status 0 when every check passed on every rank, 1 otherwise (2 for a bad config). Every failing rank
prints its own ``FAIL`` lines with its rank and host; rank 0 prints the summary.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import socket
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

from .config import add_config_arguments

# Bytes per parameter of one checkpoint: every rank writes its share of the fp32 master weights and Adam's
# two moments (12 B, in bf16 and fp32 training alike; ``plan/checkpoint.py`` has the per-rank arithmetic).
BYTES_PER_PARAM = 12
DISK_HEADROOM = 1.10  # manifests, RNG states, config copies, file-system slack
WRITE_BANDWIDTH = "write_bandwidth.json"  # in <run_dir>/checkpoints/: the write check's measurement
WRITE_CHUNK = 8 * 2**20  # bytes per write() of the write check
MIN_WRITE_BYTES = 2**20  # below this (a nearly full disk) the write check is skipped

CHECKS = ("devices", "rendezvous", "all-reduce", "run dir", "data", "disk", "write")


# ---- model size ---------------------------------------------------------------------------------------
def _padded_vocab(vocab_size: int, multiple: int, tp: int) -> int:
    """As ``goat_dist.model.gpt.padded_vocab_size`` (kept import-light: no megatron here)."""
    padded = math.ceil(vocab_size / multiple) * multiple
    if padded % tp:
        padded = math.ceil(vocab_size / (multiple * tp)) * multiple * tp
    return padded


def _ffn(m) -> int:
    if m.ffn_hidden_size:
        return m.ffn_hidden_size
    if m.activation == "gelu":
        return 4 * m.hidden_size
    return 64 * math.ceil(8 * m.hidden_size / 3 / 64)


def parameter_count(model_cfg, tp: int = 1) -> int:
    """Parameters of ``GPT(model_cfg)`` summed over all tensor-parallel ranks, computed from the config
    (no model is built; tests check it against a real model)."""
    from .attention.goat import grouped_qkv_width
    from .attention.prior import GoatPrior

    m = model_cfg
    h, heads = m.hidden_size, m.num_heads
    kv = m.num_kv_heads or heads
    head_dim = h // heads
    vocab = _padded_vocab(m.vocab_size, m.vocab_pad_multiple, tp)
    norm = h if m.norm == "rmsnorm" else (2 * h if m.bias else h)
    bias = 1 if m.bias else 0
    prior, content = 0, head_dim
    if m.position == "goat":
        g = m.goat
        p = GoatPrior(kv, g.pos_rank, g.abs_rank, key_bias=g.key_bias, training_seq_len=m.seq_len)
        prior = sum(t.numel() for t in p.parameters())
        content = head_dim - p.num_lanes
    qkv_width = grouped_qkv_width(kv, heads // kv, content, head_dim)
    ffn = _ffn(m)
    fc1_out = 2 * ffn if m.activation == "swiglu" else ffn
    layer = (
        2 * norm
        + h * qkv_width
        + bias * qkv_width
        + heads * head_dim * h
        + bias * h
        + h * fc1_out
        + bias * fc1_out
        + ffn * h
        + bias * h
        + prior
    )
    total = vocab * h + m.num_layers * layer + norm
    if m.position == "learned":
        total += m.seq_len * h
    if not m.tie_embeddings:
        total += vocab * h
    return total


def checkpoint_bytes(cfg) -> int:
    """Estimated bytes of one whole checkpoint of ``cfg`` (a ``Config``): parameters x 12 B (fp32 masters
    and two Adam moments; each rank writes its share)."""
    return parameter_count(cfg.model, cfg.parallel.tp) * BYTES_PER_PARAM


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


# ---- the checks ------------------------------------------------------------------------------------------
class Report:
    def __init__(self, rank: int, host: str):
        self.rank, self.host = rank, host
        self.failed: set[str] = set()
        self.lines: list[str] = []  # rank 0's ok lines, printed in the summary
        self.bandwidth: dict | None = None  # the all-reduce measurement

    def ok(self, check: str, text: str) -> None:
        self.lines.append(f"  ok    {check}: {text}")

    def warn(self, check: str, text: str) -> None:
        self.lines.append(f"  warn  {check}: {text}")

    def fail(self, check: str, text: str) -> None:
        self.failed.add(check)
        print(f"goat-dist doctor: FAIL {check}: {text} [rank {self.rank} on {self.host}]", file=sys.stderr)
        sys.stderr.flush()

    def mask(self) -> int:
        return sum(1 << i for i, c in enumerate(CHECKS) if c in self.failed)


def _gpus_allocated(environ) -> str | None:
    """What Slurm/the environment says about GPUs for this task, if it says any were given."""
    for name in ("SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "CUDA_VISIBLE_DEVICES"):
        value = environ.get(name, "")
        if value and value not in ("0", "-1", "NoDevFiles") and name != "SLURM_GPUS_ON_NODE":
            return f"{name}={value}"
        if name == "SLURM_GPUS_ON_NODE" and value.isdigit() and int(value) > 0:
            return f"{name}={value}"
    return None


def check_devices(report: Report, environ, local_rank: int, local_world: int):
    import torch

    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if local_rank >= count:
            report.fail(
                "devices",
                f"LOCAL_RANK {local_rank} has no CUDA device: {count} visible "
                f"(CUDA_VISIBLE_DEVICES={environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}). With one task per "
                "GPU every task must see all of its node's GPUs: do not bind GPUs per task (--gpus-per-task, "
                "--gpu-bind); give --gpus-per-node with --ntasks-per-node",
            )
            return None
        device = torch.device("cuda", local_rank)
        try:
            torch.cuda.set_device(device)
            torch.ones(1024, device=device).sum().item()
        except Exception as e:  # a broken or busy GPU
            report.fail(
                "devices", f"cuda:{local_rank} ({torch.cuda.get_device_name(local_rank)}) unusable: {e}"
            )
            return None
        if local_world > count:
            report.warn("devices", f"{local_world} tasks on this node share {count} GPUs")
        report.ok("devices", f"{count} x {torch.cuda.get_device_name(local_rank)} visible; backend nccl")
        return device
    allocated = _gpus_allocated(environ)
    if allocated:
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        report.fail(
            "devices",
            f"GPUs were allocated ({allocated}) but torch {torch.__version__} ({build}) sees none: "
            "install the CUDA build of torch, or check the driver (nvidia-smi) and the module loads in "
            "slurm/site.env",
        )
        return None
    report.ok("devices", f"no CUDA: training runs on CPU with gloo (torch {torch.__version__})")
    return torch.device("cpu")


def init_world(report: Report, device, timeout_s: float) -> bool:
    import torch.distributed as dist

    if dist.is_initialized():
        return True
    backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
    try:
        if "RANK" in os.environ:
            kwargs = {"device_id": device} if backend == "nccl" else {}
            dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s), **kwargs)
        else:
            from .distributed import free_port

            dist.init_process_group(
                backend=backend,
                init_method=f"tcp://127.0.0.1:{free_port()}",
                rank=0,
                world_size=1,
                timeout=timedelta(seconds=timeout_s),
            )
    except Exception as e:
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        report.fail(
            "rendezvous",
            f"cannot join the {backend} process group at {where} within {timeout_s:.0f} s: "
            f"{type(e).__name__}: {e}",
        )
        return False
    return True


def check_all_reduce(report: Report, device, nbytes: int, iters: int) -> None:
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    backend = dist.get_backend()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    probe = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(probe)
    expected = world * (world + 1) / 2
    if not torch.allclose(probe.cpu(), torch.full((4,), expected)):
        report.fail("all-reduce", f"wrong result: {probe.tolist()} instead of {expected} ({backend})")
        return
    n = max(1, nbytes // 4)
    buf = torch.ones(n, dtype=torch.float32, device=device)
    dist.all_reduce(buf)  # warm-up: connections, NCCL channels
    sync()
    times = []
    for _ in range(iters):
        dist.all_reduce(torch.zeros(1, device=device))  # start together
        sync()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        sync()
        times.append(time.perf_counter() - t0)
    # every rank's slowest view counts: the max over ranks of the median time
    median = torch.tensor([sorted(times)[len(times) // 2]], dtype=torch.float64, device=device)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    seconds = float(median.item())
    if world == 1:
        report.ok("all-reduce", f"1 rank, {backend}: correct (no link to measure)")
        return
    algbw = n * 4 / seconds / 1e9
    busbw = algbw * 2 * (world - 1) / world
    report.bandwidth = {"bytes": n * 4, "seconds": seconds, "algbw_GBps": algbw, "busbw_GBps": busbw}
    report.ok(
        "all-reduce",
        f"{world} ranks, {backend}, {_human(n * 4)} x {iters}: {seconds * 1e3:.1f} ms, "
        f"algbw {algbw:.2f} GB/s, busbw {busbw:.2f} GB/s",
    )


def check_run_dir_local(report: Report, run_dir: Path) -> bool:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".doctor-{socket.gethostname()}-{os.getpid()}"
        with open(probe, "wb") as f:
            f.write(b"goat-dist doctor\n")
            f.flush()
            os.fsync(f.fileno())
        ok = probe.read_bytes() == b"goat-dist doctor\n"
        probe.unlink()
        if not ok:
            report.fail("run dir", f"{run_dir}: a file written there reads back differently")
        return ok
    except OSError as e:
        report.fail("run dir", f"{run_dir} is not writable: {e}")
        return False


def _reachable_url(url: str, timeout: float = 20.0) -> str | None:
    """None if ``url/manifest.json`` can be read; else why not. Only http(s) and file URLs are probed."""
    import urllib.error
    import urllib.request

    target = url.rstrip("/") + "/manifest.json"
    if not target.startswith(("http://", "https://", "file://")):
        return ""  # not probed
    try:
        with urllib.request.urlopen(target, timeout=timeout) as r:
            r.read(1)
        return None
    except (urllib.error.URLError, OSError, ValueError) as e:
        return f"{target}: {e}"


SHARDS_NAMED = 3  # shard problems spelled out per data set; the rest are counted


def shard_size_problems(dataset_dir: Path, manifest: dict) -> list[str]:
    """Shards of a local data set (every split) that are missing or whose size on disk differs from the
    manifest's ``bytes``: one stat per shard, nothing read (``goat-dist data inspect`` reads and hashes)."""
    problems = []
    for entries in manifest["splits"].values():
        for e in entries:
            path = dataset_dir / e["name"]
            expected = e.get("bytes")
            try:
                actual = path.stat().st_size
            except FileNotFoundError:
                size = f" (the manifest lists {expected} bytes)" if expected is not None else ""
                problems.append(f"shard {e['name']} is missing{size}")
                continue
            except OSError as err:
                problems.append(f"shard {e['name']} cannot be read: {err}")
                continue
            if expected is not None and actual != expected:
                problems.append(
                    f"shard {e['name']} is {actual} bytes on disk, the manifest says {expected} bytes "
                    "(truncated or changed copy?)"
                )
    return problems


def _shard_summary(dataset_dir: Path, problems: list[str]) -> str:
    named = "; ".join(problems[:SHARDS_NAMED])
    more = len(problems) - SHARDS_NAMED
    return f"{dataset_dir}: {named}" + (f"; and {more} more shard(s)" if more > 0 else "")


def check_data(report: Report, cfg) -> None:
    from .data import builtin_dataset_dir, read_manifest, split_shard_paths
    from .data.shards import is_url

    d = cfg.data
    if d.sources:
        paths = [str(s.get("path")) for s in d.sources]
    elif d.source == "builtin":
        target = builtin_dataset_dir(d.cache_dir, cfg.model.vocab_size, d.builtin_max_bytes)
        if (target / "manifest.json").is_file():
            try:
                bad = shard_size_problems(target, read_manifest(target))
            except (OSError, ValueError) as e:
                bad = [str(e)]
            if bad:
                report.fail("data", f"builtin corpus: {_shard_summary(target, bad)}")
            else:
                report.ok("data", f"builtin corpus ready in {target}")
            return
        parent = target.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            probe = parent / f".doctor-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            report.fail("data", f"builtin corpus not built and its cache dir {parent} is not writable: {e}")
            return
        report.ok("data", f"builtin corpus not built yet: rank 0 builds it in {target} at the start")
        return
    else:
        paths = [d.source]
    problems, checked, skipped = [], 0, []
    for raw in paths:
        if is_url(raw):
            why = _reachable_url(raw)
            if why:
                problems.append(why)
            elif why == "":
                skipped.append(raw)
            else:
                checked += 1
            continue
        path = Path(raw).expanduser()
        try:
            manifest = read_manifest(path)
            shards = split_shard_paths(path, "train")
            bad = shard_size_problems(path, manifest)
            missing = [s for s in shards if not os.access(s, os.R_OK)]
            if bad:
                problems.append(_shard_summary(path, bad))
            elif missing:
                problems.append(
                    f"{path}: {len(missing)} of {len(shards)} train shards unreadable, e.g. {missing[0]}"
                )
            elif not shards:
                problems.append(f"{path}: the manifest lists no train shards")
            elif manifest.get("vocab_size", 0) > cfg.model.vocab_size:
                problems.append(
                    f"{path}: tokenized with vocab_size {manifest['vocab_size']} > model.vocab_size "
                    f"{cfg.model.vocab_size}"
                )
            else:
                checked += 1
        except (OSError, ValueError) as e:
            problems.append(f"{path}: {e}")
    if problems:
        report.fail("data", "; ".join(problems))
        return
    note = f" (not probed: {', '.join(skipped)})" if skipped else ""
    report.ok("data", f"{checked} source(s) reachable{note}")


def check_disk(report: Report, cfg, run_dir: Path) -> None:
    need = int(checkpoint_bytes(cfg) * DISK_HEADROOM)
    probe = run_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    params = parameter_count(cfg.model, cfg.parallel.tp)
    what = f"next checkpoint ~{_human(need)} ({params:,} params); {_human(free)} free on {probe}"
    if free < need:
        report.fail("disk", f"not enough space: {what}")
    else:
        report.ok("disk", what)


def write_bandwidth_path(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints" / WRITE_BANDWIDTH


def measure_write_bandwidth(run_dir: Path, nbytes: int) -> dict:
    """One process writes ``nbytes`` to a temporary file in ``run_dir`` and fsyncs it: what a checkpoint
    writer gets from this file system. The file is deleted; the result is a dict (bytes, seconds, B/s)."""
    probe = run_dir / f".doctor-write-{socket.gethostname()}-{os.getpid()}"
    chunk = os.urandom(min(WRITE_CHUNK, nbytes))  # random: a compressing file system gains nothing
    try:
        started = time.perf_counter()
        with open(probe, "wb") as f:
            left = nbytes
            while left > 0:
                left -= f.write(chunk[: min(left, len(chunk))])
            f.flush()
            os.fsync(f.fileno())
        seconds = max(time.perf_counter() - started, 1e-9)
    finally:
        probe.unlink(missing_ok=True)
    return {"bytes": nbytes, "seconds": seconds, "bytes_per_s": nbytes / seconds,
            "host": socket.gethostname(), "run_dir": str(run_dir), "measured_at": time.time(),
            "method": "one process, sequential writes, fsync"}  # fmt: skip


def recorded_write_bandwidth(run_dir: Path) -> float | None:
    """The write bandwidth (B/s) the doctor recorded for ``run_dir``, or None (none, unreadable, corrupt)."""
    import json

    try:
        value = json.loads(write_bandwidth_path(run_dir).read_text())["bytes_per_s"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value) if value > 0 else None


def check_write_bandwidth(report: Report, run_dir: Path, nbytes: int) -> None:
    """Time a write of ``nbytes`` (at most a quarter of the free space) and record it in the run dir."""
    import json

    from .atomic import atomic_write_text

    free = shutil.disk_usage(run_dir).free
    size = min(nbytes, free // 4) // 2**20 * 2**20
    if size < MIN_WRITE_BYTES:
        report.warn("write", f"not measured: {_human(free)} free on {run_dir}")
        return
    try:
        result = measure_write_bandwidth(run_dir, size)
        record = write_bandwidth_path(run_dir)
        record.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(record, json.dumps(result, indent=1) + "\n")
    except OSError as e:
        report.fail("write", f"writing {_human(size)} to {run_dir} failed: {e}")
        return
    report.ok(
        "write",
        f"{_human(size)} in {result['seconds']:.2f} s (one process, fsync): "
        f"{result['bytes_per_s'] / 1e6:.0f} MB/s; recorded in {record}",
    )


def _agree(device, value: int, op: str = "max") -> int:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return int(t.item())


def check_shared_run_dir(report: Report, device, run_dir: Path, local_rank: int, writable: bool) -> None:
    """Rank 0 writes a token; every node's first rank must read it: the run dir is the same directory."""
    import torch.distributed as dist

    rank = dist.get_rank()
    token = uuid.uuid4().hex
    path = run_dir / ".doctor-shared"
    if rank == 0 and writable:
        try:
            path.write_text(token)
        except OSError:
            writable = False
    # every rank learns rank 0's token through a collective (as an integer) and whether it was written
    tok_int = int(token[:15], 16) if rank == 0 and writable else 0
    expected = _agree(device, tok_int)
    if expected and local_rank == 0 and rank != 0:
        try:
            seen = int(path.read_text()[:15], 16)
        except (OSError, ValueError):
            seen = -1
        if seen != expected:
            report.fail(
                "run dir",
                f"{run_dir} is not the directory rank 0 writes to (not on a file system shared by all "
                "nodes?): checkpoints would be incomplete",
            )
    _agree(device, 0)
    if rank == 0 and expected:
        path.unlink(missing_ok=True)


def run_doctor(
    cfg, nbytes: int, iters: int, timeout_s: float, environ=os.environ, write_bytes: int = 0
) -> int:
    """All checks on this rank; returns the exit status (0: all passed on every rank). ``write_bytes``:
    the size of rank 0's write-bandwidth probe (0: not measured)."""
    import torch.distributed as dist

    started = time.perf_counter()
    rank = int(environ.get("RANK", 0))
    local_rank = int(environ.get("LOCAL_RANK", 0))
    local_world = int(environ.get("LOCAL_WORLD_SIZE", 1))
    host = socket.gethostname()
    report = Report(rank, host)
    run_dir = cfg.run_dir.expanduser().resolve()

    device = check_devices(report, environ, local_rank, local_world)
    writable = True
    if local_rank == 0:  # once per node: node-local views of shared file systems
        writable = check_run_dir_local(report, run_dir)
        check_data(report, cfg)
        if writable:
            check_disk(report, cfg, run_dir)
        if writable and rank == 0 and write_bytes > 0:
            check_write_bandwidth(report, run_dir, write_bytes)
    # A rank without a usable device, or outside the process group, cannot join the collectives: it
    # stops here, and the launcher (srun --kill-on-bad-exit, torchrun) ends the other ranks.
    created = not dist.is_initialized()
    if device is None or not init_world(report, device, timeout_s):
        return 1
    world = dist.get_world_size()
    try:
        check_all_reduce(report, device, nbytes, iters)
        check_shared_run_dir(report, device, run_dir, local_rank, writable)
        failed_mask = _agree(device, report.mask())
    finally:
        if created:
            dist.destroy_process_group()
    failed = [c for i, c in enumerate(CHECKS) if failed_mask >> i & 1]
    if rank == 0:
        nodes = environ.get("GROUP_WORLD_SIZE") or environ.get("SLURM_NNODES") or "1"
        print(f"goat-dist doctor: {world} rank(s) on {nodes} node(s); run dir {run_dir}")
        for line in report.lines:
            print(line)
        seconds = time.perf_counter() - started
        if failed:
            print(
                f"goat-dist doctor: FAILED ({', '.join(failed)}); see the FAIL lines above ({seconds:.1f} s)",
                file=sys.stderr,
            )
        else:
            print(f"goat-dist doctor: all checks passed ({seconds:.1f} s)")
        sys.stdout.flush()
    return 1 if failed else 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from .config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"goat-dist doctor: {e}", file=sys.stderr)
        return 2
    import torch

    cuda = torch.cuda.is_available()
    nbytes = int(args.allreduce_mb * 2**20) if args.allreduce_mb else (256 if cuda else 16) * 2**20
    write_mb = args.write_mb if args.write_mb is not None else (256 if cuda else 64)
    if write_mb < 0:
        print(f"goat-dist doctor: --write-mb must be >= 0, got {write_mb:g}", file=sys.stderr)
        return 2
    return run_doctor(cfg, nbytes, args.iters, args.timeout, write_bytes=int(write_mb * 2**20))


def register(sub) -> None:
    p = sub.add_parser(
        "doctor",
        help="preflight: devices, all-reduce bandwidth, run dir, data, disk, write bandwidth (exit 1 naming "
        "what fails)",
        description=__doc__.split("\n\n")[0],
    )
    add_config_arguments(p)
    p.add_argument(
        "--allreduce-mb", type=float, default=None, help="all-reduce MiB (default 256 on CUDA, 16 on CPU)"
    )
    p.add_argument("--iters", type=int, default=5, help="timed all-reduces (default 5)")
    p.add_argument(
        "--write-mb",
        type=float,
        default=None,
        help="MiB rank 0 writes to time the run dir's file system (default 256 on CUDA, 64 on CPU; 0: skip)",
    )
    p.add_argument(
        "--timeout", type=float, default=300.0, help="seconds to wait for all ranks to join (default 300)"
    )
    p.set_defaults(func=cmd_doctor)


def main(argv: list[str] | None = None) -> int:
    """``python -m goat_dist.doctor``: the same as ``goat-dist doctor``, without loading the CLI's other
    commands (their imports of megatron/DeepSpeed take seconds that a preflight need not spend)."""
    parser = argparse.ArgumentParser(prog="goat-dist")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["doctor", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
