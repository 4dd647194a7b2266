"""Checkpoint loading runs no code: a torch file swapped for a malicious pickle (manifest rewritten to
match) is refused by name, step and type, and its payload never executes."""

from __future__ import annotations

import os

import pytest
import torch
from harness.multiproc import goat_train_command, run

from goat_dist.checkpoint.manager import write_manifest
from goat_dist.checkpoint.safe_load import UnsafeCheckpointError, load


class Payload:
    """Unpickling this calls ``os.system`` (what an attacker's checkpoint would do)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_load_refuses_code_and_names_file_step_and_type(tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    torch.save({"state": Payload(marker)}, evil)
    with pytest.raises(UnsafeCheckpointError) as info:
        load(evil, step=7)
    assert "evil.pt" in str(info.value) and "step 7" in str(info.value) and "system" in str(info.value)
    assert not marker.exists()
    plain = tmp_path / "plain.pt"
    torch.save({"w": torch.ones(2), "pos": 3, "gauss": [0, 0.5]}, plain)
    assert torch.equal(load(plain)["w"], torch.ones(2))


@pytest.mark.slow
def test_malicious_shard_is_refused_and_runs_nothing(tmp_path, builtin_cache):
    run_dir = tmp_path / "run"
    common = [f"data.cache_dir={builtin_cache}", f"run.dir={run_dir}"]
    run(goat_train_command(1, ["train.max_steps=2", *common]))
    step_dir = run_dir / "checkpoints" / "step_00000002"
    marker = tmp_path / "pwned"
    shard = step_dir / "rng_rank0.pt"  # the only torch file a resume reads: the rest is safetensors / JSON
    torch.save({"torch_cpu": Payload(marker)}, shard)
    write_manifest(step_dir, {"step": 2, "saved_at": 0})  # the manifest is no defence: rewrite it

    out = run(goat_train_command(1, ["train.max_steps=4", *common]), expect=2)
    assert "rng_rank0.pt" in out.stderr and "step 2" in out.stderr, out.stderr[-3000:]
    assert "posix.system" in out.stderr or "os.system" in out.stderr
    assert not marker.exists()
