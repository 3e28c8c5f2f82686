"""The prefill side of a room: SGLang's ``BaseKVSender`` on kvservice::

    poll: Bootstrapping until the decode posted the room (its kvservice, its prefix), then
          WaitingForInput
    pop_decode_prefix_len ─▶ init(num_pages, aux_index) ─▶ send(pages) per chunk
          └─ SendDelta(chunk_offset = prefix pages + pages sent so far; the last chunk carries
             the aux row and the state slots)

Only the delta moves: SGLang's prefill sends from the decode's prefix on (the room's
``decode_prefix_len``), and positions are absolute, so the receiver may be any engine.

A room whose decode stages posted their layers (either instance runs PP) goes one transfer per
layer of this stage instead (``layer_room.LayerSend``); a stage of a PP prefill waits until the
decode stages holding its layers have all posted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import Any

import numpy as np
from kvservice_client import TransferStatus
from sglang.srt.disaggregation.base.conn import BaseKVSender, KVPoll

from .bootstrap import HOLD_MS, held, http_json
from .layer_room import LayerSend
from .manager import KVServiceManager
from .room import KVServiceTransferError, RoomTransfer, put_quietly

__all__ = ["KVServiceSender"]

log = logging.getLogger(__name__)

_LOOKUP_EVERY_S = 0.01


class KVServiceSender(RoomTransfer, BaseKVSender):
    def __init__(
        self,
        mgr: KVServiceManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ) -> None:
        RoomTransfer.__init__(self, mgr, bootstrap_room)
        self.url = f"http://{bootstrap_addr}/room/{self.room}"
        self.target: concurrent.futures.Future[dict[str, Any]] = mgr.bg.submit(self._lookup())
        self.num_pages: int | None = None
        self.aux_index: int | None = None
        self.state: dict[str, list[int]] = {}  # state rows, sent with the last chunk
        self.sent = 0
        self._chain: concurrent.futures.Future[Any] | None = None
        self._layers: LayerSend | None = None  # a per-layer room: this stage's layer transfers

    async def _lookup(self) -> dict[str, Any]:
        """Wait for the decode instance to post this room (its peer and prefix; per layer: until
        the decode stages that posted hold every layer of this stage)."""
        end = time.monotonic() + self.mgr.bootstrap_timeout_s
        url = held(self.mgr.reader_url(self.url, layers=True))  # answered once the decode posts
        while not self.failed:
            asked = time.monotonic()
            try:
                code, body = await asyncio.to_thread(http_json, "GET", url)
            except OSError as exc:  # a timeout or a refused connection: the bootstrap server is busy
                log.debug("kvservice: GET %s: %s", url, exc)
                code, body = 0, {}
            if code == 200:
                return body
            if time.monotonic() > end:
                wait = self.mgr.bootstrap_timeout_s
                raise TimeoutError(f"no decode instance claimed bootstrap_room {self.room} within {wait}s")
            if time.monotonic() - asked < HOLD_MS / 2000:  # a server that does not hold GETs: poll
                await asyncio.sleep(_LOOKUP_EVERY_S)
        raise KVServiceTransferError(self.room, self.failed)

    def poll(self) -> int:
        if self.failed:
            return KVPoll.Failed
        if not self.target.done():
            return KVPoll.Bootstrapping
        if self.target.exception() is not None:
            self.failed = str(self.target.exception())
            return KVPoll.Failed
        return self._transfer_poll()

    def pop_decode_prefix_len(self) -> int:
        return (
            int(self.target.result()["decode_prefix_len"])
            if self.target.done() and not self.target.exception()
            else 0
        )

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        self.num_pages, self.aux_index = int(num_kv_indices), aux_index
        if self.target.done() and not self.target.exception() and self.target.result().get("landing"):
            # the decode instance lands the pages before its allocation: it needs their number
            self.mgr.bg.submit(put_quietly(f"{self.url}/pages", {"pages": self.num_pages}))

    def send(
        self, kv_indices: Any, state_indices: Any = None, num_kv_tokens: int | None = None, **_: Any
    ) -> None:
        if self.num_pages is None:
            raise RuntimeError(f"bootstrap_room {self.room}: send before init")
        try:
            self.state.update(self.mgr.state_rows(state_indices))
        except ValueError as exc:
            self.failed = str(exc)
            return
        pages = np.asarray(kv_indices, dtype=np.int64)
        offset, self.sent = self.sent, self.sent + int(pages.size)
        offset += self.pop_decode_prefix_len() // self.mgr.page_size  # absolute sequence position
        last = self.sent >= self.num_pages
        entry = self.target.result()
        aux = {**self.mgr.aux_rows(self.aux_index), **self.state} if last else {}
        if "stages" in entry or self.mgr.pp_size > 1:
            return self._send_layers(entry, pages, offset, last, aux)
        peer = str(entry["peer"])
        prev, mgr, tid = self._chain, self.mgr, self.tid

        async def one(kv: Any) -> TransferStatus:
            if prev is not None:  # chunks go in sequence order
                await asyncio.wrap_future(prev)
            return await mgr.on_session(  # type: ignore[no-any-return]
                lambda bs: kv.send_delta(
                    tid,
                    bs,
                    src_page_indices=pages,
                    chunk_offset=offset,
                    last_chunk=last,
                    peer_address=peer,
                    aux=aux,
                    deadline_ms=mgr.deadline_ms,
                ),
                first=prev is None,
            )

        if last:
            self.fut = self._chain = mgr.bg.transfer(tid, one, mgr.deadline_ms)
        else:
            self._chain = mgr.bg.submit(one(mgr.bg.kv))
            self._chain.add_done_callback(self._chunk_done)

    def _send_layers(
        self, entry: dict[str, Any], pages: np.ndarray, offset: int, last: bool, aux: dict[str, list[int]]
    ) -> None:
        """The chunk as one of each of this stage's layer transfers (``layer_room``)."""
        if self._layers is None:
            why = ""
            if "stages" not in entry:
                why = (
                    f"this prefill runs {self.mgr.pp_size} pipeline stages, and the decode declared "
                    "one transfer of every layer (it did not learn the prefill's PP size from GET /service)"
                )
            elif self.state or any(self.mgr.state_names):
                why = "state buffers (a hybrid model) are not sent per layer"
            if not why:
                try:
                    self._layers = LayerSend(self.mgr, self.tid, entry)
                except ValueError as exc:
                    why = str(exc)
            if why:
                self.failed = why
                self.abort()
                return
            assert self._layers is not None
            self.tids = list(self._layers.tids.values())
            self._layers.outcome.add_done_callback(self._chunk_done)  # it ends early only on a failure
        self._layers.send(pages, offset, last, aux)
        if last:
            self.fut = self._layers.outcome

    def _chunk_done(self, fut: concurrent.futures.Future[Any]) -> None:
        """A chunk's call (or a per-layer room's outcome, ending early) failed: the room did."""
        if self.failed or fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            self.failed = f"{type(exc).__name__}: {exc}"
        elif isinstance(st := fut.result(), TransferStatus) and st.terminal and st.state != "DONE":
            self.failed = f"{st.state} {st.error_code}: {st.error}"

    def clear(self) -> None:
        return
