"""Landing transfers in the SDK: ``expect_landing``, ``wait_landed`` and ``claim`` (docs/decisions/0012).

A decode engine that cannot allocate pages yet declares the transfer as a *landing*: its service
lands the pages in a landing pool on that node and reports LANDED (the prefill engine's pages are
then free). When the engine has allocated, it claims them into its pages (one same-device copy,
then DONE). Landed pages that are not claimed within the landing TTL are freed and the transfer
ends FAILED with a reason; :meth:`claim` then says so.

::

    kv.expect_landing("room-7", bs, prefix_pages=m, publish_tokens=prompt,
                      prefix_page_indices=held, ttl_ms=5000)      # no destination pages
    ...                                                            # prefill sends as usual
    kv.claim("room-7", bs, dst_page_indices=new_pages)            # waits for LANDED if needed

Aux rows land too: the declaration counts them per aux region (``aux={"meta": 1}``), the senders
name theirs as usual, and the claim names the destination rows (``aux={"meta": [row]}``).

Written once as steps (``_steps``), mixed into both faces: :class:`~kvservice_client.Client` and
(awaited) :class:`~kvservice_client.AsyncClient`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping

import numpy as np

from . import _requests as rq
from ._errors import Unavailable
from ._proto import kvservice_pb2 as pb
from ._steps import Steps, op, relay
from ._transfer_calls import TransferCalls
from ._types import TransferStatus

__all__ = ["Claimed", "LandingCalls"]


@dataclasses.dataclass(frozen=True)
class Claimed:
    """A claim's outcome: the receiver's DONE status and the service's time on it once landed."""

    status: TransferStatus
    claim_us: int


def landing_request(
    transfer_id: str,
    buffer_set_id: str,
    prefix_pages: int,
    pages: int,
    ttl_ms: int,
    expected_senders: int,
    deadline_ms: int,
    publish_tokens: rq.TokensLike | None,
    prefix_page_indices: Iterable[int] | np.ndarray,
    allowed_senders: Iterable[str],
    sender_address: str,
    aux: Mapping[str, int] | None = None,
) -> pb.ExpectDeltaRequest:
    req = rq.expect(
        transfer_id,
        buffer_set_id,
        prefix_pages,
        (),
        expected_senders,
        deadline_ms,
        None,
        publish_tokens,
        prefix_page_indices,
        allowed_senders,
    )
    req.sender_address = sender_address
    req.landing.pages = rq._u32(pages, "pages")
    req.landing.ttl_ms = rq._u32(ttl_ms, "ttl_ms")
    for name, n in (aux or {}).items():
        req.landing.aux.add(name=name, num_rows=rq._u32(n, f"aux[{name}]"))
    return req


def claim_request(
    transfer_id: str,
    buffer_set_id: str,
    dst_page_indices: Iterable[int] | np.ndarray,
    wait_ms: int,
    aux: Mapping[str, Iterable[int]] | None = None,
) -> pb.ClaimRequest:
    return pb.ClaimRequest(
        transfer_id=transfer_id,
        buffer_set_id=buffer_set_id,
        dst_page_indices=rq._idx(dst_page_indices, "dst_page_indices"),
        wait_ms=rq._u32(wait_ms, "wait_ms"),
        aux=rq._aux(aux),
    )


def _settled(latest: dict[str, TransferStatus]) -> bool:
    return bool(latest) and all(s.state == "LANDED" or s.terminal for s in latest.values())


class LandingCalls(TransferCalls):
    """Landing calls of both clients."""

    @op
    def expect_landing(
        self,
        transfer_id: str,
        buffer_set_id: str,
        *,
        prefix_pages: int = 0,
        pages: int = 0,
        ttl_ms: int = 0,
        expected_senders: int = 0,
        deadline_ms: int = 0,
        publish_tokens: rq.TokensLike | None = None,
        prefix_page_indices: Iterable[int] | np.ndarray = (),
        allowed_senders: Iterable[str] = (),
        sender_address: str = "",
        aux: Mapping[str, int] | None = None,
    ) -> Steps[TransferStatus]:
        """Declare ``transfer_id`` as a landing into this node's landing pool, for buffer set
        ``buffer_set_id`` (its layout; only it may claim): ``pages`` delta pages past
        ``prefix_pages`` (0: every page of ``publish_tokens`` past the prefix), kept ``ttl_ms``
        after LANDED (0: the service default). ResourceExhausted at once when the pool cannot
        hold them (fall back to waiting for the allocation, or another engine). With
        ``publish_tokens`` routers see the landed pages in MatchPrefix (``landed_pages``) and the
        claim publishes them into the index. ``aux`` (aux region name -> row count) lands that many
        aux rows too: the senders name as many rows, the claim names their destination rows."""
        req = landing_request(
            transfer_id, buffer_set_id, prefix_pages, pages, ttl_ms, expected_senders, deadline_ms,
            publish_tokens, prefix_page_indices, allowed_senders, sender_address, aux,
        )  # fmt: skip
        resp = yield from self._transfer("expect_delta", "ExpectDelta", req)
        return self._made(transfer_id, TransferStatus.from_proto(resp.status))

    @op
    def wait_landed(self, transfer_id: str, timeout: float | None = None) -> Steps[list[TransferStatus]]:
        """Block until every receiver side of ``transfer_id`` here is LANDED (or ended); return them.
        Raises DeadlineExceeded when ``timeout`` (default: the client's) passes first."""
        deadline = time.monotonic() + (timeout or self.timeout)
        latest: dict[str, TransferStatus] = {}

        def take(st: TransferStatus) -> list[TransferStatus] | None:
            if st.role == "RECEIVER":
                latest[st.buffer_set_id] = st
            return list(latest.values()) if _settled(latest) else None

        landed = yield from relay(self._statuses([transfer_id], True, deadline), take)
        if landed is None:
            raise Unavailable("status stream ended before the transfer landed")
        return landed

    @op
    def claim(
        self,
        transfer_id: str,
        buffer_set_id: str,
        *,
        dst_page_indices: Iterable[int] | np.ndarray,
        wait_ms: int = 0,
        aux: Mapping[str, Iterable[int]] | None = None,
    ) -> Steps[Claimed]:
        """Copy landed ``transfer_id`` into ``dst_page_indices`` of ``buffer_set_id`` (one per landed
        page, in sequence order), and its landed aux rows into rows ``aux`` (aux region name ->
        rows, one entry per landed aux region, as many rows as landed); DONE on return. A transfer
        still arriving is waited for, at most ``wait_ms`` (0: the client's timeout).
        FailedPrecondition names what became of a transfer that can no longer be claimed (expired,
        evicted, aborted); InvalidArgument names a bad field and leaves the landing claimable."""
        wait_ms = wait_ms or int(self.timeout * 1000)
        req = claim_request(transfer_id, buffer_set_id, dst_page_indices, wait_ms, aux)
        r = yield from self._transfer("claim", "Claim", req)
        status = TransferStatus.from_proto(r.status)
        self.owned.observe((status,))
        return Claimed(status, int(r.claim_us))
