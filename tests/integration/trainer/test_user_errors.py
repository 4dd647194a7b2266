"""Errors of the user's own making (config, data, checkpoint, layout), as a new user meets them: the real
``goat-dist train`` command prints one message that names the setting and the fix, from rank 0 only, no
traceback, and exits 2 (a usage error: retrying cannot help), under torchrun too."""

from __future__ import annotations

import os
import shutil
import sys

import pytest
from harness.multiproc import run
from harness.user_errors import PREFIX, one_clean_message, train


def test_config_error_missing_data_source_names_the_setting(tmp_path, builtin_cache):
    proc = train(tmp_path, f"data.source={tmp_path / 'nope'}", f"data.cache_dir={builtin_cache}")
    one_clean_message(proc, "data.source=", "manifest.json not found", "goat-dist data prepare")


def test_goat_debug_shows_the_traceback_too(tmp_path, builtin_cache):
    proc = train(
        tmp_path, f"data.source={tmp_path / 'nope'}", f"data.cache_dir={builtin_cache}", GOAT_DEBUG="1"
    )
    assert "Traceback" in proc.stderr and proc.stderr.count(PREFIX) == 1, proc.stderr[-3000:]


def test_config_error_vocabulary_mismatch_names_the_fix(tmp_path, builtin_cache):
    data = next(p.parent for p in builtin_cache.glob("*/manifest.json"))
    proc = train(tmp_path, f"data.source={data}", "model.vocab_size=300", f"data.cache_dir={builtin_cache}")
    one_clean_message(proc, "vocab_size 4096", "model.vocab_size=4096")


def test_data_error_truncated_shard_under_on_error_raise(tmp_path, builtin_cache):
    data = tmp_path / "data"
    shutil.copytree(next(p.parent for p in builtin_cache.glob("*/manifest.json")), data)
    for shard in data.glob("train-*.tar"):
        os.truncate(shard, shard.stat().st_size // 3)
    proc = train(tmp_path, f"data.source={data}", "data.on_error=raise", f"data.cache_dir={builtin_cache}")
    one_clean_message(proc, "train-000000.tar", "truncated", "data.on_error=skip")


def test_checkpoint_error_resume_from_a_missing_path(tmp_path, builtin_cache):
    proc = train(tmp_path, f"train.resume={tmp_path / 'no-such-ckpt'}", f"data.cache_dir={builtin_cache}")
    message = one_clean_message(proc, "no-such-ckpt", "train.resume", "does not exist")
    assert "shared by all nodes" not in message  # no rank sees it: not a file system's doing


def test_run_dir_that_cannot_be_written_is_named_before_any_work(tmp_path):
    (tmp_path / "file").write_text("")
    proc = train(tmp_path, f"run.dir={tmp_path / 'file' / 'run'}")
    one_clean_message(proc, f"run.dir={tmp_path / 'file' / 'run'} cannot be written", "fix:")
    assert "layout:" not in proc.stdout  # no model, no data: nothing started


@pytest.mark.slow
def test_run_dir_refused_by_rank_0_stops_the_world_once(tmp_path):
    """Rank 0 cannot take the run dir: every rank of ``--nproc 2`` stops in the run's first collective,
    one message (rank 0's), exit 2."""
    proc = train(tmp_path, "run.dir=/proc/goat-run", nproc=2)
    message = one_clean_message(proc, "run.dir=/proc/goat-run cannot be written")
    assert "[rank 1]" not in message


CRASH = """
import sys
from goat_dist import distributed
from goat_dist.config import load_config
from goat_dist.trainer import entry

class Crash:
    def __init__(self, cfg):
        distributed.init(1)  # a one-process world: torch.distributed exists when the error comes
        raise RuntimeError("crash inside the trainer")

entry.Trainer = Crash
entry.run(load_config(None, ["run.dir=" + sys.argv[1]]))
"""


def test_a_one_process_crash_prints_a_plain_traceback(tmp_path):
    """torch.distributed prefixes "[rank0]: " to every line of an uncaught traceback; alone, there is no
    rank to tell apart."""
    proc = run([sys.executable, "-c", CRASH, str(tmp_path / "run")], expect=1, timeout=120)
    assert "Traceback" in proc.stderr and "RuntimeError: crash inside the trainer" in proc.stderr
    assert "[rank0]" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_layout_error_dp2_batch_once_from_rank_0_and_launcher_exits_2(tmp_path, builtin_cache):
    """Two ranks under the torchrun world that ``--nproc`` starts: one message, exit 2, no
    ChildFailedError report; it suggests the micro-batch size that works."""
    proc = train(tmp_path, "train.global_batch_size=6", f"data.cache_dir={builtin_cache}", nproc=2)
    message = one_clean_message(proc, "train.global_batch_size=6", "data-parallel size 2")
    assert "train.micro_batch_size=1" in message and "[rank 1]" not in message


def test_batch_fix_suggests_the_largest_micro_batch_that_divides():
    from goat_dist.distributed import LayoutError, check_batch

    with pytest.raises(LayoutError, match=r"set train.micro_batch_size=2 \(the largest"):
        check_batch(8, 3, 2)
    with pytest.raises(LayoutError, match=r"set train.global_batch_size=4 or train.global_batch_size=8"):
        check_batch(7, 2, 2)  # no micro-batch size divides an odd batch over 2 ranks
    check_batch(8, 2, 2)


def test_error_from_a_dataloader_worker_keeps_only_its_message():
    from data_tools.shard_format import ShardError
    from goat_dist.trainer.entry import exit_code_for, user_error_message

    wrapped = ShardError(
        "Caught ShardError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
        '  File "x.py", line 1, in f\ndata_tools.shard_format.ShardError: shard s.tar: sample cut short\n'
    )
    message = user_error_message(wrapped)
    assert message.splitlines()[0] == "goat-dist train: shard s.tar: sample cut short"
    assert "Traceback" not in message and exit_code_for(wrapped) == 2
