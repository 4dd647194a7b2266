"""goat-dist doctor: the checkpoint size estimate, each check's failure message, and whole runs with one
process, two ranks, and two "nodes" that do not share the run dir."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
from harness.multiproc import ROOT, clean_env, launch_command

from goat_dist import doctor
from goat_dist.config import load_config
from goat_dist.distributed import free_port


def doctor_command(nproc: int, args: list[str], full: bool = False) -> list[str]:
    """``python -m goat_dist.doctor`` (the light form), or with ``full`` ``python -m goat_dist doctor``
    (the command line's, which can rehearse)."""
    entry = ["-m", "goat_dist", "doctor"] if full else ["-m", "goat_dist.doctor"]
    return launch_command(nproc, [*entry, "--config", str(ROOT / "configs" / "tiny.yaml"), *args])


def run_doctor(
    nproc: int, args: list[str], cwd=ROOT, full: bool = False, **env
) -> subprocess.CompletedProcess:
    return subprocess.run(
        doctor_command(nproc, args, full),
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


# ---- the model-size estimate ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["model.position=rope"],
        ["model.position=alibi", "model.num_kv_heads=2"],
        ["model.position=learned", "model.tie_embeddings=false"],
        ["model.activation=gelu", "model.norm=layernorm", "model.bias=true"],
        ["model.goat.key_bias=false", "model.goat.pos_rank=2", "model.vocab_size=1000"],
        ["model.ffn_hidden_size=200", "model.num_kv_heads=4"],
    ],
)
def test_parameter_count_matches_the_model(world1, overrides):
    from goat_dist.model import GPT

    cfg = load_config(None, ["model.hidden_size=128", "model.num_layers=2", "model.num_heads=8", *overrides])
    real = sum(p.numel() for p in GPT(cfg.model).parameters())
    assert doctor.parameter_count(cfg.model) == real


def test_checkpoint_bytes_per_parameter():
    """One copy of the state: fp32 masters + two Adam moments, 12 B per parameter, in bf16 and fp32."""
    from goat_dist.plan.checkpoint import checkpoint_cost

    for precision in ("fp32", "bf16"):
        cfg = load_config(None, [f"train.precision={precision}"])
        n = doctor.parameter_count(cfg.model)
        assert doctor.checkpoint_bytes(cfg) == n * 12
        planned = checkpoint_cost(cfg, world=1, gpus_per_node=1)["bytes"]  # the planner's, with metadata
        assert 0 < planned - doctor.checkpoint_bytes(cfg) < 2e6


# ---- single checks ----------------------------------------------------------------------------------------
def report():
    return doctor.Report(rank=0, host="h")


def test_gpus_allocated_but_invisible_fails(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is visible here")
    r = report()
    assert doctor.check_devices(r, {"SLURM_GPUS_ON_NODE": "4"}, 0, 4) is None
    assert r.failed == {"devices"}
    err = capsys.readouterr().err
    assert "GPUs were allocated (SLURM_GPUS_ON_NODE=4) but torch" in err and "sees none" in err
    r = report()
    assert doctor.check_devices(r, {}, 0, 1).type == "cpu" and not r.failed


def test_disk_too_small_fails(tmp_path, monkeypatch, capsys):
    cfg = load_config(None, [])
    need = doctor.checkpoint_bytes(cfg)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 * need, 9 * need, need // 2))
    r = report()
    doctor.check_disk(r, cfg, tmp_path / "not" / "yet")
    assert r.failed == {"disk"}
    err = capsys.readouterr().err
    assert "FAIL disk: not enough space" in err and str(tmp_path) in err
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 * need, 0, 2 * need))
    r = report()
    doctor.check_disk(r, cfg, tmp_path)
    assert not r.failed and "next checkpoint" in r.lines[-1]


