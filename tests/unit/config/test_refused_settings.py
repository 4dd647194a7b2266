"""Config checks of settings the run cannot honour, each naming the key and the value: dropout (its masks
would repeat across ranks), and the collective timeouts (both > 0, the start-up one not below the steady
one)."""

from __future__ import annotations

import re

import pytest

from goat_dist.config import Config, ConfigError, load_config


@pytest.mark.parametrize("value", ["0.1", "1e-3", "-0.1"])
def test_dropout_above_zero_is_refused_naming_key_value_and_why(value):
    with pytest.raises(ConfigError) as refused:
        load_config(None, [f"model.dropout={value}"])
    text = str(refused.value)
    assert f"'model.dropout'={float(value)}" in text
    assert "data-parallel replicas" in text and "sequence-parallel shards" in text
    assert "set model.dropout=0" in text
    assert load_config(None, ["model.dropout=0"]).model.dropout == 0  # the key stays, at 0


def test_the_startup_timeout_defaults_to_30_minutes_above_the_steady_10():
    p = Config().parallel
    assert (p.startup_timeout_minutes, p.timeout_minutes) == (30.0, 10.0)


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["parallel.startup_timeout_minutes=0"], "'parallel.startup_timeout_minutes' must be > 0, got 0"),
        (["parallel.timeout_minutes=-1"], "'parallel.timeout_minutes' must be > 0, got -1"),
        (
            ["parallel.timeout_minutes=45"],
            "'parallel.startup_timeout_minutes'=30 is below parallel.timeout_minutes=45",
        ),
        (
            ["parallel.startup_timeout_minutes=5"],
            "set parallel.startup_timeout_minutes=10 or more",
        ),
    ],
)
def test_bad_timeouts_are_refused_naming_the_keys(overrides, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_config(None, overrides)


def test_timeouts_that_work():
    cfg = load_config(None, ["parallel.timeout_minutes=0.5"])  # a test's short steady timeout
    assert cfg.parallel.startup_timeout_minutes == 30.0
    equal = load_config(None, ["parallel.timeout_minutes=45", "parallel.startup_timeout_minutes=45"])
    assert equal.parallel.startup_timeout_minutes == equal.parallel.timeout_minutes == 45
