"""The service's configuration: one frozen value of frozen option groups."""

from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING, Any

from .data_plane import DataPlane
from .index import Index
from .limits import Limits
from .listen import Listen
from .observability import Observability
from .security import Security
from .tier import Tier
from .transfer import Transfer
from .tuning import Tuning

__all__ = ["GROUPS", "Config"]


@dataclasses.dataclass(frozen=True)
class Config:
    """Every option of a service, by group (``config.listen.uds_path``). An option's flag,
    environment variable and YAML key are its field name (``--uds-path``, ``KVSERVICE_UDS_PATH``,
    ``uds_path:``), unique across groups; ``kvservice.config.load_config`` fills one."""

    listen: Listen = dataclasses.field(default_factory=Listen)
    security: Security = dataclasses.field(default_factory=Security)
    transfer: Transfer = dataclasses.field(default_factory=Transfer)
    data_plane: DataPlane = dataclasses.field(default_factory=DataPlane)
    index: Index = dataclasses.field(default_factory=Index)
    limits: Limits = dataclasses.field(default_factory=Limits)
    observability: Observability = dataclasses.field(default_factory=Observability)
    tuning: Tuning = dataclasses.field(default_factory=Tuning)
    tier: Tier = dataclasses.field(default_factory=Tier)

    def validate(self) -> Config:
        """Return self if every option is valid, else raise ConfigError naming the option."""
        self.listen.validate()
        self.transfer.validate()
        self.data_plane.validate()
        self.tuning.validate()
        self.index.validate()
        self.security.validate(self.listen.tcp_address, self.listen.peer_tcp_address)
        self.limits.validate()
        self.observability.validate()
        self.tier.validate()
        return self

    if not TYPE_CHECKING:  # mypy flags a flat name; at run time it still reads, with a warning

        def __getattr__(self, name: str) -> Any:
            """``config.uds_path`` (the flat layout before the groups): deprecated, still read."""
            for group, cls in GROUPS:
                if name in _MEMBERS[cls]:
                    warnings.warn(
                        f"Config.{name} is deprecated: use Config.{group}.{name}",
                        DeprecationWarning,
                        stacklevel=2,
                    )
                    return getattr(getattr(self, group), name)
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def peers_on_engine_tcp(self) -> bool:
        """KVPeer rides the engine TCP listener: no listener of its own, and peers either
        authenticate with the peer token or nobody is authenticated (``insecure``)."""
        return (
            bool(self.listen.tcp_address)
            and not self.listen.peer_tcp_address
            and (self.security.insecure or bool(self.security.peer_token_file))
        )


# (attribute, class) of each group, in the order of the declaration, of --help and of the docs.
GROUPS: tuple[tuple[str, type], ...] = (
    ("listen", Listen),
    ("security", Security),
    ("transfer", Transfer),
    ("data_plane", DataPlane),
    ("index", Index),
    ("limits", Limits),
    ("observability", Observability),
    ("tuning", Tuning),
    ("tier", Tier),
)

# the names a group answers: its fields and its properties and methods
_MEMBERS: dict[type, frozenset[str]] = {
    cls: frozenset(n for n in dir(cls) if not n.startswith("_")) - {"validate"} for _, cls in GROUPS
}