def test_write_bandwidth_is_measured_and_recorded(tmp_path):
    """The write check writes (and deletes) a file in the run dir, fsyncs it, and records one writer's
    bandwidth atomically in checkpoints/write_bandwidth.json."""
    import json

    r = report()
    doctor.check_write_bandwidth(r, tmp_path, 4 * 2**20)
    assert not r.failed
    record = json.loads((tmp_path / "checkpoints" / "write_bandwidth.json").read_text())
    assert record["bytes"] == 4 * 2**20 and record["seconds"] > 0
    assert record["bytes_per_s"] == pytest.approx(record["bytes"] / record["seconds"])
    assert doctor.recorded_write_bandwidth(tmp_path) == record["bytes_per_s"]
    assert "MB/s; recorded in" in r.lines[-1] and "4.2 MB" in r.lines[-1]
    leftovers = [p.name for p in tmp_path.rglob("*") if p.name.startswith(".")]
    assert leftovers == []  # the probe is deleted, the record's temp file renamed


def test_write_check_stays_within_the_free_space(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    sizes = []
    real = doctor.measure_write_bandwidth
    monkeypatch.setattr(doctor.storage, "measure_write_bandwidth", lambda d, n: sizes.append(n) or real(d, n))
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(0, 0, 16 * 2**20))
    r = report()
    doctor.check_write_bandwidth(r, tmp_path, 256 * 2**20)
    assert sizes == [4 * 2**20] and not r.failed  # a quarter of the free space
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(0, 0, 2**20))
    r = report()
    doctor.check_write_bandwidth(r, tmp_path / "full", 256 * 2**20)
    assert sizes == [4 * 2**20] and "warn  write: not measured" in r.lines[-1]
    assert doctor.recorded_write_bandwidth(tmp_path / "full") is None


@pytest.mark.parametrize("text", ["not json", '{"bytes_per_s": -5}', '{"bytes_per_s": "fast"}', "{}",
                                  '{"bytes_per_s": NaN}', '{"bytes_per_s": true}'])  # fmt: skip
def test_a_corrupt_write_record_counts_as_none(tmp_path, text):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "write_bandwidth.json").write_text(text)
    assert doctor.recorded_write_bandwidth(tmp_path) is None


def test_data_checks(tmp_path, builtin_cache, capsys):
    from goat_dist.data import builtin_dataset_dir

    shards = builtin_dataset_dir(builtin_cache, 4096, 1_000_000)
    r = report()
    doctor.check_data(r, load_config(None, [f"data.source={shards}"]))
    assert not r.failed and "1 source(s) reachable" in r.lines[-1]

    r = report()
    doctor.check_data(r, load_config(None, [f"data.source={tmp_path / 'missing'}"]))
    assert r.failed == {"data"} and "manifest not found" in capsys.readouterr().err

    r = report()  # builtin, already built
    built = [f"data.cache_dir={builtin_cache}", "data.builtin_max_bytes=1000000"]
    doctor.check_data(r, load_config(None, built))
    assert not r.failed and "ready" in r.lines[-1]

    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = report()  # builtin, not built, and its cache dir cannot be made
    doctor.check_data(r, load_config(None, [f"data.cache_dir={blocker}/cache"]))
    assert r.failed == {"data"} and "not writable" in capsys.readouterr().err

    r = report()  # the shards missing from a copied data set
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "manifest.json").write_text((shards / "manifest.json").read_text())
    doctor.check_data(r, load_config(None, [f"data.source={copy}"]))
    assert r.failed == {"data"} and "shard train-000000.tar is missing" in capsys.readouterr().err


def _copy_with_bad_shards(shards: Path, dest: Path) -> tuple[int, int]:
    """``dest``: a copy of the builtin data set with its train shard truncated after the first tar header
    (a copy cut short) and its val shard deleted; returns (manifest size of the train shard, size now)."""
    shutil.copytree(shards, dest)
    train = dest / "train-000000.tar"
    full = train.stat().st_size
    with open(train, "r+b") as f:
        f.truncate(512 + 8)
    (dest / "val-000000.tar").unlink()
    return full, 512 + 8


