"""What a room's sender and receiver share: one SGLang request (``bootstrap_room``) is one
kvservice transfer, ``sgl-<room>``; its future, and how it reads as SGLang's ``KVPoll``::

    no call yet ─▶ WaitingForInput ─▶ Transferring (the future runs) ─▶ Success   (DONE)
                                                                    └▶ Failed    (FAILED, ABORTED,
                                                                        a client error, abort())
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import TYPE_CHECKING, Any

from kvservice_client import TransferStatus
from sglang.srt.disaggregation.base.conn import KVPoll, KVTransferMetric

from .bootstrap import http_json

if TYPE_CHECKING:
    from .manager import KVServiceManager

__all__ = ["KVServiceTransferError", "RoomTransfer", "abort_quietly", "put_quietly", "transfer_id"]

log = logging.getLogger(__name__)


class KVServiceTransferError(RuntimeError):
    def __init__(self, room: int, reason: str) -> None:
        super().__init__(f"kvservice transfer of bootstrap_room {room} failed: {reason}")
        self.room, self.reason = room, reason


def transfer_id(room: int) -> str:
    return f"sgl-{int(room)}"


class RoomTransfer:
    """The transfer future and the poll states of one side of a room."""

    def __init__(self, mgr: KVServiceManager, room: int | None) -> None:
        self.mgr, self.room = mgr, int(room or 0)
        self.tid = transfer_id(self.room)
        self.tids = [self.tid]  # what an abort ends: the room's transfer, or its layer transfers
        self.fut: concurrent.futures.Future[TransferStatus] | None = None
        self.failed = ""
        self.started = time.monotonic()

    @property
    def kv_mgr(self) -> KVServiceManager:
        """The manager, under the name SGLang's schedulers read it (``kv_receiver.kv_mgr``)."""
        return self.mgr

    def _transfer_poll(self) -> int:
        if self.failed:
            return KVPoll.Failed
        if self.fut is None:
            return KVPoll.WaitingForInput
        if not self.fut.done():
            return KVPoll.Transferring
        exc = self.fut.exception()
        if exc is not None:
            self.failed = f"{type(exc).__name__}: {exc}"
            self.mgr.note_failure(exc)  # a lost session: the next transfer registers again
            return KVPoll.Failed
        st = self.fut.result()
        if st.state != "DONE":
            self.failed = f"{st.state} {st.error_code}: {st.error}"
            return KVPoll.Failed
        return KVPoll.Success

    def failure_exception(self) -> None:
        raise KVServiceTransferError(self.room, self.failed or "the transfer failed")

    def get_transfer_metric(self) -> KVTransferMetric:
        st = (
            self.fut.result()
            if self.fut is not None and self.fut.done() and not self.fut.exception()
            else None
        )
        return KVTransferMetric(
            transfer_latency_s=(time.monotonic() - self.started) if st is not None else None,
            transfer_total_bytes=st.bytes_sent if st is not None else None,
        )

    def abort(self) -> None:
        """Stop the transfer (each layer's, per layer) on both services; Failed from now on (the
        abort settles off-thread)."""
        self.failed = self.failed or "aborted"
        for tid in list(self.tids):
            self.mgr.bg.submit(abort_quietly(self.mgr, tid))


async def put_quietly(url: str, body: dict[str, Any]) -> int:
    """PUT ``body`` to ``url``; the status code (0 when the server could not be reached)."""
    try:
        code, _ = await asyncio.to_thread(http_json, "PUT", url, body)
    except OSError as exc:
        log.info("kvservice: PUT %s failed: %s", url, exc)
        return 0
    return code


async def abort_quietly(mgr: KVServiceManager, tid: str) -> None:
    try:
        await mgr.bg.kv.abort(tid, "aborted by SGLang")
    except Exception as exc:  # NotFound: never started or already ended
        log.debug("abort of %s: %s", tid, exc)
