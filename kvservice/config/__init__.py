"""Service configuration: a frozen ``Config`` of frozen option groups (listen, security,
transfer, data_plane, index, limits, observability, tuning, tier), filled from (highest first)
command-line flags, ``KVSERVICE_*`` environment variables, an optional YAML file and the
defaults, validated once at start with messages that name the option.

Every field's ``metadata["help"]`` is its documentation; its flag is ``--field-name`` and its
environment variable ``KVSERVICE_FIELD_NAME``, whatever its group.
"""

from __future__ import annotations

from ._config import GROUPS, Config
from ._loader import DEPRECATED_ENV, OPTIONS, add_flags, load_config, parse_args, with_options
from ._option import ConfigError
from .data_plane import DataPlane
from .index import Index
from .limits import Limits
from .listen import Listen
from .observability import Observability
from .security import Security
from .tier import Tier
from .transfer import Transfer
from .tuning import Tuning

__all__ = [
    "DEPRECATED_ENV",
    "GROUPS",
    "OPTIONS",
    "Config",
    "ConfigError",
    "DataPlane",
    "Index",
    "Limits",
    "Listen",
    "Observability",
    "Security",
    "Tier",
    "Transfer",
    "Tuning",
    "add_flags",
    "load_config",
    "parse_args",
    "with_options",
]
