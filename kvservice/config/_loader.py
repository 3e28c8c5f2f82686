"""Filling a Config: defaults < YAML file < ``KVSERVICE_*`` environment < command-line flags.

Each option has one flat name, its field's, unique across the groups: the flag is
``--field-name``, the variable ``KVSERVICE_FIELD_NAME`` and the YAML key ``field_name`` (or
``group: {field_name: ...}``). Deprecated names still work with a warning (``DEPRECATED_ENV``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from ._config import GROUPS, Config
from ._option import ConfigError

__all__ = ["DEPRECATED_ENV", "OPTIONS", "add_flags", "load_config", "parse_args", "with_options"]

log = logging.getLogger(__name__)

# flat option name -> (group attribute, its field)
OPTIONS: dict[str, tuple[str, dataclasses.Field[Any]]] = {
    f.name: (group, f) for group, cls in GROUPS for f in dataclasses.fields(cls)
}

# an old environment variable -> the option it sets now (read with a warning)
DEPRECATED_ENV: dict[str, str] = {"KVLANE_NOTE_WITH_WRITE": "lane_note_with_write"}
# removed options: the one value that is now the behaviour (ignored with a warning), and why
REMOVED_ENV: dict[str, tuple[str, str]] = {
    "KVSERVICE_LANE_KERNEL": (
        "triton",
        "the lane's copy kernel is the Triton one only (docs/decisions/0026)",
    ),
}


def with_options(config: Config, **options: Any) -> Config:
    """``config`` with the options named by their flat names replaced (not validated)."""
    by_group: dict[str, dict[str, Any]] = {}
    for name, value in options.items():
        if name not in OPTIONS:
            raise ConfigError(f"{name}: unknown option")
        group, _ = OPTIONS[name]
        by_group.setdefault(group, {})[name] = value
    return dataclasses.replace(
        config, **{g: dataclasses.replace(getattr(config, g), **kw) for g, kw in by_group.items()}
    )


def _coerce(name: str, raw: Any) -> Any:
    kind = type(OPTIONS[name][1].default)
    if isinstance(raw, kind) and not (kind is int and isinstance(raw, bool)):
        return raw
    text = str(raw).strip()
    try:
        if kind is bool:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if kind is int:
            return int(text, 0)
        if kind is float:
            return float(text)
    except ValueError:
        raise ConfigError(f"{name}: {raw!r} is not a valid {kind.__name__}") from None
    return text


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add one ``--option-name`` flag per option (all default to 'not given'), one argument
    group per option group."""
    parser.add_argument("--config", help="YAML file with options (keys as in KVSERVICE_*).")
    for name, cls in GROUPS:
        group = parser.add_argument_group(f"{name}: {(cls.__doc__ or '').strip()}")
        for field in dataclasses.fields(cls):
            # NOTE: a boolean flag alone means true ("--insecure"); "--insecure false" also parses
            extra: dict[str, Any] = {"nargs": "?", "const": "true"} if isinstance(field.default, bool) else {}
            group.add_argument(
                "--" + field.name.replace("_", "-"),
                dest=field.name,
                default=None,
                help=field.metadata["help"],
                **extra,
            )


def _yaml_values(yaml_path: str) -> dict[str, Any]:
    try:
        loaded = yaml.safe_load(Path(yaml_path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"config: cannot read {yaml_path}: {exc}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config: {yaml_path} must hold a mapping of options")
    groups = {name for name, _ in GROUPS}
    flat: dict[str, Any] = {}
    for key, raw in loaded.items():
        name = str(key).replace("-", "_")
        if name in groups and isinstance(raw, dict):  # the nested form: listen: {uds_path: ...}
            for sub, value in raw.items():
                sub_name = str(sub).replace("-", "_")
                if OPTIONS.get(sub_name, ("",))[0] != name:
                    raise ConfigError(f"{key}.{sub}: unknown option in {yaml_path}")
                flat[sub_name] = value
        elif name in OPTIONS:
            flat[name] = raw
        else:
            raise ConfigError(f"{key}: unknown option in {yaml_path}")
    return {
        name: json.dumps(raw) if isinstance(raw, list) else _coerce(name, raw) for name, raw in flat.items()
    }


def load_config(
    flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    yaml_path: str | None = None,
) -> Config:
    """Merge defaults < YAML < environment < flags and validate."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    yaml_path = yaml_path or environ.get("KVSERVICE_CONFIG") or None
    if yaml_path:
        values.update(_yaml_values(yaml_path))
    for key, name in DEPRECATED_ENV.items():
        if key in environ:
            log.warning(
                "%s is deprecated: use KVSERVICE_%s (--%s)", key, name.upper(), name.replace("_", "-")
            )
            values[name] = _coerce(name, environ[key])
    for key, raw in environ.items():
        if key in REMOVED_ENV:
            now, why = REMOVED_ENV[key]
            if raw.strip().lower() != now:
                raise ConfigError(f"{key}: {raw!r} is no longer supported: {why}")
            log.warning("%s is ignored and will be refused in a later release: %s", key, why)
            continue
        if key.startswith("KVSERVICE_") and key != "KVSERVICE_CONFIG":
            name = key[len("KVSERVICE_") :].lower()
            if name not in OPTIONS:
                raise ConfigError(f"{key}: unknown environment option")
            values[name] = _coerce(name, raw)
    for name, raw in (flags or {}).items():
        if raw is not None and name in OPTIONS:
            values[name] = _coerce(name, raw)
    return with_options(Config(), **values).validate()


def parse_args(argv: Sequence[str] | None = None) -> Config:
    parser = argparse.ArgumentParser(prog="kvservice serve")
    add_flags(parser)
    ns = parser.parse_args(argv)
    return load_config(vars(ns), yaml_path=ns.config)
