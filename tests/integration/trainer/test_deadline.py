"""The run's deadline: Slurm's job end time, train.stop_at, train.time_limit_minutes; the earliest wins,
and due() leaves room for one more step and a save."""

from __future__ import annotations

import subprocess
from datetime import datetime, timezone
from types import SimpleNamespace

import pytest

from goat_dist.config import load_config
from goat_dist.trainer import deadline as dl
from goat_dist.trainer.deadline import Deadline, DeadlineError

NOW = 1_800_000_000.0  # a fixed "now" (2027-01-15)


def clock(start: float = NOW):
    t = [start]
    return (lambda: t[0]), t


def train(stop_at=None, minutes=0.0):
    return SimpleNamespace(stop_at=stop_at, time_limit_minutes=minutes)


def no_slurm(*args, **kwargs):
    raise AssertionError("Slurm must not be asked outside a job")


def test_nothing_configured_is_none():
    assert Deadline.from_config(train(), environ={}, now=lambda: NOW, run=no_slurm) is None


def test_time_limit_minutes_counts_from_start():
    now, t = clock()
    d = Deadline.from_config(train(minutes=2.5), environ={}, now=now, run=no_slurm)
    assert d.end == NOW + 150 and d.source == "train.time_limit_minutes=2.5"
    t[0] += 100
    assert d.seconds_left() == pytest.approx(50)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("2027-01-15T08:00:00Z", datetime(2027, 1, 15, 8, tzinfo=timezone.utc).timestamp()),
        ("2027-01-15T10:00:00+02:00", datetime(2027, 1, 15, 8, tzinfo=timezone.utc).timestamp()),
        ("2027-01-15T08:00:00", datetime(2027, 1, 15, 8).timestamp()),  # naive: local time
        ("1800000600", 1_800_000_600.0),
    ],
)
def test_stop_at_formats(text, expected):
    d = Deadline.from_config(train(stop_at=text), environ={}, now=lambda: NOW, run=no_slurm)
    assert d.end == pytest.approx(expected) and d.source == "train.stop_at"


def test_stop_at_as_datetime():
    when = datetime(2027, 1, 15, 8, tzinfo=timezone.utc)
    d = Deadline.from_config(train(stop_at=when), environ={}, now=lambda: NOW, run=no_slurm)
    assert d.end == when.timestamp()


def test_stop_at_garbage_names_the_key():
    with pytest.raises(DeadlineError, match="train.stop_at='tomorrow'"):
        Deadline.from_config(train(stop_at="tomorrow"), environ={}, now=lambda: NOW, run=no_slurm)


def test_earliest_wins():
    env = {"SLURM_JOB_ID": "77", "SLURM_JOB_END_TIME": str(NOW + 300)}
    d = Deadline.from_config(train(stop_at=str(NOW + 200), minutes=10), environ=env, now=lambda: NOW)
    assert (d.end, d.source) == (NOW + 200, "train.stop_at")
    d = Deadline.from_config(train(stop_at=str(NOW + 900), minutes=10), environ=env, now=lambda: NOW)
    assert (d.end, d.source) == (NOW + 300, "Slurm job 77 end time")
    d = Deadline.from_config(train(minutes=1), environ=env, now=lambda: NOW)
    assert d.end == NOW + 60


class FakeSlurm:
    """Stands in for subprocess.run: answers squeue/scontrol like Slurm 22.05 does."""

    def __init__(self, squeue=None, scontrol=None):
        self.answers = {"squeue": squeue, "scontrol": scontrol}
        self.calls = []

    def __call__(self, cmd, **kwargs):
        self.calls.append((cmd, kwargs))
        answer = self.answers[cmd[0]]
        if isinstance(answer, Exception):
            raise answer
        if answer is None:
            return subprocess.CompletedProcess(cmd, 1, "", "slurm_load_jobs error: Invalid job id")
        return subprocess.CompletedProcess(cmd, 0, answer, "")


