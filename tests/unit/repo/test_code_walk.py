"""tools/code_walk.py's counting on synthetic call sequences (no training run): units, package changes,
climbs and rooms."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def walk():
    spec = importlib.util.spec_from_file_location("code_walk", ROOT / "tools" / "code_walk.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_a_package_or_a_root_module_is_a_unit(walk):
    assert walk.unit_of("engine/build.py") == "engine"
    assert walk.unit_of("trainer/callbacks/evaluation.py") == "trainer"
    assert walk.unit_of("distributed.py") == "distributed"
    assert walk.unit_of("__init__.py") == "__init__"


def test_package_changes_count_each_event_that_leaves_the_previous_unit(walk):
    assert walk.package_changes([]) == 0
    assert walk.package_changes(["engine"]) == 0
    assert walk.package_changes(["engine", "engine", "model", "model", "engine", "trainer"]) == 3
    assert walk.package_changes(["a", "b", "a", "b"]) == 3


def test_step_summary(walk):
    files = ["trainer/trainer.py", "engine/build.py", "engine/build.py", "engine/step.py", "distributed.py"]
    s = walk.step_summary(files)
    assert (s["calls"], s["files"], s["packages"], s["package_changes"]) == (5, 4, 3, 2)
    assert s["per_package"] == {"engine": 3, "trainer": 1, "distributed": 1}


def test_climbs_count_steps_up_and_skip_unknown_floors(walk):
    assert walk.climbs([]) == 0
    assert walk.climbs([9, 3, 3, 9, 1, 9]) == 2  # 3 -> 9 and 1 -> 9; staying or going down is no climb
    assert walk.climbs([3, None, 9]) == 1  # a room without a floor is left out of the comparison
    assert walk.climbs([None, None]) == 0


def test_rooms_in_order_of_first_visit(walk):
    assert walk.rooms(["b.py", "a.py", "b.py", "c/d.py", "a.py"]) == ["b.py", "a.py", "c/d.py"]


def test_walk_summary_uses_the_floors_of_the_rooms_units(walk):
    floor = {"config": 1, "engine": 3, "trainer": 9}
    stays = ["trainer/entry.py", "config/sections.py", "trainer/trainer.py", "engine/build.py"]
    stays += ["trainer/callbacks/x.py", "__init__.py", "engine/build.py", "trainer/trainer.py"]
    w = walk.walk_summary(stays, floor)
    assert (w["stays"], w["rooms"], w["climbs"]) == (8, 6, 3)  # config->trainer, engine->trainer twice
    assert w["order"][:3] == ["trainer/entry.py", "config/sections.py", "trainer/trainer.py"]


def test_only_the_overrides_this_config_knows_are_passed(walk):
    from dataclasses import dataclass, field

    @dataclass
    class Train:
        max_steps: int = 1

    @dataclass
    class Config:
        train: Train = field(default_factory=Train)

    assert walk.overrides(Config, "/tmp/x") == ["train.max_steps=2", "run.dir=/tmp/x/run"]


def test_the_floors_table_is_read_from_the_checkout(walk):
    floors, path = walk.load_floors(ROOT)
    assert path == str(ROOT / walk.FLOOR_TABLE)
    assert floors["config"] < floors["engine"] < floors["trainer"]