def test_data_check_names_truncated_and_missing_shards(tmp_path, builtin_cache, capsys):
    """A shard whose size differs from the manifest's ``bytes`` (or that is missing) fails the data check,
    naming the shard and both sizes; a stat, not a read (the truncated copy still opens as a tar)."""
    from goat_dist.data import builtin_dataset_dir

    shards = builtin_dataset_dir(builtin_cache, 4096, 1_000_000)
    full, now = _copy_with_bad_shards(shards, tmp_path / "bad")
    r = report()
    doctor.check_data(r, load_config(None, [f"data.source={tmp_path / 'bad'}"]))
    assert r.failed == {"data"}
    err = capsys.readouterr().err
    assert f"FAIL data: {tmp_path / 'bad'}: shard train-000000.tar is {now} bytes on disk, " in err, err
    assert f"the manifest says {full} bytes" in err
    assert "shard val-000000.tar is missing (the manifest lists 10240 bytes)" in err

    r = report()  # the same in a mixture, next to a healthy source: only the bad one is named
    mixture = f"data.sources=[{{path: {shards}}}, {{path: {tmp_path / 'bad'}}}]"
    doctor.check_data(r, load_config(None, [mixture]))
    err = capsys.readouterr().err
    assert r.failed == {"data"} and f"{tmp_path / 'bad'}: shard train-000000.tar is {now} bytes" in err
    assert f"{shards}:" not in err

    cache = tmp_path / "cache"  # a builtin corpus cut short in its cache
    _copy_with_bad_shards(shards, cache / shards.name)
    r = report()
    doctor.check_data(r, load_config(None, [f"data.cache_dir={cache}", "data.builtin_max_bytes=1000000"]))
    err = capsys.readouterr().err
    assert r.failed == {"data"} and "FAIL data: builtin corpus: " in err
    assert f"shard train-000000.tar is {now} bytes on disk, the manifest says {full} bytes" in err


def test_cli_registers_doctor():
    from goat_dist.cli import build_parser

    args = build_parser().parse_args(["doctor", "--config", "c.yaml", "train.max_steps=3", "--iters", "2",
                                      "--write-mb", "8"])  # fmt: skip
    assert args.func is doctor.cmd_doctor
    assert (args.config, args.overrides, args.iters, args.write_mb) == ("c.yaml", ["train.max_steps=3"], 2, 8)
    args = build_parser().parse_args(["doctor", "--write-mb", "-1"])
    assert doctor.cmd_doctor(args) == 2


def test_write_mb_sets_the_probe_and_zero_skips_it(monkeypatch, tmp_path):
    import torch

    from goat_dist.cli import build_parser

    seen = []
    monkeypatch.setattr(
        doctor.command, "run_doctor", lambda *a, write_bytes, **k: seen.append(write_bytes) or 0
    )
    for extra in ([], ["--write-mb", "0"], ["--write-mb", "8"]):
        assert doctor.cmd_doctor(build_parser().parse_args(["doctor", *extra])) == 0
    default = (256 if torch.cuda.is_available() else 64) * 2**20
    assert seen == [default, 0, 8 * 2**20]
    r = report()  # what write_bytes=0 means inside run_doctor: the check is not called
    monkeypatch.undo()
    monkeypatch.setattr(doctor.command, "check_write_bandwidth", lambda *a: r.fail("write", "called"))
    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}"])
    assert doctor.run_doctor(cfg, 1024, 1, 60.0, environ={}, write_bytes=0) == 0
    assert not r.failed and not (tmp_path / "run" / "checkpoints").exists()