def test_asks_squeue_in_epoch_seconds():
    fake = FakeSlurm(squeue=f"123 {int(NOW + 3600)}\n")
    d = Deadline.from_config(train(), environ={"SLURM_JOB_ID": "123"}, now=lambda: NOW, run=fake)
    assert d.end == NOW + 3600 and d.source == "Slurm job 123 end time"
    cmd, kwargs = fake.calls[0]
    assert cmd == ["squeue", "-h", "-j", "123", "-o", "%A %e"]  # a list: no shell
    assert kwargs["env"]["SLURM_TIME_FORMAT"] == "%s" and kwargs["timeout"] <= 30


def test_falls_back_to_scontrol():
    record = f"JobId=123 JobName=x JobState=RUNNING TimeLimit=01:00:00 EndTime={int(NOW + 60)} Deadline=N/A"
    fake = FakeSlurm(squeue=subprocess.TimeoutExpired("squeue", 10), scontrol=record)
    d = Deadline.from_config(train(), environ={"SLURM_JOB_ID": "123"}, now=lambda: NOW, run=fake)
    assert d.end == NOW + 60
    assert [c[0][0] for c in fake.calls] == ["squeue", "scontrol"]


def test_an_array_element_whose_id_is_the_arrays_reads_its_own_line():
    """Job 6 is element 2 of array 6 (Slurm gives the first-started element the array's id): ``squeue -j 6``
    and ``scontrol show job 6`` list all three elements, each with its own end time."""
    lines = f"9 {int(NOW + 100)}\n10 {int(NOW + 200)}\n6 {int(NOW + 300)}\n"
    fake = FakeSlurm(squeue=lines)
    d = Deadline.from_config(train(), environ={"SLURM_JOB_ID": "6"}, now=lambda: NOW, run=fake)
    assert d.end == NOW + 300
    records = "\n".join(
        f"JobId={j} ArrayJobId=6 ArrayTaskId={t} JobState=RUNNING EndTime={int(NOW + e)}"
        for j, t, e in (("9", 0, 100), ("10", 1, 200), ("6", 2, 300))
    )
    fake = FakeSlurm(squeue=subprocess.TimeoutExpired("squeue", 10), scontrol=records)
    d = Deadline.from_config(train(), environ={"SLURM_JOB_ID": "6"}, now=lambda: NOW, run=fake)
    assert d.end == NOW + 300


def test_iso_end_time_is_parsed_too():
    fake = FakeSlurm(squeue="5 2027-01-15T09:00:00\n")
    d = Deadline.from_config(train(), environ={"SLURM_JOB_ID": "5"}, now=lambda: NOW, run=fake)
    assert d.end == datetime(2027, 1, 15, 9).timestamp()


@pytest.mark.parametrize(
    "answer", ["5 N/A\n", "5 Unknown\n", "", "7 123\n", None, FileNotFoundError("squeue")]
)
def test_no_end_time_means_no_slurm_deadline(answer):
    fake = FakeSlurm(squeue=answer, scontrol=None)
    assert Deadline.from_config(train(), environ={"SLURM_JOB_ID": "5"}, now=lambda: NOW, run=fake) is None


def test_unlimited_job_is_no_deadline():
    env = {"SLURM_JOB_ID": "5", "SLURM_JOB_END_TIME": str(NOW + 365 * 86400 * 20)}
    assert Deadline.from_config(train(), environ=env, now=lambda: NOW, run=no_slurm) is None


def test_only_each_nodes_first_task_asks():
    env = {"SLURM_JOB_ID": "5", "SLURM_LOCALID": "3"}
    assert Deadline.from_config(train(), environ=env, now=lambda: NOW, run=no_slurm) is None


def test_due_leaves_room_for_a_step_and_a_save():
    now, t = clock()
    d = Deadline(NOW + 100, "test", now=now, safety=1.5, margin_s=15)
    # budget = 1.5 * (2 + 20) + 15 = 48 s
    assert d.budget(2.0, 20.0) == pytest.approx(48)
    t[0] = NOW + 100 - 48.5
    assert not d.due(2.0, 20.0)
    t[0] = NOW + 100 - 47.5
    assert d.due(2.0, 20.0)
    t[0] = NOW + 200  # past the end
    assert d.due(0.0, 0.1)


