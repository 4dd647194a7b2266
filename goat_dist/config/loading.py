"""A ``Config`` from YAML files and dotted overrides (types coerced, unknown keys named), the values
derived once when it loads (the data set's vocabulary, steps from tokens), and saving it."""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from .checks import validate
from .sections import DEFAULT_VOCAB_SIZE, Config, ConfigError


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Check ``value`` against a type hint; accept ints for floats and YAML's '1e-3' strings."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: bad value {value!r}")
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (datetime.date, datetime.datetime)):  # YAML reads bare timestamps as these
            return value.isoformat()
    else:
        return value
    raise ConfigError(f"config key '{key}' expects {getattr(hint, '__name__', hint)}, got {value!r}")


def _dotted_keys(obj: Any, prefix: str = "") -> list[str]:
    """Every key of a config (section) ``obj``, dotted, sections and the keys inside them."""
    keys = []
    for name in typing.get_type_hints(type(obj)):
        keys.append(f"{prefix}{name}")
        value = getattr(obj, name)
        if dataclasses.is_dataclass(value):
            keys += _dotted_keys(value, f"{prefix}{name}.")
    return keys


def _closest(name: str, options, cutoff: float) -> list[str]:
    """difflib's close matches of ``name`` as good as the best one (``beta`` -> beta1, beta2)."""
    close = difflib.get_close_matches(name, sorted(options), n=3, cutoff=cutoff)
    if not close:
        return []
    ratio = {c: difflib.SequenceMatcher(None, name, c).ratio() for c in close}
    return sorted((c for c in close if ratio[c] >= ratio[close[0]] - 0.02), key=lambda c: (-ratio[c], c))


def _close_keys(name: str, hints: dict, prefix: str) -> list[str]:
    """The keys a mistyped ``name`` (in the section at ``prefix``) was probably meant as: close matches
    in its own section, else a key of that name (or nearly) in another section."""
    close = _closest(name, hints, 0.6)
    if close:
        return [f"{prefix}{c}" for c in close]
    keys = _dotted_keys(Config())
    leaves = _closest(name, {k.rsplit(".", 1)[-1] for k in keys}, 0.8)
    return [k for leaf in leaves for k in keys if k.rsplit(".", 1)[-1] == leaf][:3]


def _merge(obj: Any, updates: dict, prefix: str = "") -> None:
    hints = typing.get_type_hints(type(obj))
    for name, value in updates.items():
        key = f"{prefix}{name}"
        if name not in hints:
            known = ", ".join(sorted(hints))
            close = _close_keys(str(name), hints, prefix)
            guess = f": did you mean {' or '.join(close)}?" if close else ""
            raise ConfigError(f"unknown config key '{key}'{guess} (known here: {known})")
        current = getattr(obj, name)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"config key '{key}' is a section; give a mapping, got {value!r}")
            _merge(current, value, prefix=f"{key}.")
        else:
            setattr(obj, name, _coerce(value, hints[name], key))


def parse_override(text: str) -> dict:
    """``a.b.c=value`` -> ``{"a": {"b": {"c": value}}}``, the value parsed as YAML (``null``, ``true``)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    dotted, raw = text.split("=", 1)
    value = yaml.safe_load(raw) if raw.strip() else ""
    out: dict = {}
    node = out
    parts = dotted.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out


def add_config_arguments(parser) -> None:
    """``--config`` and the dotted overrides, as every command that builds a Config takes them."""
    parser.add_argument("--config", help="YAML config file (default: the built-in tiny config)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=50 run.dir=x")


def _vocab_given(update: dict, given: bool) -> bool:
    """Whether ``model.vocab_size`` is set once ``update`` (a YAML file or an override) is merged; drops a
    ``null``/``auto`` value from it, which asks for the data set's vocabulary instead."""
    model = update.get("model")
    if not isinstance(model, dict) or "vocab_size" not in model:
        return given
    if model["vocab_size"] is None or model["vocab_size"] == "auto":
        del model["vocab_size"]
        return False
    return True


