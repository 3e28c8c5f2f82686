"""The decode side of a room: SGLang's ``BaseKVReceiver`` on kvservice::

    init ─▶ send_metadata(kv_indices, aux_index, state_indices, decode_prefix_len)
              ├─ ExpectDelta(dst = kv_indices: the pages past decode_prefix_len, aux row,
              │              sender_address = the prefill's kvservice, GET /service)
              └─ PUT /room/<room> {peer: its kvservice, decode_prefix_len}: the prefill may send
                 (beside the ExpectDelta: the prefill computes while the decode declares)

Landing option (``SGLANG_KVSERVICE_LANDING_TTL_MS`` > 0), so the prefill need not wait for the
decode's allocation (seed 002's pre-allocation queue)::

    init ─▶ PUT /room/<room> {peer, decode_prefix_len 0, landing}: the prefill starts
            GET /room/<room>/pages ─▶ ExpectDelta(landing: pages, one aux row per aux buffer),
              unless send_metadata came first; the prefill's pages are free at LANDED
    send_metadata(kv_indices, aux_index) ─▶ Claim(kv_indices, aux row) ─▶ Success
      (no landing, or refused because the pool is full: ExpectDelta, as without the option)

When either instance runs pipeline parallelism (this decode's PP size, the prefill's from ``GET
/service``), the room is one transfer per layer this stage holds (``layer_room.declare_layers``),
posted with its layers; the landing option is not used for it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import Any

import numpy as np
from kvservice_client import KVClientError, TransferStatus
from sglang.srt.disaggregation.base.conn import BaseKVReceiver, KVPoll

from .bootstrap import HOLD_MS, held, http_json
from .layer_room import declare_layers
from .layers import abort_all, layer_tid
from .manager import KVServiceManager, PrefillService
from .room import KVServiceTransferError, RoomTransfer, abort_quietly, put_quietly

__all__ = ["KVServiceReceiver"]

log = logging.getLogger(__name__)
_LOOKUP_EVERY_S = 0.01


class KVServiceReceiver(RoomTransfer, BaseKVReceiver):
    def __init__(
        self, mgr: KVServiceManager, bootstrap_addr: str, bootstrap_room: int | None = None, **_: Any
    ) -> None:
        RoomTransfer.__init__(self, mgr, bootstrap_room)
        self.url = f"http://{bootstrap_addr}/room/{self.room}"
        # the prefill's kvservice (ExpectDelta.sender_address), asked now: ready by the declaration
        self._sender = mgr.bg.submit(mgr.prefill_service(bootstrap_addr))
        self.inited = False
        # landing option: the landing declaration (its status, or None: no landing, the default path)
        self._landing: concurrent.futures.Future[TransferStatus | None] | None = None
        self._allocated = False  # send_metadata came: no landing is declared from now on
        self._posted = False  # the room is at the prefill's bootstrap server already

    def init(self, prefill_dp_rank: int = 0) -> None:
        self.inited = True
        if self.mgr.landing_ttl_ms and self._landing is None and not self.failed:
            self._landing = self.mgr.bg.submit(self._land())

    async def _land(self) -> TransferStatus | None:
        """Post the room now (the prefill starts, sending from page 0), learn its page count, and
        declare a landing of them with one row per aux buffer, unless the allocation came first."""
        mgr = self.mgr
        if mgr.layerwise(await asyncio.wrap_future(self._sender)):
            return None  # a per-layer room: declared at the allocation
        body = {"peer": mgr.peer_address, "decode_prefix_len": 0, "landing": True}
        if await put_quietly(self.url, body) != 200:
            return None  # send_metadata posts the room, as without the option
        self._posted = True
        pages = await self._prefill_pages()
        if pages is None:
            return None
        try:
            st: TransferStatus = await mgr.bg.kv.expect_landing(
                self.tid,
                mgr.buffer_set_id,
                pages=pages,
                aux={name: 1 for name in mgr.aux_names},
                ttl_ms=mgr.landing_ttl_ms,
                deadline_ms=mgr.deadline_ms,
                sender_address=(await asyncio.wrap_future(self._sender)).peer,
            )
        except KVClientError as exc:  # the pool is full, for instance: receive directly later
            log.info("kvservice: landing of %s not declared (%s); it waits for the allocation", self.tid, exc)
            return None
        if self.failed:  # aborted while it was being declared: free it now, not at its TTL
            await abort_quietly(mgr, self.tid)
        return st

    async def _prefill_pages(self) -> int | None:
        """The prefill's page count once it posted it; None if the allocation or a failure came first."""
        end = time.monotonic() + self.mgr.bootstrap_timeout_s
        url = held(self.mgr.reader_url(f"{self.url}/pages"))  # answered once the prefill posts
        while not (self._allocated or self.failed) and time.monotonic() < end:
            asked = time.monotonic()
            try:
                code, body = await asyncio.to_thread(http_json, "GET", url)
            except OSError:
                code, body = 0, {}
            if code == 200:
                return int(body["pages"])
            if time.monotonic() - asked < HOLD_MS / 2000:  # a server that does not hold GETs: poll
                await asyncio.sleep(_LOOKUP_EVERY_S)
        return None

    def poll(self) -> int:
        if not self.inited and not self.failed:
            return KVPoll.Bootstrapping
        return self._transfer_poll()

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: int | None = None,
        state_indices: Any = None,
        decode_prefix_len: int | None = None,
        destination: Any = None,
    ) -> None:
        mgr, tid, landing = self.mgr, self.tid, self._landing
        self._allocated = True
        prefix_len = int(decode_prefix_len or 0)
        if prefix_len % mgr.page_size:
            self.failed = f"decode_prefix_len {prefix_len} is not a multiple of page_size {mgr.page_size}"
            return
        if str(getattr(destination, "value", destination or "device")) != "device":
            self.failed = "host destinations are not supported by kvservice_sglang"
            return
        try:
            aux = {**mgr.aux_rows(aux_index), **mgr.state_rows(state_indices)}
        except ValueError as exc:
            self.failed = str(exc)
            return
        pages = np.asarray(kv_indices, dtype=np.int64)
        sender = self._sender

        async def declare(kv: Any) -> TransferStatus:
            if landing is not None and await _landed(landing):  # its pages land in the service's pool
                claimed = await kv.claim(
                    tid, mgr.buffer_set_id, dst_page_indices=pages, aux=aux, wait_ms=mgr.deadline_ms
                )
                return claimed.status  # type: ignore[no-any-return]
            prefill: PrefillService = await asyncio.wrap_future(sender)  # only it may fetch the plan
            if mgr.layerwise(prefill):
                return await self._declare_layers(pages, prefix_len, aux, prefill.peer)
            # NOTE: the room is posted beside the declaration, not after it: the prefill computes
            # while this service declares (and offers the plan). Its SendDelta waits for the plan;
            # a refused declaration fails it at once with the reason (the service answers its
            # plan request), a post the prefill refused aborts the declaration below.
            posting = None  # landing option: the room is posted already (the prefill sends from 0)
            if not self._posted:
                body = {"peer": mgr.peer_address, "decode_prefix_len": prefix_len}
                posting = asyncio.ensure_future(self._put_room(body))
            try:
                st = await mgr.on_session(
                    lambda bs: kv.expect_delta(
                        tid,
                        bs,
                        prefix_pages=prefix_len // mgr.page_size,  # the prefill sends from there on
                        dst_page_indices=pages,
                        aux=aux,
                        deadline_ms=mgr.deadline_ms,
                        sender_address=prefill.peer,
                    )
                )
            except BaseException:
                if posting is not None:
                    await asyncio.wait([posting])
                raise
            refused = await posting if posting is not None else ""
            if refused:
                await abort_all(self.mgr.bg, [tid], refused)
            return st  # type: ignore[no-any-return]

        self.fut = mgr.bg.transfer(tid, declare, mgr.deadline_ms)

    async def _declare_layers(
        self, pages: np.ndarray, prefix_len: int, aux: dict[str, list[int]], sender: str
    ) -> TransferStatus:
        """The room per layer: each of this stage's layers declared, then posted with its layers."""
        mgr = self.mgr
        if self.failed:  # aborted before the declaration: declare nothing
            raise KVServiceTransferError(self.room, self.failed)
        if any(mgr.state_names):
            raise KVServiceTransferError(self.room, "state buffers (a hybrid model) are not sent per layer")
        self.tids = [layer_tid(self.tid, i) for i in mgr.layer_ids]
        outcome = declare_layers(mgr, self.tid, pages, prefix_len // mgr.page_size, aux, sender)
        body = {"peer": mgr.peer_address, "decode_prefix_len": prefix_len, "layers": list(mgr.layer_ids)}
        await self._post(body, self.tids)
        return await asyncio.wrap_future(outcome)

    async def _post(self, body: dict[str, Any], tids: list[str]) -> None:
        """PUT the room at the prefill's bootstrap server (now the prefill may send); refused or
        unreachable: the declared transfers are aborted with the reason."""
        refused = await self._put_room(body)
        if refused:
            await abort_all(self.mgr.bg, tids, refused)

    async def _put_room(self, body: dict[str, Any]) -> str:
        """PUT the room at the prefill's bootstrap server: "" once it took it, else why not."""
        try:
            code, _ = await asyncio.to_thread(http_json, "PUT", self.url, body)
            why = f"it answered {code}"
        except OSError as exc:
            code, why = 0, str(exc)
        if code == 200:
            return ""
        return f"the prefill's bootstrap server {self.url} did not take room {self.room}: {why}"

    def clear(self) -> None:
        if self._landing is not None and not self._allocated and not self.failed:
            self.abort()  # dropped before its allocation: free its landing now, not at its TTL


async def _landed(landing: concurrent.futures.Future[TransferStatus | None]) -> bool:
    """Whether the landing option declared a landing (False: none, or refused)."""
    try:
        return await asyncio.wrap_future(landing) is not None
    except Exception as exc:  # the declaration's own errors are logged in _land
        log.debug("kvservice: landing declaration failed: %s", exc)
        return False