def test_first_save_is_estimated():
    d = Deadline(NOW + 1000, "test", now=lambda: NOW)
    assert d.first_save_estimate(0.5) == dl.FIRST_SAVE_MIN_S  # nothing known: the floor
    assert d.budget(0.5, None) == pytest.approx(dl.SAFETY * (0.5 + dl.FIRST_SAVE_MIN_S) + dl.MARGIN_S)
    assert d.budget(0.5, 0.0) == d.budget(0.5, None)  # 0: no save measured yet
    d.expect_checkpoint_bytes(int(20e9))  # a 20 GB checkpoint at 100 MB/s
    assert d.first_save_estimate(0.5) == pytest.approx(dl.SAVE_OVERHEAD_S + 200)
    assert d.first_save_estimate(30.0) == pytest.approx(dl.SAVE_OVERHEAD_S + 200)
    assert Deadline(NOW + 1000, "t", now=lambda: NOW).first_save_estimate(60.0) == 120.0  # slow steps


def test_whole_config_estimates_the_checkpoint():
    cfg = load_config(None, ["train.time_limit_minutes=5", "model.hidden_size=512", "model.num_layers=8"])
    d = Deadline.from_config(cfg, environ={}, now=lambda: NOW, run=no_slurm)
    from goat_dist.doctor import checkpoint_bytes

    assert d.checkpoint_bytes == checkpoint_bytes(cfg) > 0
    assert d.end == NOW + 300
    assert Deadline.from_config(cfg.train, environ={}, now=lambda: NOW).checkpoint_bytes is None


def test_env_overrides_safety_and_margin():
    env = {"GOAT_DEADLINE_SAFETY": "3", "GOAT_DEADLINE_MARGIN_S": "60"}
    d = Deadline.from_config(train(minutes=10), environ=env, now=lambda: NOW, run=no_slurm)
    assert (d.safety, d.margin_s) == (3.0, 60.0)


def test_describe_names_source_and_time_left():
    d = Deadline(NOW + 90, "train.stop_at", now=lambda: NOW)
    assert "train.stop_at" in d.describe() and "90 s left" in d.describe()


def test_config_keys_feed_the_deadline():
    # quoted: YAML would read a bare timestamp as a datetime, which the config's str check refuses
    cfg = load_config(None, ["train.stop_at='2027-01-15T08:00:00Z'", "train.time_limit_minutes=30"])
    d = Deadline.from_config(cfg.train, environ={}, now=lambda: NOW)
    assert d.end == min(datetime(2027, 1, 15, 8, tzinfo=timezone.utc).timestamp(), NOW + 1800)


def test_a_resumed_attempt_budgets_for_the_last_recorded_save(world1, builtin_cache, tmp_path):
    """The first attempt's save is measured and noted in checkpoints/save_cost.json; the next attempt's
    deadline uses it from its first step (not the 10 s first-save guess)."""
    import json

    from harness.multiproc import in_process_config

    from goat_dist.trainer.trainer import Trainer

    run_dir = tmp_path / "run"
    Trainer(in_process_config(builtin_cache, run_dir, "train.max_steps=2")).fit()
    cost = json.loads((run_dir / "checkpoints" / "save_cost.json").read_text())
    assert cost["step"] == 2 and cost["seconds"] > 0 and cost["bytes"] > 0
    cost["seconds"] = 123.0  # a slow file system's save, as an earlier attempt measured it
    (run_dir / "checkpoints" / "save_cost.json").write_text(json.dumps(cost))
    again = Trainer(
        in_process_config(builtin_cache, run_dir, "train.max_steps=4", "train.time_limit_minutes=60")
    )
    again.start_loop()
    policy = again.checkpointing  # the checkpoint policy's callback: deadline and last save time
    assert policy.last_save_s == 123.0
    assert policy.deadline.budget(0.1, policy.last_save_s) == pytest.approx(
        dl.SAFETY * (0.1 + 123.0) + dl.MARGIN_S
    )
    fresh = Trainer(in_process_config(builtin_cache, tmp_path / "fresh", "train.max_steps=4"))
    fresh.start_loop()
    assert fresh.checkpointing.last_save_s is None  # nothing recorded: the deadline estimates the first save


