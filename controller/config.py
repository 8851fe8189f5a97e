"""Settings of the ``ciayn`` command from four places, in this order of precedence:

1. the command line (``--model openai/gpt-4o-mini``);
2. environment variables: ``CIAYN_`` and the option's name in capitals with ``_`` for ``-``
   (``CIAYN_MODEL``, ``CIAYN_API_BASE``, ``CIAYN_EXECUTOR``, ``CIAYN_MAX_STEPS``, ...); a list
   option (``tools``, ``pass-env``) takes comma-separated names;
3. a configuration file: the file named by ``CIAYN_CONFIG``, else ``ciayn.toml`` in the current
   directory, else the ``[tool.ciayn]`` table of ``pyproject.toml`` there. Keys are the option names
   (``model = "openai/gpt-4o-mini"``, ``max-steps = 20``; ``max_steps`` works too);
4. the built-in defaults shown by ``--help``.

Only the options in ``SETTINGS`` are read from the environment and the file (not the task, the call
text or ``--json``). An unknown key in the file, or a value that does not parse, is a usage error
naming where it came from.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protocol.errors import CiaynError

ENV_PREFIX = "CIAYN_"
CONFIG_ENV = "CIAYN_CONFIG"
CONFIG_FILE = "ciayn.toml"
LIST_SETTINGS = frozenset({"tools", "pass_env"})

# Option dest -> built-in default (None: unset). Which commands take each is argparse's business.
SETTINGS: dict[str, Any] = {
    "model": "local",
    "api_base": None,
    "backend": "auto",
    "executor": None,
    "tools": None,
    "workspace": ".",
    "timeout": None,
    "memory_mb": None,
    "max_steps": 30,
    "max_cost": None,
    "max_tokens_total": None,
    "grammar": "auto",
    "prompt": "auto",
    "allow_tools": None,
    "temperature": None,
    "seed": None,
    "max_tokens": None,
    "curve_server_key": None,
    "curve_key": None,
    "pass_env": None,
    "profile": "default",
}


class ConfigError(CiaynError, ValueError):
    """A setting that cannot be used; the message names where it came from."""


@dataclass
class Layers:
    """The environment and the configuration file, as read."""

    env: Mapping[str, str]
    file: dict[str, Any] = field(default_factory=dict)
    file_name: str = ""


def _key(name: str) -> str:
    return name.strip().replace("-", "_")


def read_layers(env: Mapping[str, str] | None = None, cwd: Path | None = None) -> Layers:
    """Read the configuration file (if any) and keep the environment."""
    env = os.environ if env is None else env
    cwd = cwd or Path.cwd()
    layers = Layers(env=env)
    named = env.get(CONFIG_ENV)
    candidates: list[tuple[Path, bool]] = []
    if named:
        candidates.append((Path(named), False))
    else:
        candidates += [(cwd / CONFIG_FILE, False), (cwd / "pyproject.toml", True)]
    for path, in_pyproject in candidates:
        if named is None and not path.is_file():
            continue
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise ConfigError(f"cannot read the configuration file {path} ({CONFIG_ENV}): {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"the configuration file {path} is not valid TOML: {e}") from None
        table = data.get("tool", {}).get("ciayn") if in_pyproject else data
        if table is None:
            continue
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: [tool.ciayn] must be a table")
        name = f"{path} [tool.ciayn]" if in_pyproject else str(path)
        unknown = sorted(k for k in table if _key(k) not in SETTINGS)
        if unknown:
            known = ", ".join(k.replace("_", "-") for k in SETTINGS)
            raise ConfigError(f"{name}: unknown setting(s) {', '.join(unknown)}; the settings are: {known}")
        layers.file = {_key(k): v for k, v in table.items()}
        layers.file_name = name
        break
    return layers


def _convert(action: argparse.Action, raw: Any, where: str) -> Any:
    """A value from the environment or the file, through the option's own type and choices."""
    if action.dest in LIST_SETTINGS:
        items = raw.split(",") if isinstance(raw, str) else raw
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise ConfigError(f"{where}: expected a list of names, got {raw!r}")
        return [i.strip() for i in items if i.strip()]
    if isinstance(raw, bool | list | dict):
        raise ConfigError(f"{where}: expected a single value, got {raw!r}")
    value: Any = str(raw)
    if action.type is not None:
        try:
            value = action.type(value)  # type: ignore[operator]
        except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
            raise ConfigError(f"{where}: {e}") from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(str(c) for c in action.choices)
        raise ConfigError(f"{where}: must be one of {choices}, not {value!r}")
    return value


def apply(args: argparse.Namespace, parser: argparse.ArgumentParser, layers: Layers) -> dict[str, str]:
    """Fill every setting the command line left unset (None) from the environment, the file or the
    default, in that order. Returns where each setting that is not a default came from ("command
    line", "CIAYN_MODEL", "ciayn.toml"), for messages such as "--workspace has no effect"."""
    sources: dict[str, str] = {}
    actions = {a.dest: a for a in parser._actions}
    for dest, default in SETTINGS.items():
        action = actions.get(dest)
        if action is None or not hasattr(args, dest):
            continue  # this command does not take it
        if getattr(args, dest) is not None:
            sources[dest] = "command line"
            continue
        env_name = ENV_PREFIX + dest.upper()
        if layers.env.get(env_name, "") != "":
            setattr(args, dest, _convert(action, layers.env[env_name], env_name))
            sources[dest] = env_name
        elif dest in layers.file:
            setattr(args, dest, _convert(action, layers.file[dest], f"{layers.file_name}: {dest.replace('_', '-')}"))
            sources[dest] = layers.file_name
        else:
            setattr(args, dest, default)
    return sources
