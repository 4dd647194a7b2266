"""``train.callbacks``: the user's own callbacks, named in the config.

Each entry is ``"package.module:Name"`` or ``"package.module:Name:arg1:arg2..."``: the module is imported
(``importlib``, from ``sys.path``: set ``PYTHONPATH`` for a module outside the installed packages) and
``Name(*args)`` is called, the arguments as strings (``"mypkg.hooks:StopAt:500"`` -> ``StopAt("500")``).
The object gets the trainer's events like the trainer's own callbacks (``callbacks.base``), on every rank,
sees the trainer through ``self.trainer`` (``callbacks.api.TrainerAPI``) and may keep state across a resume
(``state_dict`` / ``load_state_dict``).
This runs code the user chose, as a training script would: name only modules you trust.
"""

from __future__ import annotations

import importlib

from ...config import ConfigError


def split_entry(entry: str) -> tuple[str, str, list[str]]:
    """``"pkg.mod:Name:a:b"`` -> ``("pkg.mod", "Name", ["a", "b"])``; a malformed entry: ConfigError."""
    module, _, rest = entry.partition(":") if isinstance(entry, str) else ("", "", "")
    name, *args = rest.split(":") if rest else [""]
    if not module or not name.isidentifier():
        raise ConfigError(
            f"train.callbacks entry {entry!r} must look like 'package.module:Name' (optionally followed by "
            "':arg' strings passed to Name)"
        )
    return module, name, args


def load_callbacks(entries: list[str]) -> list:
    """The callback objects of ``train.callbacks``, in order; an entry that cannot be imported or built is
    a ConfigError naming it."""
    out = []
    for i, entry in enumerate(entries or []):
        module_name, name, args = split_entry(entry)
        where = f"train.callbacks[{i}]={entry!r}"
        try:
            module = importlib.import_module(module_name)
        except Exception as e:  # noqa: BLE001 - ImportError or whatever the module raised: name the entry
            raise ConfigError(f"{where}: cannot import {module_name}: {type(e).__name__}: {e}") from e
        factory = getattr(module, name, None)
        if not callable(factory):
            raise ConfigError(f"{where}: module {module_name} has no callable {name}")
        try:
            out.append(factory(*args))
        except Exception as e:  # noqa: BLE001 - a bad argument: name the entry
            raise ConfigError(f"{where}: {name}({', '.join(map(repr, args))}) failed: {e}") from e
    return out
