"""Who is a party to a transfer, and so may stop it from another service (docs/design/security.md).

A receiver rank's declaration gives each sender rank that fetches its plan a random ticket
(``ReceivePlan.sender_ticket``). The ticket, not the peer's credentials, proves that a call comes
from that sender: a peer token proves only membership of the cluster, and over mutual TLS one
service may run many senders. Commits and staging reservations are checked in receiver.py;
aborts here::

    abort arriving at                  stops it when
    ──────────────────────────────────────────────────────────────────────────────────────────
    a receiver rank (Incoming)         it carries the ticket of one of its senders (or of an
                                       offer it pushed, data path v3 §3), or the
                                       caller proved an identity (certificate name, or "local")
                                       that is the bound sender's, or that allowed_senders names
                                       before any plan went out
    a sender rank (Outgoing)           it comes from the receiving service (origin) and carries
                                       a ticket one of its plans gave, or from "local" (this
                                       service or a co-located one, proven on the Unix socket)

A peer-token holder without a ticket stops nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..identity import LOCAL_PEER
from .receiver import Incoming, ticket_matches

if TYPE_CHECKING:
    from .sender import Outgoing

__all__ = ["may_abort_in", "may_abort_out"]


def may_abort_in(inc: Incoming, origin: str, identity: str, ticket: str) -> bool:
    """A peer abort from service ``origin`` (proven as ``identity``) may stop this declaration."""
    if ticket and (any(ticket_matches(t, ticket) for t in inc.tickets.values()) or inc.holds_offer(ticket)):
        return True
    if not identity:  # a token-only peer: its ticket is its only proof
        return False
    if origin in inc.identities:
        return inc.identities[origin] == identity
    return identity in inc.allowed_senders or (identity == LOCAL_PEER and not inc.allowed_senders)


def may_abort_out(out: Outgoing, identity: str, ticket: str) -> bool:
    """A peer abort from the receiving service of ``out`` may stop this sender rank."""
    if identity == LOCAL_PEER:
        return True
    # NOTE: the tickets as they arrived, not the targets: those are set a step later, and an
    # abort in between must still stop this sender before it writes.
    return bool(ticket) and any(ticket_matches(t, ticket) for t in out.tickets)
