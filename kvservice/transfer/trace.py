"""Points of one transfer's timeline (DEBUG logs): where a small transfer's time goes.

``mark(transfer_id, point)`` logs ``"transfer point"`` with CLOCK_MONOTONIC seconds (one clock
for every process of a host), so the points of the two services and of the engines line up.
``bench_transfer --timeline`` reads them into its JSON. Off (one level check) unless DEBUG.

    sender service:   send_rpc ─ plan_asked ─ plan_got ─ (packed batch) ─ commit_sent ─ ack_got
                      ─ SENDER_DONE ─ event_sent
    receiver service: expect_rpc ─ plan_served ─ commit_got ─ (unpacked batch) ─ RECEIVER_DONE
                      ─ event_sent
"""

from __future__ import annotations

import logging
import time

__all__ = ["enabled", "mark"]

log = logging.getLogger("kvservice.transfer.trace")


def enabled() -> bool:
    return log.isEnabledFor(logging.DEBUG)


def mark(transfer_id: str, point: str) -> None:
    """Log ``point`` of ``transfer_id`` now (DEBUG only)."""
    if log.isEnabledFor(logging.DEBUG):
        log.debug("transfer point", extra={"transfer_id": transfer_id, "point": point, "t": time.monotonic()})
