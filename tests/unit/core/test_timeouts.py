"""The collective timeouts (``goat_dist/parallel/timeouts.py``) on a single-process gloo world: every process
group (the default one, megatron's, one made later as DeepSpeed makes its own) holds the start-up timeout
after ``begin`` and the steady one after ``first_step_done``, read back from each group's backend; a torch
without the registry of groups still switches the default group, with a warning saying which groups do not.
The run lock's collective starts the groups with the start-up timeout."""

from __future__ import annotations

import datetime
import types

import pytest
import torch.distributed as dist

from goat_dist.parallel import timeouts
from goat_dist.parallel.timeouts import Timeouts, group_timeout, process_groups, set_group_timeouts


def minutes(group) -> float:
    found = group_timeout(group)
    assert found is not None, "no timeout read back from the group's backend"
    return found.total_seconds() / 60


def every_group_minutes() -> set[float]:
    return {minutes(g) for g in process_groups()}


@pytest.fixture
def restore_timeouts(world1):
    before = {g: group_timeout(g) for g in process_groups()}
    yield world1
    for group, timeout in before.items():
        for backend in timeouts._backends(group):
            backend._set_default_timeout(timeout)


def test_every_group_switches_from_the_startup_to_the_steady_timeout(restore_timeouts):
    from megatron.core import parallel_state

    layout = restore_timeouts
    later = dist.new_group([0])  # made after the start, with torch's default timeout (as DeepSpeed's)
    groups = process_groups()
    assert dist.group.WORLD in groups and layout.tp_group in groups and later in groups
    assert parallel_state.get_data_parallel_group() in groups

    t = Timeouts(startup_minutes=21.0, steady_minutes=7.0)
    assert (t.minutes, t.key, t.describe()) == (
        21.0,
        "parallel.startup_timeout_minutes",
        "parallel.startup_timeout_minutes=21",
    )
    assert t.begin() >= len(groups)
    assert every_group_minutes() == {21.0} and minutes(later) == 21.0
    assert t.first_step_done() >= len(groups)
    assert t.steady and (t.minutes, t.describe()) == (7.0, "parallel.timeout_minutes=7")
    assert every_group_minutes() == {7.0}
    assert minutes(layout.tp_group) == minutes(dist.group.WORLD) == minutes(later) == 7.0
    assert group_timeout() == datetime.timedelta(minutes=7)


def test_without_the_registry_the_default_group_alone_switches_with_a_warning(restore_timeouts, monkeypatch):
    from torch.distributed import distributed_c10d as c10d

    later = dist.new_group([0])
    set_group_timeouts(3.0)
    monkeypatch.setattr(c10d, "_world", types.SimpleNamespace(default_pg=c10d._world.default_pg))
    with pytest.warns(UserWarning, match="only the default process group's collective timeout is switched"):
        set_group_timeouts(4.0)
    monkeypatch.undo()
    assert minutes(dist.group.WORLD) == 4.0 and minutes(later) == 3.0


def test_the_run_locks_collective_starts_the_groups_with_the_startup_timeout(world1, tmp_path, monkeypatch):
    from harness.multiproc import in_process_config

    from goat_dist import distributed
    from goat_dist.run_lock import WorldLock

    asked = []
    monkeypatch.setattr(distributed, "init", lambda *a, **kw: asked.append(kw["timeout_minutes"]) or world1)
    cfg = in_process_config(tmp_path, tmp_path / "run", "parallel.startup_timeout_minutes=21")
    assert WorldLock(cfg)._tell_the_world(False) is False
    assert asked == [21.0]
