"""Transfer calls of both clients, written once as steps (see ``_steps``, ``_calls``).

A transfer is declared by the receiving engine (``expect_delta``) and fed by each sender
(``send_delta``, chunk by chunk); its end is read where it was made::

    expect_delta ─▶ the lane's CALL (once the Transfers stream reports ends) ─▶ else the stream ─▶ else unary
    send_delta   ─▶ the lane (LaneSend) ─▶ else the stream ─▶ else unary
    wait         ─▶ the book of ends (stream, lane) ─▶ else a WatchTransfers stream
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from . import _requests as rq
from . import lane_wire
from ._calls import Calls
from ._effects import SESSION, BookWait, LaneCall
from ._errors import DeadlineExceeded, Unavailable
from ._proto import kvservice_pb2 as pb
from ._steps import Steps, op, relay, stream_op
from ._types import TransferStatus

__all__ = ["TransferCalls"]


class TransferCalls(Calls):
    """Declaring, sending, watching and ending transfers."""

    @op
    def expect_delta(
        self,
        transfer_id: str,
        buffer_set_id: str,
        *,
        prefix_pages: int,
        dst_page_indices: Iterable[int] | np.ndarray,
        expected_senders: int = 0,
        deadline_ms: int = 0,
        aux: Mapping[str, Iterable[int]] | None = None,
        publish_tokens: rq.TokensLike | None = None,
        prefix_page_indices: Iterable[int] | np.ndarray = (),
        allowed_senders: Iterable[str] = (),
        sender_address: str = "",
        from_tier: bool = False,
    ) -> Steps[TransferStatus]:
        """Declare transfer ``transfer_id`` into this client's buffer set. ``sender_address``: the
        sending engine's kvservice, when known; the service then lets only that service's proven
        identity fetch the plan (``allowed_senders`` filled for you, see docs/design/security.md).
        ``from_tier``: the leading pages past the prefix that the node's host tier holds (by the
        hashes of ``publish_tokens``, required then) are copied from the tier before this returns,
        and the senders skip them like the prefix."""
        req = rq.expect(
            transfer_id, buffer_set_id, prefix_pages, dst_page_indices, expected_senders, deadline_ms,
            aux, publish_tokens, prefix_page_indices, allowed_senders,
        )  # fmt: skip
        req.sender_address = sender_address
        req.from_tier = from_tier
        lane = self._lane.get((yield SESSION))  # open before the transfer: its END may come this way
        rid = rq.new_request_id()
        resp = None
        if lane is not None and "expect_delta" in lane.calls_served and self._lane_reports_ends():
            body = yield LaneCall(lane, lane_wire.CALL_EXPECT, rid, req.SerializeToString(), self.timeout)
            resp = pb.ExpectDeltaResponse.FromString(body) if body is not None else None
        if resp is None:  # fallback: the same request id (a call the lane lost runs once)
            resp = yield from self._transfer("expect_delta", "ExpectDelta", req, rid)
        return self._made(transfer_id, TransferStatus.from_proto(resp.status))

    @op
    def send_delta(
        self,
        transfer_id: str,
        buffer_set_id: str,
        *,
        src_page_indices: Iterable[int] | np.ndarray,
        peer_address: str,
        chunk_offset: int = 0,
        last_chunk: bool = True,
        aux: Mapping[str, Iterable[int]] | None = None,
        deadline_ms: int = 0,
        path: str = "auto",
        no_duplicate_mark: bool = False,
    ) -> Steps[TransferStatus]:
        """Queue a chunk of transfer ``transfer_id`` towards ``peer_address``.

        ``no_duplicate_mark``: this engine will need the pages again (the conversation's next
        turn comes back here), so the service must not mark them as a P/D duplicate at DONE.
        On the lane when the service takes it there (a few µs of the calling thread).
        """
        sent = self._lane_send.try_send(
            self._session.ready_id() or (yield SESSION),
            transfer_id, buffer_set_id, src_page_indices, peer_address, chunk_offset, last_chunk,
            aux, path, no_duplicate_mark,
        )  # fmt: skip
        if sent is not None:
            return sent
        req = rq.send(
            transfer_id, buffer_set_id, src_page_indices, chunk_offset, last_chunk, peer_address,
            aux, deadline_ms, path, no_duplicate_mark,
        )  # fmt: skip
        resp = yield from self._transfer("send_delta", "SendDelta", req)
        return self._made(transfer_id, TransferStatus.from_proto(resp.status))

    @op
    def poll(self, transfer_ids: Sequence[str] = ()) -> Steps[list[TransferStatus]]:
        r = yield from self._rpc("Poll", pb.PollRequest(transfer_ids=list(transfer_ids)))
        return self._observed(r.statuses)

    @stream_op(TransferStatus)
    def watch(self, transfer_ids: Sequence[str] = (), include_current: bool = True) -> Steps[None]:
        """Stream status changes until the caller stops iterating (or the server ends).

        A broken connection is resumed with the session: the stream is reopened with the current
        statuses, so a change is never missed (a status may then repeat).
        """
        return (yield from self._statuses(transfer_ids, include_current, None))

    @op
    def wait(self, transfer_id: str, timeout: float | None = None) -> Steps[list[TransferStatus]]:
        """Block until every status of ``transfer_id`` on this node is terminal; return them.

        Raises DeadlineExceeded when ``timeout`` (default: the client's) passes first.
        """
        deadline = time.monotonic() + (timeout or self.timeout)
        try:  # the sides this client made on its Transfers stream: their ends arrive there
            ended = yield BookWait(transfer_id, deadline)
        except TimeoutError:
            raise DeadlineExceeded("the transfer did not end before the wait's timeout") from None
        if ended is not None:
            self.owned.observe(ended)
            return ended  # type: ignore[no-any-return]
        latest: dict[tuple[str, str], TransferStatus] = {}

        def take(st: TransferStatus) -> list[TransferStatus] | None:
            latest[(st.role, st.buffer_set_id)] = st
            return list(latest.values()) if all(s.terminal for s in latest.values()) else None

        done = yield from relay(self._statuses([transfer_id], True, deadline), take)
        if done is None:
            raise Unavailable("status stream ended before the transfer did")
        return done

    @op
    def abort(self, transfer_id: str, reason: str = "") -> Steps[list[TransferStatus]]:
        req = pb.AbortRequest(transfer_id=transfer_id, reason=reason)
        r = yield from self._transfer("abort", "Abort", req)
        return self._observed(r.statuses)