def test_rehearsal_runs_by_itself_on_a_gpu_node_only(monkeypatch):
    import torch

    from goat_dist.cli import build_parser

    seen = []
    monkeypatch.setattr(doctor.command, "run_doctor", lambda *a, rehearse, **k: seen.append(rehearse) or 0)
    for cuda, flag in ((False, "auto"), (False, "on"), (True, "auto"), (True, "off")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        assert (
            doctor.cmd_doctor(build_parser().parse_args(["doctor", "--rehearse", flag, "--write-mb", "0"]))
            == 0
        )
    assert [hook is not None for hook in seen] == [False, True, True, False]


# ---- whole runs -------------------------------------------------------------------------------------------
def test_doctor_alone_passes(tmp_path, builtin_cache):
    import json

    args = [f"run.dir={tmp_path / 'run'}", f"data.cache_dir={builtin_cache}", "--rehearse", "on"]
    out = run_doctor(1, args,
                     full=True)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    for check in ("devices", "data", "disk", "all-reduce", "write", "rehearsal"):
        assert re.search(rf"^\s+ok\s+{check}:", out.stdout, re.M), out.stdout
    # on a CPU machine, asked for: this node's last rank as an H100 runs it, FA4 stood in
    assert re.search(
        r"ok\s+rehearsal: rank 0 of 1 on h100-80gb, 2 of 4 blocks, attention flash4: 1 host", out.stdout
    )
    assert "all checks passed" in out.stdout
    assert not any(p.name.startswith(".doctor") for p in (tmp_path / "run").iterdir())  # cleaned up
    record = json.loads((tmp_path / "run" / "checkpoints" / "write_bandwidth.json").read_text())
    assert record["bytes"] == 64 * 2**20 and record["bytes_per_s"] > 0  # the CPU default, 64 MiB


def test_doctor_names_what_is_wrong(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    # the rehearsal of a step FlashAttention-4 would refuse (fp32 inputs) fails the preflight, named
    refused = ["train.precision=fp32", "model.attention_backend=flash4", "--rehearse", "on"]
    out = run_doctor(1, [f"run.dir={blocker}/run", f"data.source={tmp_path / 'nodata'}", *refused], full=True)
    assert out.returncode == 1
    assert f"FAIL run dir: {blocker}/run is not writable" in out.stderr
    assert f"FAIL data: {tmp_path / 'nodata'}" in out.stderr
    assert "FAIL rehearsal: kernel refusal at goat_dist/kernels/fa4.py:" in out.stderr
    assert "FAILED (run dir, data, rehearsal)" in out.stderr
    light = run_doctor(1, ["--rehearse", "on"])  # python -m goat_dist.doctor cannot rehearse: it says so
    assert light.returncode == 2 and "needs the full command line (goat-dist doctor)" in light.stderr
    bad = run_doctor(1, ["train.nope=1"])
    assert bad.returncode == 2 and "train.nope" in bad.stderr


@pytest.mark.slow
def test_doctor_two_ranks_measures_bandwidth(tmp_path, builtin_cache):
    out = run_doctor(
        2, [f"run.dir={tmp_path / 'run'}", f"data.cache_dir={builtin_cache}", "--allreduce-mb=8"]
    )
    assert out.returncode == 0, out.stderr[-3000:]
    m = re.search(r"all-reduce: 2 ranks, gloo, .* algbw ([\d.]+) GB/s, busbw ([\d.]+) GB/s", out.stdout)
    assert m, out.stdout
    assert float(m.group(1)) > 0 and float(m.group(2)) == pytest.approx(float(m.group(1)), rel=0.01)
    print(out.stdout)


@pytest.mark.slow
def test_doctor_finds_a_run_dir_not_shared_between_nodes(tmp_path, builtin_cache):
    """Two ranks that each believe they are the first on their node, with run.dir resolving to different
    directories (different working dirs): what two nodes without a shared file system look like."""
    port = free_port()
    procs = []
    for rank in (0, 1):
        cwd = tmp_path / f"node{rank}"
        cwd.mkdir()
        env = clean_env(
            RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1"
        )
        env["MASTER_PORT"] = str(port)
        cmd = [sys.executable, "-m", "goat_dist.doctor", "run.dir=runs/x", f"data.cache_dir={builtin_cache}"]
        procs.append(subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outs = [p.communicate(timeout=300) for p in procs]
    codes = [p.returncode for p in procs]
    assert codes == [1, 1], outs
    err1 = outs[1][1].decode()
    assert "FAIL run dir" in err1 and "not on a file system shared by all nodes" in err1
    assert "FAILED (run dir)" in outs[0][1].decode()  # rank 0 reports what failed elsewhere
    # nothing left behind but rank 0's write-bandwidth record
    assert os.listdir(tmp_path / "node0" / "runs" / "x") == ["checkpoints"]
    assert os.listdir(tmp_path / "node0" / "runs" / "x" / "checkpoints") == ["write_bandwidth.json"]


def test_doctor_help_runs_without_the_cli():
    out = subprocess.run(
        [sys.executable, "-m", "goat_dist.doctor", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "--allreduce-mb" in out.stdout
    assert (Path(doctor.__file__).parent / "__main__.py").is_file()  # python -m goat_dist.doctor
