from pathlib import Path

import pytest

from goat_dist.config import Config, ConfigError, load_config, parse_override

ROOT = Path(__file__).resolve().parents[3]


def test_tiny_yaml_is_the_builtin_default():
    assert load_config(ROOT / "configs" / "tiny.yaml") == Config()


def test_dotted_overrides_and_types():
    cfg = load_config(
        None,
        [
            "train.max_steps=50",
            "train.lr=1e-3",
            "model.goat.pos_rank=2",
            "model.num_kv_heads=null",
            "run.dir=runs/demo",
            "log.tensorboard=false",
        ],
    )
    assert cfg.train.max_steps == 50 and cfg.train.lr == 1e-3 and cfg.model.goat.pos_rank == 2
    assert (
        cfg.model.num_kv_heads is None and cfg.run_dir == Path("runs/demo") and cfg.log.tensorboard is False
    )


@pytest.mark.parametrize(
    "override,needle",
    [
        ("train.max_stepz=5", "train.max_stepz"),
        ("model.goat.rank=2", "model.goat.rank"),
        ("train.max_steps=abc", "train.max_steps"),
        ("train.max_steps=1.5", "train.max_steps"),
        ("log.tensorboard=3", "log.tensorboard"),
        ("model.position=sinusoid", "model.position"),
        ("model.goat=3", "model.goat"),
        ("log.profile_steps=[3,2]", "log.profile_steps"),
        ("log.profile_steps=[0,2]", "log.profile_steps"),
        ("log.profile_steps=[2]", "log.profile_steps"),
        ("log.profile_ranks=[-1]", "log.profile_ranks"),
    ],
)
def test_bad_keys_and_values_name_the_key(override, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(None, [override])


@pytest.mark.parametrize(
    "override,key,guess",
    [
        ("train.max_step=5", "train.max_step", "train.max_steps"),
        ("train.beta=0.9", "train.beta", "train.beta1 or train.beta2"),
        ("trian.max_steps=5", "trian", "train"),
        ("model.max_steps=5", "model.max_steps", "train.max_steps"),  # a key of another section
    ],
)
def test_a_mistyped_key_leads_with_the_closest_keys(override, key, guess):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert str(err.value).startswith(f"unknown config key '{key}': did you mean {guess}? (known here: ")


def test_a_key_like_none_lists_the_section_only():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.zzz=1"])
    message = str(err.value)
    assert "did you mean" not in message and "(known here: activation_checkpointing, " in message


def test_yaml_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  warmup: 3\n")
    with pytest.raises(ConfigError, match="bad.yaml.*train.warmup"):
        load_config(bad)


def test_impossible_model_shapes_rejected():
    with pytest.raises(ConfigError, match="content lanes"):
        load_config(None, ["model.hidden_size=64", "model.num_heads=8", "model.goat.pos_rank=4"])
    with pytest.raises(ConfigError, match="num_kv_heads"):
        load_config(None, ["model.num_kv_heads=3"])


def test_parse_override_nesting():
    assert parse_override("a.b.c=1") == {"a": {"b": {"c": 1}}}


def test_a_bare_yaml_timestamp_is_a_string_key():
    """YAML turns `train.stop_at=2027-01-15T08:00:00Z` into a datetime; the str key takes it as ISO text."""
    from goat_dist.trainer.deadline import parse_time

    cfg = load_config(None, ["train.stop_at=2027-01-15T08:00:00Z"])
    assert isinstance(cfg.train.stop_at, str)
    assert parse_time(cfg.train.stop_at) == parse_time("2027-01-15T08:00:00+00:00")


def test_a_resolved_config_is_read_only():
    """``Config.frozen``: every section refuses a change, naming it; a copy made with
    ``dataclasses.replace`` is a new, writable config; the dict is unchanged."""
    import dataclasses

    cfg = load_config(None, ["train.max_steps=7"])
    before = cfg.to_dict()
    assert cfg.frozen() is cfg
    for section, key, value in (
        (cfg.train, "max_steps", 8),
        (cfg.model.goat, "train_len", 64),
        (cfg.data, "window_order", "keyed"),
    ):
        with pytest.raises(ConfigError, match=f"{type(section).__name__}.{key}: the run's config"):
            setattr(section, key, value)
    with pytest.raises(ConfigError):
        cfg.model = cfg.model
    assert cfg.to_dict() == before
    copy = dataclasses.replace(cfg.train, max_steps=9)
    copy.lr = 1.0
    assert copy.max_steps == 9 and cfg.train.max_steps == 7


def test_the_trainers_config_is_resolved_and_read_only(world1, builtin_cache, tmp_path):
    """The trainer resolves its config before it writes anything (trainer/resolve.py): config.yaml holds
    concrete values and equals the config the run holds, which no part of the run can change."""
    import yaml
    from harness.multiproc import in_process_config

    from goat_dist.trainer.trainer import Trainer

    trainer = Trainer(in_process_config(builtin_cache, tmp_path / "run", "train.max_steps=1"))
    cfg = trainer.cfg
    assert cfg.train.precision == "fp32" and cfg.model.goat.train_len == cfg.model.seq_len
    assert isinstance(cfg.model.goat.key_bias_lanes, int)
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text()) == cfg.to_dict()
    with pytest.raises(ConfigError):
        cfg.train.max_steps = 2
