"""The launch environment, set where it takes effect: what every launcher exports before Python starts
(``distributed.launch_environment``: ``goat-dist train --nproc``'s workers, ``slurm/goat_slurm.py env``
for slurm/train.sbatch and launch/local.sh), a user's own values kept; what ``distributed.init`` still
sets or refuses on CUDA (``cuda_settings``); and which CUDA device a task takes under either GPU binding
(``local_device_index``, the doctor's devices check). No GPU: the CUDA side is played by monkeypatching."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from goat_dist import distributed, launcher
from goat_dist.distributed import (
    DeviceBindingError,
    LaunchEnvError,
    cuda_settings,
    launch_environment,
    local_device_index,
)
from goat_dist.doctor.environment import check_devices
from goat_dist.doctor.report import Report

ROOT = Path(__file__).resolve().parents[3]
NEEDED = {
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
}


def _goat_slurm():
    if "goat_slurm" in sys.modules:
        return sys.modules["goat_slurm"]
    spec = importlib.util.spec_from_file_location("goat_slurm", ROOT / "slurm" / "goat_slurm.py")
    module = sys.modules["goat_slurm"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- what the launchers export ---------------------------------------------------------------------------
def test_launch_environment_fills_what_is_unset_and_keeps_the_users():
    assert launch_environment({}) == NEEDED
    mine = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    assert launch_environment(mine) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}  # the user's allocator kept
    assert "PYTORCH_CUDA_ALLOC_CONF" not in launch_environment({"PYTORCH_ALLOC_CONF": "backend:native"})
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in launch_environment({"CUDA_DEVICE_MAX_CONNECTIONS": "8"})


def test_nproc_workers_start_with_the_launch_environment(monkeypatch):
    """``goat-dist train --nproc``: ``run_world`` gives its workers ``worker_env``."""
    base = {"PATH": "/bin", "RANK": "3", "PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6"}
    env = launcher.worker_env(base)
    assert "RANK" not in env and env["PATH"] == "/bin"
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "garbage_collection_threshold:0.6"  # the user's, as it was
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert {k: launcher.worker_env({})[k] for k in NEEDED} == NEEDED
    started = {}

    def call(cmd, env):
        started.update(env)
        return 0

    import subprocess as sp

    monkeypatch.setattr(sp, "call", call)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert launcher.run_world(1, ["-c", "pass"]) == 0
    assert {k: started.get(k) for k in ("CUDA_DEVICE_MAX_CONNECTIONS", "PYTORCH_CUDA_ALLOC_CONF")} == {
        k: NEEDED[k] for k in ("CUDA_DEVICE_MAX_CONNECTIONS", "PYTORCH_CUDA_ALLOC_CONF")
    }


def test_goat_slurm_env_prints_the_same_values(monkeypatch, capsys):
    gs = _goat_slurm()
    for key in [*NEEDED, "PYTORCH_ALLOC_CONF"]:
        monkeypatch.delenv(key, raising=False)
    assert gs.main(["env"]) == 0
    assert dict(line.split("=", 1) for line in capsys.readouterr().out.splitlines()) == NEEDED
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    assert gs.main(["env"]) == 0
    printed = capsys.readouterr().out
    assert "PYTORCH_CUDA_ALLOC_CONF" not in printed and "CUDA_DEVICE_MAX_CONNECTIONS=1" in printed


@pytest.mark.parametrize("script", ["slurm/train.sbatch", "launch/local.sh"])
def test_scripts_export_the_helpers_lines_before_any_python_step(tmp_path, script):
    """The job scripts export ``goat_slurm.py env``'s lines before the first step: seen by the command
    after it (the run-dir helper, here a stand-in python that records its environment and stops)."""
    seen = tmp_path / "seen.env"
    python = tmp_path / "python"
    python.write_text(
        "#!/bin/sh\n"
        'if [ "$2" = env ]; then echo CUDA_DEVICE_MAX_CONNECTIONS=1; '
        "echo PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; exit 0; fi\n"
        f"env | grep -E '^(CUDA_DEVICE_MAX|PYTORCH_CUDA_ALLOC)' | sort > {seen}\nexit 2\n"
    )
    python.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "GOAT_", *NEEDED))}
    base.update(SLURM_JOB_ID="1", GOAT_PYTHON=str(python), GOAT_SITE_ENV=str(tmp_path / "none.env"))
    if script.startswith("launch"):
        del base["GOAT_SITE_ENV"]
    out = subprocess.run(["bash", script, "configs/tiny.yaml"], env=base, cwd=ROOT, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2 and seen.exists(), out.stderr
    assert dict(line.split("=", 1) for line in seen.read_text().splitlines()) == {
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    }


def _step_lines(text: str) -> dict[str, int]:
    lines = text.splitlines()
    first = lambda needle: next(i for i, line in enumerate(lines) if needle in line)  # noqa: E731
    return {
        "env": first('"${HELPER[@]}" env'),
        "preflight": first("goat_dist doctor"),
        "warm": first("goat_dist kernels warm"),
        "train": first("goat_dist train"),
    }


def test_train_sbatch_warms_the_kernels_once_per_node_between_preflight_and_training():
    text = (ROOT / "slurm" / "train.sbatch").read_text()
    at = _step_lines(text)
    assert at["env"] < at["preflight"] < at["warm"] < at["train"]
    lines = text.splitlines()
    warm_step = "\n".join(lines[at["warm"] - 1 : at["warm"] + 1])
    assert "--ntasks-per-node=1" in warm_step and '--ntasks="$NNODES"' in warm_step
    assert "exec" in warm_step  # through the helper: the private cache dir is checked on every node
    guard = next(line for line in lines[: at["warm"]][::-1] if line.startswith("if "))
    assert guard == 'if [[ "$WARM" != 0 ]]; then', (
        guard
    )  # GOAT_WARM_KERNELS=0, or a job without GPUs: no step
    assert 'WARM="${GOAT_WARM_KERNELS:-auto}"' in lines[at["preflight"] : at["warm"]]


# ---- what init sets or refuses on CUDA -------------------------------------------------------------------
def test_cuda_settings_set_what_is_missing_before_the_context_exists():
    settings = cuda_settings({}, cuda_initialised=False, tp=2, run_dir=Path("/r"))
    assert settings["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert settings["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert settings["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == "/r/nccl_trace_rank_"
    mine = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "PYTORCH_ALLOC_CONF": "x",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    }
    kept = cuda_settings(mine, cuda_initialised=True, tp=8, sp=True)
    assert not set(kept) & {*mine, "PYTORCH_CUDA_ALLOC_CONF"}  # setdefault: the launcher's values stay
    # without TP nothing needs one connection: another value (or none, late) is the site's choice
    assert cuda_settings({"CUDA_DEVICE_MAX_CONNECTIONS": "8"}, cuda_initialised=True, tp=1) is not None
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in cuda_settings({}, cuda_initialised=True, tp=1)


@pytest.mark.parametrize("initialised", [False, True])
def test_a_conflicting_max_connections_under_tp_is_refused_by_name(initialised):
    with pytest.raises(
        LaunchEnvError, match=r"CUDA_DEVICE_MAX_CONNECTIONS=8 is set, but parallel.tp=2 needs"
    ) as e:
        cuda_settings({"CUDA_DEVICE_MAX_CONNECTIONS": "8"}, cuda_initialised=initialised, tp=2)
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1 in the launcher" in str(e.value)
    with pytest.raises(LaunchEnvError, match=r"parallel.tp=1 with parallel.sp=true needs"):
        cuda_settings({"CUDA_DEVICE_MAX_CONNECTIONS": "2"}, cuda_initialised=initialised, tp=1, sp=True)


def test_an_unset_max_connections_is_refused_once_the_cuda_context_exists(monkeypatch):
    with pytest.raises(LaunchEnvError, match="not set and the CUDA context already exists") as e:
        cuda_settings({}, cuda_initialised=True, tp=4)
    assert "parallel.tp=4 needs CUDA_DEVICE_MAX_CONNECTIONS=1" in str(e.value)
    # init's own call reads this process's CUDA state
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(LaunchEnvError, match="CUDA_DEVICE_MAX_CONNECTIONS is not set"):
        distributed._configure_cuda(2, None)


# ---- one GPU per task ------------------------------------------------------------------------------------
def test_local_device_index_under_both_bindings():
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    assert [local_device_index(r, 8, env) for r in range(8)] == list(range(8))  # all GPUs visible
    assert [local_device_index(r, 1, {"CUDA_VISIBLE_DEVICES": str(r)}) for r in range(8)] == [
        0
    ] * 8  # one each
    with pytest.raises(DeviceBindingError, match=r"LOCAL_RANK=5 .* sees 4 \(CUDA_VISIBLE_DEVICES=0,1,2,3\)"):
        local_device_index(5, 4, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    with pytest.raises(DeviceBindingError, match=r"LOCAL_RANK=0: this task sees no CUDA device"):
        local_device_index(0, 0, {})


def _cuda_with(monkeypatch, count: int):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "H100")
    ones = torch.ones
    monkeypatch.setattr(torch, "ones", lambda *a, device=None, **k: ones(*a, **k))


def test_doctor_takes_the_tasks_only_gpu_whatever_local_rank_says(monkeypatch):
    _cuda_with(monkeypatch, 1)
    report = Report(5, "node1")
    device = check_devices(report, {"CUDA_VISIBLE_DEVICES": "5"}, local_rank=5, local_world=8)
    assert device == torch.device("cuda", 0)
    assert not report.failed and not any("warn" in line for line in report.lines), report.lines
    assert any("CUDA_VISIBLE_DEVICES=5" in line for line in report.lines)
    shared = Report(5, "node1")  # no binding said so: 8 tasks on a node with one GPU
    assert check_devices(shared, {}, local_rank=5, local_world=8) == torch.device("cuda", 0)
    assert any("8 tasks on this node share 1 GPUs" in line for line in shared.lines)


def test_doctor_refuses_local_rank_past_the_visible_gpus_naming_them(monkeypatch, capsys):
    _cuda_with(monkeypatch, 2)
    report = Report(3, "node1")
    assert check_devices(report, {"CUDA_VISIBLE_DEVICES": "2,3"}, local_rank=3, local_world=4) is None
    assert report.failed == {"devices"}
    assert (
        "LOCAL_RANK=3 has no CUDA device: this task sees 2 (CUDA_VISIBLE_DEVICES=2,3)"
        in capsys.readouterr().err
    )


def test_current_layout_and_init_take_the_same_device(monkeypatch):
    _cuda_with(monkeypatch, 1)
    monkeypatch.setenv("LOCAL_RANK", "6")
    assert distributed.local_device() == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert distributed.local_device() == torch.device("cuda", 6)


def test_one_gpu_per_task_rebinds_local_rank_for_deepspeed_and_keeps_the_nodes():
    """DeepSpeed takes its device from LOCAL_RANK (checked below): under one GPU per task, LOCAL_RANK 6
    becomes 0, the device's index; the launcher's 6 stays for the node's once-only work."""
    env = {"LOCAL_RANK": "6"}
    distributed.bind_local_rank(env, 0)
    assert env == {"LOCAL_RANK": "0", distributed.NODE_LOCAL_RANK: "6"}
    assert distributed.node_local_rank(env) == 6
    distributed.bind_local_rank(env, 0)  # again (a second init): unchanged
    assert distributed.node_local_rank(env) == 6 and env["LOCAL_RANK"] == "0"
    same = {"LOCAL_RANK": "3"}  # every GPU visible: LOCAL_RANK already names the device
    distributed.bind_local_rank(same, 3)
    assert same == {"LOCAL_RANK": "3"} and distributed.node_local_rank(same) == 3
    assert distributed.NODE_LOCAL_RANK in launcher.LAUNCHER_VARS  # a child world starts without it


def test_deepspeed_takes_its_device_from_local_rank():
    """Why ``bind_local_rank`` exists: if DeepSpeed stops reading LOCAL_RANK for its device, it may go."""
    import inspect

    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.partition_parameters import Init

    assert "self.local_rank" in inspect.getsource(DeepSpeedEngine._set_distributed_vars)
    assert "self.local_rank = int(os.environ['LOCAL_RANK'])" in inspect.getsource(
        DeepSpeedEngine._configure_with_arguments
    )
    assert 'os.environ["LOCAL_RANK"]' in inspect.getsource(Init.__init__)
