"""The backend's settings, from SGLang's environment (read once, where a manager starts).

``SGLANG_KVSERVICE_ADDRESS``: this node's kvservice (default ``unix:/tmp/kvservice-<uid>.sock``);
``SGLANG_KVSERVICE_PEER_ADDRESS``: the address other nodes' services reach it at (default the
first); ``SGLANG_KVSERVICE_DEADLINE_MS``: a transfer's deadline (30000);
``SGLANG_KVSERVICE_BOOTSTRAP_TIMEOUT_S``: how long a prefill waits for a decode to claim a room
(300); ``SGLANG_KVSERVICE_LANDING_TTL_MS``: the decode's landing option (0: off).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

__all__ = ["Settings", "service_address"]


def service_address() -> str:
    """The local kvservice (``SGLANG_KVSERVICE_ADDRESS``)."""
    return os.environ.get("SGLANG_KVSERVICE_ADDRESS", f"unix:/tmp/kvservice-{os.getuid()}.sock")


def _number(name: str, default: str, kind: type[int] | type[float], positive: bool) -> Any:
    """``SGLANG_KVSERVICE_<name>`` as ``kind``: > 0 (``positive``) or >= 0, else the reason."""
    raw = os.environ.get(f"SGLANG_KVSERVICE_{name}", default)
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"SGLANG_KVSERVICE_{name}: {raw!r} is not a number") from None
    if value < 0 or (positive and value == 0):
        raise ValueError(f"SGLANG_KVSERVICE_{name}: {raw} must be {'> 0' if positive else '>= 0'}")
    return value


@dataclasses.dataclass(frozen=True)
class Settings:
    address: str
    peer_address: str
    deadline_ms: int
    bootstrap_timeout_s: float
    landing_ttl_ms: int

    @classmethod
    def from_env(cls) -> Settings:
        address = service_address()
        deadline = _number("DEADLINE_MS", "30000", int, positive=True)
        bootstrap = _number("BOOTSTRAP_TIMEOUT_S", "300", float, positive=True)
        landing = _number("LANDING_TTL_MS", "0", int, positive=False)
        return cls(
            address=address,
            peer_address=os.environ.get("SGLANG_KVSERVICE_PEER_ADDRESS", address),
            deadline_ms=deadline,
            bootstrap_timeout_s=bootstrap,
            landing_ttl_ms=landing,
        )
