"""Who may send a declared transfer: a sending service's rank binds to a declaration once (at
GetReceivePlan, or at its first commit when the receiver offered the plan at ExpectDelta), as
the peer identity it proved, with a ticket; every commit and staging request then has to come
from that identity with that ticket (docs/security.md)."""

from __future__ import annotations

import dataclasses
import hmac
import secrets
from typing import TYPE_CHECKING

import numpy as np
from kvservice_client import Layout

from ..errors import Aborted, FailedPrecondition, KVServiceError, PermissionDenied
from ..kernels.heads import plan_heads
from .plan import Units
from .records import TransferTable

if TYPE_CHECKING:
    from .receiver import Incoming

__all__ = ["Offer", "SenderBinding", "check_compatible", "ticket_matches"]


def check_compatible(src: Layout, dst: Layout) -> None:
    """FAILED_PRECONDITION unless the tokens of ``src`` can be written into ``dst``: the per-token
    rows must agree; page size and page layout may differ (the kernels convert)."""
    for field in ("kind", "num_layers", "dtype", "head_dim_k", "head_dim_v", "total_kv_heads"):
        a, b = getattr(src, field), getattr(dst, field)
        if a != b:
            raise FailedPrecondition(f"layout mismatch: sender {field}={a}, receiver {field}={b}")


def ticket_matches(expected: str, given: str) -> bool:
    """``given`` is the (non-empty) ticket ``expected``, compared in constant time."""
    return bool(expected) and hmac.compare_digest(expected.encode(), given.encode())


@dataclasses.dataclass(frozen=True)
class Offer:
    """This declaration's plan, offered unasked to the sending service its ExpectDelta named
    (data path v3 §3, docs/decisions/0016): the ticket binds whichever rank of that service, as
    ``identity``, commits first with it."""

    ticket: str
    address: str
    identity: str


class SenderBinding:
    """The binding rules of one service's declarations (``table``: where a failed one ends)."""

    def __init__(self, table: TransferTable) -> None:
        self.table = table

    @staticmethod
    def may_bind(inc: Incoming, transfer_id: str, key: str, sender_id: str, identity: str) -> None:
        if inc.allowed_senders and identity not in inc.allowed_senders:
            raise PermissionDenied(
                f"allowed_senders: peer {identity or '(no certificate identity)'!r} may not send "
                f"transfer {transfer_id!r}"
            )
        bound = inc.identities.get(sender_id)
        if key in inc.tickets or (bound is not None and bound != identity):
            # NOTE: a sender rank binds once (docs/design/security.md): a second fetch under its name, by
            # anyone, would hand out its ticket or rebind it to another connection.
            raise PermissionDenied(
                f"sender_service_id: sender {key!r} already has the plan of transfer {transfer_id!r}"
            )

    def bind(
        self, inc: Incoming, src: Layout, key: str, sender_id: str, address: str, identity: str, ticket: str
    ) -> None:
        """Make sender rank ``key`` (layout ``src``) a sender of ``inc`` with ``ticket``; a layout
        that cannot write these pages fails the declaration (no await: one step)."""
        if inc.rec.terminal:
            raise Aborted(f"transfer {inc.rec.transfer_id!r} is {inc.rec.state}: {inc.rec.error}")
        try:
            check_compatible(src, inc.bs.layout)
            derived = sum(
                1
                for r in plan_heads(src.total_kv_heads, src.tp_size, inc.bs.layout.tp_size)
                if r.dst_rank == inc.bs.layout.tp_rank
            )
            if inc.expected_senders and inc.expected_senders != derived:
                raise FailedPrecondition(
                    f"expected_senders: declared {inc.expected_senders} but TP {src.tp_size} -> "
                    f"{inc.bs.layout.tp_size} means {derived} sender ranks write to rank "
                    f"{inc.bs.layout.tp_rank}"
                )
        except KVServiceError as exc:
            self.table.finish(inc.rec, "FAILED", exc.code.name, exc.message)
            raise
        inc.expected_senders = derived
        inc.senders[sender_id] = address
        inc.identities[sender_id] = identity
        inc.tickets[key] = ticket
        units = inc.units.setdefault(key, Units.of(src, inc.bs.layout))
        inc.covered.setdefault(key, np.zeros(inc.dst_pages.size * units.dst_per_page, dtype=bool))
        self.table.update(inc.rec, state="TRANSFERRING")

    # -- plans offered before the sender asks (data path v3 §3) ---------------------------------
    def offer(self, inc: Incoming, sender_id: str, address: str, identity: str) -> Offer | None:
        """An offer of ``inc`` to the sending service ``sender_id`` (proven as ``identity`` on its
        open channel), or None when that service may not send it or already holds a plan."""
        if inc.rec.terminal or inc.landing is not None or sender_id in inc.offers:
            return None
        # NOTE: only to a proven identity the declaration names: a channel's service id and
        # address are its own claims. A declaration that names none (peers by token: a token
        # proves membership of the cluster, not who) may be offered to the token peer that
        # claims its sender's address: it gains nothing a GetReceivePlan would not give any token
        # holder (the plan's ticket binds whoever commits first, docs/security.md), and the
        # commit must carry the offer's ticket from the same (token) identity.
        if inc.allowed_senders and identity not in inc.allowed_senders:
            return None
        if not inc.allowed_senders and identity:
            return None
        if sender_id in inc.identities:  # a rank of it already asked: it has its plans
            return None
        inc.offers[sender_id] = Offer(secrets.token_hex(16), address, identity)
        return inc.offers[sender_id]

    def bind_offered(
        self, inc: Incoming, src: Layout, key: str, sender_id: str, identity: str, ticket: str
    ) -> None:
        """A commit of sender rank ``key`` carrying its layout: bind it now if it holds this
        declaration's offer (as the identity the offer went to) and is not bound yet; every
        check GetReceivePlan makes applies. Nothing happens for a bound rank (check_sender
        decides) or a commit without a matching offer (it is refused there)."""
        offer = inc.offers.get(sender_id)
        if key in inc.tickets or offer is None or not ticket_matches(offer.ticket, ticket):
            return
        if offer.identity != identity:
            raise PermissionDenied(
                f"sender_service_id: the plan of {inc.rec.transfer_id!r} was offered to another peer; "
                f"this commit comes from {identity!r}"
            )
        self.may_bind(inc, inc.rec.transfer_id, key, sender_id, identity)
        self.bind(inc, src, key, sender_id, offer.address, identity, offer.ticket)

    @staticmethod
    def check_sender(inc: Incoming, sender_id: str, identity: str, key: str = "", ticket: str = "") -> None:
        """A commit comes from the sender rank ``key`` that fetched this transfer's plan, as the
        same peer, with the ticket the plan gave it (in every auth mode: a peer token proves
        membership of the cluster, the ticket that this is the sender)."""
        if sender_id not in inc.senders:
            raise PermissionDenied(
                f"sender_service_id: {sender_id!r} has no receive plan for transfer {inc.rec.transfer_id!r}"
            )
        if inc.identities.get(sender_id) != identity:
            raise PermissionDenied(
                f"sender_service_id: {sender_id!r} fetched the plan of {inc.rec.transfer_id!r} as another "
                f"peer; this commit comes from {identity!r}"
            )
        if key and not ticket_matches(inc.tickets.get(key, ""), ticket):
            raise PermissionDenied(
                f"sender_ticket: not the ticket of sender {key!r} for transfer {inc.rec.transfer_id!r}"
            )