def _record_bandwidth(run_dir, text: str) -> None:
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    (run_dir / "checkpoints" / "write_bandwidth.json").write_text(text)


def test_the_first_save_uses_the_doctors_write_bandwidth(tmp_path):
    """Before any save, the estimate is the checkpoint (12 B per parameter) over the bandwidth the doctor
    recorded for the run dir, plus the fixed overhead; without a record, 100 MB/s."""
    from goat_dist.doctor import checkpoint_bytes, parameter_count

    run_dir = tmp_path / "run"
    cfg = load_config(None, ["train.time_limit_minutes=60", "model.hidden_size=1024", "model.num_layers=24",
                             f"run.dir={run_dir}"])  # fmt: skip
    nbytes = checkpoint_bytes(cfg)
    assert nbytes == 12 * parameter_count(cfg.model, cfg.parallel.tp)
    guess = Deadline.from_config(cfg, environ={}, now=lambda: NOW, run=no_slurm)
    assert guess.write_bytes_per_s is None
    assert guess.first_save_estimate() == pytest.approx(dl.SAVE_OVERHEAD_S + nbytes / dl.WRITE_BYTES_PER_S)
    _record_bandwidth(run_dir, '{"bytes_per_s": 25e6, "bytes": 67108864, "seconds": 2.68}')
    slow = Deadline.from_config(cfg, environ={}, now=lambda: NOW, run=no_slurm)
    assert slow.write_bytes_per_s == 25e6
    assert slow.first_save_estimate() == pytest.approx(dl.SAVE_OVERHEAD_S + nbytes / 25e6)
    # a measured save (this attempt's or an earlier one's, checkpoints/save_cost.json) still wins
    assert slow.budget(1.0, 42.0) == pytest.approx(dl.SAFETY * (1.0 + 42.0) + dl.MARGIN_S)


@pytest.mark.parametrize("text", ["{not json", '{"bytes_per_s": 0}', '{"seconds": 3}', "[]"])
def test_a_missing_or_corrupt_bandwidth_record_falls_back_to_the_guess(tmp_path, text):
    run_dir = tmp_path / "run"
    _record_bandwidth(run_dir, text)
    cfg = load_config(None, ["train.time_limit_minutes=60", f"run.dir={run_dir}"])
    d = Deadline.from_config(cfg, environ={}, now=lambda: NOW, run=no_slurm)
    assert d.write_bytes_per_s is None and d.write_bandwidth == dl.WRITE_BYTES_PER_S


@pytest.mark.parametrize(
    "environ, nodes",
    [
        ({}, 1),
        ({"GROUP_WORLD_SIZE": "4", "WORLD_SIZE": "32", "LOCAL_WORLD_SIZE": "8"}, 4),
        ({"SLURM_NNODES": "16"}, 16),
        ({"WORLD_SIZE": "64", "LOCAL_WORLD_SIZE": "8"}, 8),
        ({"SLURM_NNODES": "lots", "WORLD_SIZE": "8"}, 1),
    ],
)
def test_each_node_writes_its_share(environ, nodes):
    """Every rank writes only its share: a node's part of the checkpoint goes through one writer's
    bandwidth, and nodes write in parallel."""
    assert dl.nodes_of(environ) == nodes
    d = Deadline(NOW + 10_000, "t", now=lambda: NOW, checkpoint_bytes=int(360e9), write_bytes_per_s=1e9,
                 nodes=nodes)  # fmt: skip
    expected = max(dl.FIRST_SAVE_MIN_S, dl.SAVE_OVERHEAD_S + 360 / nodes)
    assert d.first_save_estimate() == pytest.approx(expected)


def test_the_doctors_record_reaches_the_deadline(tmp_path):
    """What goat-dist doctor writes is what the deadline reads."""
    from goat_dist import doctor

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    doctor.check_write_bandwidth(doctor.Report(0, "h"), run_dir, 2 * 2**20)
    cfg = load_config(None, ["train.time_limit_minutes=60", f"run.dir={run_dir}"])
    d = Deadline.from_config(cfg, environ={}, now=lambda: NOW, run=no_slurm)
    assert d.write_bytes_per_s == doctor.recorded_write_bandwidth(run_dir) > 0
