"""What one call or one session may ask for, and a buffer set's default inbound budget."""

from __future__ import annotations

import dataclasses

from ._option import ConfigError, opt

__all__ = ["Limits"]


@dataclasses.dataclass(frozen=True)
class Limits:
    """Limits and budgets."""

    max_pages_per_call: int = opt(
        1_048_576, "Most page indices one call may name (ExpectDelta, SendDelta, PublishPages, ...)."
    )
    max_tokens_per_call: int = opt(4_194_304, "Most token ids one MatchPrefix or publish call may carry.")
    max_buffer_sets_per_session: int = opt(256, "Most buffer sets one session may hold registered.")
    max_transfers_per_session: int = opt(16_384, "Most unfinished transfers one session may have.")
    max_leases_per_session: int = opt(65_536, "Most live prefix leases one session may hold.")
    inbound_max_transfers: int = opt(
        0,
        "Default inbound budget of a buffer set: most unfinished inbound transfers (0: unlimited). "
        "Over it ExpectDelta is refused at once with RESOURCE_EXHAUSTED; RegisterBuffers may override.",
    )
    inbound_max_bytes: int = opt(
        0,
        "Default inbound budget of a buffer set: most bytes still to arrive over its unfinished "
        "inbound transfers (0: unlimited); RegisterBuffers may override.",
    )

    def validate(self) -> None:
        for name in (
            "max_pages_per_call",
            "max_tokens_per_call",
            "max_buffer_sets_per_session",
            "max_transfers_per_session",
            "max_leases_per_session",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1")
        for name in ("inbound_max_transfers", "inbound_max_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must be >= 0 (0: unlimited)")