def data_vocab_size(cfg: Config) -> int | None:
    """The vocabulary of the configured data set(s), from their manifests; None for the builtin corpus, a
    generated task (``data.synthetic``) and data sets without a readable manifest."""
    d = cfg.data
    if d.synthetic:
        return None
    if d.sources:
        paths = [src["path"] for src in d.sources if isinstance(src, dict) and "path" in src]
    elif d.source == "builtin":
        return None
    else:
        paths = [d.source]
    from data_tools.shard_format import manifest_vocab_size

    sizes = [n for n in (manifest_vocab_size(str(p)) for p in paths) if isinstance(n, int)]
    return max(sizes) if sizes else None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    cfg = Config()
    vocab_given = steps_given = False
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: invalid YAML: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
        try:
            vocab_given = _vocab_given(data, vocab_given)
            steps_given = steps_given or _steps_given(data)
            _merge(cfg, data)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from e
    for text in overrides or []:
        update = parse_override(text)
        vocab_given = _vocab_given(update, vocab_given)
        steps_given = steps_given or _steps_given(update)
        _merge(cfg, update)
    if not vocab_given:
        cfg.model.vocab_size = data_vocab_size(cfg) or DEFAULT_VOCAB_SIZE
    validate(cfg)
    _steps_from_tokens(cfg, steps_given)
    return cfg


def _steps_given(update: dict) -> bool:
    train = update.get("train")
    return isinstance(train, dict) and "max_steps" in train


def _steps_from_tokens(cfg: Config, steps_given: bool) -> None:
    """``train.max_tokens`` -> ``train.max_steps`` (whole steps, rounded up), so everything downstream (the
    schedule, the deadline, the planner, the console) reads one length. A saved config carries both, in
    agreement; a ``max_steps`` given beside ``max_tokens`` that disagrees with it is refused."""
    t = cfg.train
    if t.max_tokens < 0:
        raise ConfigError(f"config key 'train.max_tokens' must be >= 0, got {t.max_tokens}")
    if not t.max_tokens:
        return
    from ..rampup import steps_for_tokens

    steps = steps_for_tokens(t.max_tokens, t.global_batch_size, t.batch_rampup, cfg.model.seq_len)
    if steps_given and t.max_steps != steps:
        raise ConfigError(
            f"train.max_tokens={t.max_tokens} is {steps} steps of train.global_batch_size x model.seq_len "
            f"tokens (after any train.batch_rampup), but train.max_steps={t.max_steps} is also set; set one"
        )
    t.max_steps = steps


def save_config(cfg: Config, path: Path) -> None:
    from ..atomic import atomic_write_text

    atomic_write_text(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))


RUN_CONFIG_HEADER = "# goat-dist: the resolved config this run ran with, rewritten at each start of the run\n"
RUN_RECORDS = ("metrics.jsonl", "checkpoints", "last_exit.json")  # a run dir a run has trained into


def foreign_run_config(run_dir: Path) -> Path | None:
    """``<run_dir>/config.yaml`` when no run wrote it (no header, in a directory no run has trained into):
    a user's own config file kept in the run dir, perhaps the one passed as ``--config``. The run would
    replace it with its resolved config (comments and ``auto`` values lost), so the run refuses to start
    (``run_lock.WorldLock``). A config.yaml without the header in a run's directory is an older
    version's, and is replaced."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file() or any((Path(run_dir) / name).exists() for name in RUN_RECORDS):
        return None
    with path.open("rb") as f:
        head = f.read(len(RUN_CONFIG_HEADER.encode()))
    return None if head == RUN_CONFIG_HEADER.encode() else path


def save_run_config(cfg: Config, run_dir: Path) -> Path:
    """``<run_dir>/config.yaml``: the run's resolved config under a header that marks it as the run's."""
    from ..atomic import atomic_write_text

    path = Path(run_dir) / "config.yaml"
    atomic_write_text(path, RUN_CONFIG_HEADER + yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return path
