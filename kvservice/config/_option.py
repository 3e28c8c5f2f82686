"""What every option group shares: the error naming an option, a field with its one help text,
and small checks."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

__all__ = ["ConfigError", "check_choice", "check_host_port", "check_range", "object_list", "opt", "uid_list"]


class ConfigError(ValueError):
    """A configuration option is invalid; the message names the option."""


def opt(default: Any, help: str) -> Any:
    """A group field: its default and its documentation (``--help``, the docs) in one place."""
    return dataclasses.field(default=default, metadata={"help": help})


def check_range(name: str, value: float, low: float, high: float, what: str = "") -> None:
    """``low <= value <= high`` or ConfigError naming ``name``."""
    if not low <= value <= high:
        raise ConfigError(f"{name}: must be {what or f'in {low}..{high}'}")


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    """``value`` is one of ``choices`` or ConfigError naming ``name``."""
    if value not in choices:
        listed = ", ".join(repr(c) for c in choices[:-1]) + f" or {choices[-1]!r}"
        raise ConfigError(f"{name}: {value!r} is not {listed}")


def check_host_port(name: str, value: str) -> None:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"{name}: {value!r} is not host:port")


def uid_list(name: str, text: str) -> set[int]:
    """The uids of a comma-separated list, or ConfigError naming ``name``."""
    try:
        return {int(u) for u in text.split(",") if u.strip()}
    except ValueError:
        raise ConfigError(f"{name}: {text!r} is not a comma-separated list of uids") from None


def object_list(name: str, text: str, keys: set[str], required: tuple[str, ...]) -> list[dict[str, Any]]:
    """A JSON list of objects with only ``keys`` and non-empty strings at ``required``."""
    if not text:
        return []
    try:
        items = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{name}: not valid JSON ({exc})") from None
    if not isinstance(items, list):
        raise ConfigError(f"{name}: must be a list of stream objects")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ConfigError(f"{name}[{i}]: must be an object")
        unknown = set(item) - keys
        if unknown:
            raise ConfigError(f"{name}[{i}]: unknown keys {sorted(unknown)}")
        for key in required:
            if not isinstance(item.get(key), str) or not item[key]:
                raise ConfigError(f"{name}[{i}].{key}: a non-empty string is required")
    return items
