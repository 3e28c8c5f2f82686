"""SGLang's BaseKVManager / BaseKVSender / BaseKVReceiver / BaseKVBootstrapServer on kvservice.

One request (``bootstrap_room``) is one kvservice transfer, ``sgl-<room>``::

    decode  Receiver.init ─▶ send_metadata(kv_indices, aux_index, decode_prefix_len)
              ├─ ExpectDelta(dst = kv_indices: the pages past decode_prefix_len, aux row)
              └─ PUT /room/<room> {peer: its kvservice, decode_prefix_len} ─▶ prefill's bootstrap server
    prefill Sender.poll: Bootstrapping until the room is there, then WaitingForInput
              pop_decode_prefix_len ─▶ init(num_pages, aux_index) ─▶ send(pages) per chunk
              └─ SendDelta(chunk_offset = prefix pages + pages sent so far, the last chunk
                 carries the aux row)
    both    poll: Transferring ─▶ Success (DONE) or Failed (FAILED / ABORTED, with the reason)

Landing option (decode, ``SGLANG_KVSERVICE_LANDING_TTL_MS`` > 0), so the prefill need not wait for
the decode's allocation (seed 002's pre-allocation queue)::

    decode  Receiver.init ─▶ PUT /room/<room> {peer, decode_prefix_len 0, landing}: the prefill starts
    prefill init(num_pages) ─▶ PUT /room/<room>/pages {pages}; send(pages): SendDelta as usual
    decode  GET /room/<room>/pages ─▶ ExpectDelta(landing: pages, one aux row per aux buffer),
              unless send_metadata came first; the prefill's pages are free at LANDED
            send_metadata(kv_indices, aux_index) ─▶ Claim(kv_indices, aux row) ─▶ Success
              (no landing, or refused because the pool is full: ExpectDelta, as without the option)

The decode names the prefill's kvservice as the sender (ExpectDelta's ``sender_address``, issue 33)
so no other peer can fetch the plan first: the prefill's bootstrap server answers ``GET /service``
with its ``SGLANG_KVSERVICE_PEER_ADDRESS``, else with what its kvservice tells its sessions
(``Client.service_peer_address``, asked once; 404 while the service cannot be reached: then no
sender is named, as before), which the decode reads once a minute per bootstrap server, when a
receiver is made.

Every attention TP rank of the prefill runs a sender of the room and reads the decode's post
(``GET /room/<room>?rank=<r>&ranks=<n>``: the entry goes once all ``n`` read it, or at its TTL);
each registered as its attention TP rank, so the service splits heads between ranks, or (MLA, a
replica on every rank) serves each decode rank from one prefill rank and ends the others with
nothing moved.

Only the delta moves: SGLang's prefill sends from the decode's prefix on (seed 000's
``decode_prefix_len``, which the prefill learns from the room), so the transfer is exactly the
pages past it. Positions are absolute (the receiver declares ``decode_prefix_len`` as its prefix,
the sender counts from there), so the other side may be any engine: a vLLM receiver whose room
was posted with ``decode_prefix_len`` 0 gets every page past its own prefix-cache hit (the service
skips the rest), in its own block size and page layout. Every RPC runs on the manager's
:class:`BackgroundClient` thread; the scheduler's calls only look at futures.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import json
import logging
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
from kvservice_client import BackgroundClient, KVClientError, TransferStatus, ask_service_peer_address
from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
    KVPoll,
    KVTransferMetric,
)

from .regions import register_kv_args

__all__ = [
    "KVServiceBootstrapServer",
    "KVServiceManager",
    "KVServiceReceiver",
    "KVServiceSender",
    "KVServiceTransferError",
]

log = logging.getLogger(__name__)
_ROOM_TTL_S = 600.0
_PUT_USAGE = "PUT /room/<int> {peer, decode_prefix_len[, landing]} or /room/<int>/pages {pages}"
_LOOKUP_EVERY_S = 0.01
_SENDER_TTL_S = 60.0  # how long a decode trusts a bootstrap server's answer to GET /service
_SERVICE_LOOKUP_TIMEOUT_S = 3.0  # the bootstrap server asking its kvservice (within a GET's 5 s)


class KVServiceTransferError(RuntimeError):
    def __init__(self, room: int, reason: str) -> None:
        super().__init__(f"kvservice transfer of bootstrap_room {room} failed: {reason}")
        self.room, self.reason = room, reason


def transfer_id(room: int) -> str:
    return f"sgl-{int(room)}"


def _attention_tp(args: KVArgs, server_args: Any) -> tuple[int, int]:
    """(attention TP size, this rank's attention TP rank). SGLang's own figure where its parallel
    state is published (the scheduler process: ``get_parallel().attn_tp_size`` in 0.5.x,
    ``get_attention_tp_size()`` before); else the server args' (``tp_size`` over ``dp_size`` under
    DP attention, over ``attn_cp_size``). The prefill's ``engine_rank`` is its TP rank, the
    decode's already its attention TP rank: modulo the size, both are the attention TP rank."""
    size = 0
    for module, read in (
        ("sglang.srt.runtime_context", lambda m: m.get_parallel().attn_tp_size),
        ("sglang.srt.layers.dp_attention", lambda m: m.get_attention_tp_size()),
    ):
        try:
            size = int(read(importlib.import_module(module)))
            break
        except (ImportError, AttributeError, AssertionError, RuntimeError, ValueError, TypeError):
            continue  # not this SGLang, or not published in this process
    if size <= 0:
        size = int(getattr(server_args, "tp_size", 1) or 1)
        if getattr(server_args, "enable_dp_attention", False):
            size //= int(getattr(server_args, "dp_size", 1) or 1)
        size //= int(getattr(server_args, "attn_cp_size", 1) or 1)
    size = max(1, size)
    return size, int(args.engine_rank) % size


def _service_address() -> str:
    """The local kvservice (``SGLANG_KVSERVICE_ADDRESS``)."""
    return os.environ.get("SGLANG_KVSERVICE_ADDRESS", f"unix:/tmp/kvservice-{os.getuid()}.sock")


class _PrefillService:
    """The prefill's kvservice as other services reach it: ``configured`` (None: not configured),
    else what the local service tells its sessions (asked on first use, kept once it answers)."""

    def __init__(self, configured: str | None, local: str) -> None:
        self._value = configured  # None: not known yet
        self._local = local
        self._lock = threading.Lock()

    def get(self) -> str:
        """The address ("" while the local service cannot be reached, or is too old to say)."""
        with self._lock:
            if self._value is None:
                path = self._local[len("unix:") :] if self._local.startswith("unix:") else ""
                if path and not os.path.exists(path):  # no service there (yet): do not wait for it
                    log.info("kvservice: no peer address yet, %s does not exist", path)
                    return ""
                try:
                    self._value = ask_service_peer_address(
                        self._local, "sglang-bootstrap", _SERVICE_LOOKUP_TIMEOUT_S
                    )
                except (KVClientError, OSError, ValueError) as exc:
                    log.info("kvservice: no peer address from %s yet (%s)", self._local, exc)
                    return ""
                log.info("kvservice: this prefill names its kvservice as %r", self._value)
            return self._value


# -- rendezvous -----------------------------------------------------------------------------------
class KVServiceBootstrapServer(BaseKVBootstrapServer):
    """On the prefill node: decode instances post where a room's pages go; its senders read it.
    ``GET /service`` names the prefill's kvservice: ``peer_address`` ("": none), default the
    ``SGLANG_KVSERVICE_PEER_ADDRESS`` of this process when set (the prefill's schedulers inherit
    it), else what the local kvservice (``service_address``, default ``SGLANG_KVSERVICE_ADDRESS``)
    tells its sessions; 404 while none is known. Nobody can set it over HTTP."""

    def __init__(
        self,
        host: str,
        port: int,
        peer_address: str | None = None,
        service_address: str | None = None,
        **_: Any,
    ) -> None:
        if peer_address is None:
            peer_address = os.environ.get("SGLANG_KVSERVICE_PEER_ADDRESS") or None
        prefill = _PrefillService(peer_address, service_address or _service_address())
        rooms: dict[int, tuple[float, dict[str, Any]]] = {}
        sizes: dict[int, tuple[float, dict[str, Any]]] = {}  # landing rooms: the prefill's page count
        # an entry is read by every attention TP rank of the other instance (each runs a sender or
        # a receiver of the room): the ranks that read it so far, per (book, room)
        readers: dict[tuple[int, int], set[int]] = {}
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def _target(self) -> tuple[int | None, dict[int, tuple[float, dict[str, Any]]]]:
                """``/room/<room>`` (the decode's post) or ``/room/<room>/pages`` (the prefill's)."""
                parts = urllib.parse.urlsplit(self.path).path.strip("/").split("/")
                if len(parts) in (2, 3) and parts[0] == "room" and parts[1].isdigit():
                    if len(parts) == 2:
                        return int(parts[1]), rooms
                    if parts[2] == "pages":
                        return int(parts[1]), sizes
                return None, rooms

            def _reply(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self) -> None:  # noqa: N802 (http.server's naming)
                room, book = self._target()
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                    entry = _room_entry(body) if book is rooms else {"pages": int(body["pages"])}
                except (ValueError, TypeError, KeyError, AttributeError):
                    entry = None
                if room is None or entry is None:
                    return self._reply(400, {"error": _PUT_USAGE})
                now = time.monotonic()
                with lock:
                    for d in (rooms, sizes):
                        for r in [r for r, (t, _) in d.items() if now - t > _ROOM_TTL_S]:
                            del d[r]
                            readers.pop((id(d), r), None)
                    book[room] = (now, entry)
                self._reply(200, {})

            def do_GET(self) -> None:  # noqa: N802
                if self.path.strip("/") == "service":  # the prefill's kvservice: the decode's sender
                    service = prefill.get()
                    return self._reply(200, {"peer": service}) if service else self._reply(404, {})
                room, book = self._target()
                rank, ranks = _reader(self.path)
                with lock:
                    found = book.get(room) if room is not None else None
                    if found is not None and room is not None:  # gone once every rank read it
                        seen = readers.setdefault((id(book), room), set())
                        seen.add(rank)
                        if len(seen) >= ranks:
                            del book[room]
                            readers.pop((id(book), room), None)
                self._reply(200, found[1]) if found else self._reply(404, {})

            def log_message(self, *a: Any) -> None:
                return

        self.server = ThreadingHTTPServer((host, int(port)), Handler)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(
            target=self.server.serve_forever, name="kvservice-bootstrap", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _reader(path: str) -> tuple[int, int]:
    """A GET's ``?rank=<r>&ranks=<n>``: which of the reading instance's ``n`` attention TP ranks
    reads (each reads the entry once; none given: the only one)."""
    q = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query)
    try:
        ranks = max(1, int(q.get("ranks", ["1"])[0]))
        return min(max(0, int(q.get("rank", ["0"])[0])), ranks - 1), ranks
    except ValueError:
        return 0, 1


def _room_entry(body: dict[str, Any]) -> dict[str, Any] | None:
    """A decode instance's post for a room (its service, prefix, and whether it lands the pages)."""
    if not isinstance(body.get("peer"), str) or not body["peer"]:
        return None
    entry = {"peer": body["peer"], "decode_prefix_len": int(body.get("decode_prefix_len", 0))}
    if body.get("landing"):
        entry["landing"] = True
    return entry


def _http(method: str, url: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, {}


# -- manager --------------------------------------------------------------------------------------
class KVServiceManager(BaseKVManager):
    def __init__(
        self, args: KVArgs, disaggregation_mode: Any, server_args: Any, is_mla_backend: bool | None = False
    ) -> None:
        pp = int(getattr(server_args, "pp_size", 1) or 1)
        if pp > 1:  # a stage holds a subset of the layers; the service pairs whole layouts
            raise NotImplementedError(
                f"kvservice_sglang: pipeline parallel size > 1 is not supported (pp_size={pp}): "
                "a stage holds a subset of the layers"
            )
        attn_tp = _attention_tp(args, server_args)
        self.kv_args, self.mode = args, str(getattr(disaggregation_mode, "value", disaggregation_mode))
        self.address = _service_address()
        self.peer_address = os.environ.get("SGLANG_KVSERVICE_PEER_ADDRESS", self.address)
        self.deadline_ms = int(os.environ.get("SGLANG_KVSERVICE_DEADLINE_MS", "30000"))
        self.bootstrap_timeout_s = float(os.environ.get("SGLANG_KVSERVICE_BOOTSTRAP_TIMEOUT_S", "300"))
        self.bg = BackgroundClient(self.address, client_name=f"sglang-{self.mode}-{args.engine_rank}")
        self._senders: dict[str, tuple[float, str]] = {}  # decode: bootstrap addr -> (until, its service)
        reg, self.buffer_set_id = register_kv_args(self.bg, args, bool(is_mla_backend), attn_tp)
        self.attn_tp = attn_tp
        self.page_size, self.aux_names, self.state_names = int(args.page_size), reg.aux_names, reg.state_names
        self.landing_ttl_ms = self._landing_ttl_ms(server_args)  # 0: no landing (the default path only)
        log.info("kvservice: %s rank %s registered %s", self.mode, args.engine_rank, self.buffer_set_id)

    def reader_url(self, url: str) -> str:
        """``url`` (a room entry at the other instance's bootstrap server) as this rank reads it:
        the entry stays until each of this instance's attention TP ranks has read it."""
        size, rank = self.attn_tp
        return f"{url}?rank={rank}&ranks={size}" if size > 1 else url

    def _landing_ttl_ms(self, server_args: Any) -> int:
        """The landing option (decode only): how long landed pages wait for the allocation."""
        ttl = int(os.environ.get("SGLANG_KVSERVICE_LANDING_TTL_MS", "0"))
        if not ttl or self.mode != "decode":
            return 0
        why = ""
        if any(self.state_names):  # NOTE: a landing counts its aux rows before any allocation
            why = "state buffers are registered (a hybrid model): their slots are known only at allocation"
        elif getattr(server_args, "disaggregation_decode_enable_radix_cache", False):
            why = "the decode radix cache is on: a landing holds every page, an allocation only its delta"
        if why:
            log.warning("kvservice: SGLANG_KVSERVICE_LANDING_TTL_MS ignored, %s", why)
            return 0
        return ttl

    async def prefill_service(self, bootstrap_addr: str) -> str:
        """The kvservice of the prefill behind ``bootstrap_addr``, as its bootstrap server names it
        (``GET /service``, kept a minute): ExpectDelta's ``sender_address``. "" when it names none
        (the transfer then names no sender) or cannot be reached (not kept)."""
        now = time.monotonic()
        hit = self._senders.get(bootstrap_addr)
        if hit is not None and hit[0] > now:
            return hit[1]
        try:
            code, body = await asyncio.to_thread(_http, "GET", f"http://{bootstrap_addr}/service")
        except (OSError, ValueError) as exc:
            log.info("kvservice: no prefill service from %s (%s); no sender named", bootstrap_addr, exc)
            return ""
        peer = body.get("peer") if code == 200 and isinstance(body, dict) else ""
        peer = peer if isinstance(peer, str) else ""
        self._senders[bootstrap_addr] = (now + _SENDER_TTL_S, peer)
        return peer

    def register_to_bootstrap(self) -> None:
        return  # nothing to announce: decode instances post each room to the prefill's server

    def aux_rows(self, aux_index: int | None) -> dict[str, list[int]]:
        return {} if aux_index is None else {n: [int(aux_index)] for n in self.aux_names}

    def state_rows(self, state_indices: Any) -> dict[str, list[int]]:
        """SGLang's per-state-type slot indices as the rows of every component of that type
        (both sides name theirs; the service copies row i to row i, checking counts and sizes)."""
        out: dict[str, list[int]] = {}
        for i, idx in enumerate(state_indices or ()):
            rows = [] if idx is None else [int(x) for x in np.asarray(idx).reshape(-1)]
            if not rows:
                continue
            if i >= len(self.state_names) or not self.state_names[i]:
                raise ValueError(f"state_indices[{i}]: this engine registered no state buffer {i}")
            out.update((name, rows) for name in self.state_names[i])
        return out

    def close(self) -> None:
        self.bg.close()


class _Side:
    """What the sender and the receiver share: the transfer future and the poll states."""

    def __init__(self, mgr: KVServiceManager, room: int | None) -> None:
        self.mgr, self.room = mgr, int(room or 0)
        self.tid = transfer_id(self.room)
        self.fut: concurrent.futures.Future[TransferStatus] | None = None
        self.failed = ""
        self.started = time.monotonic()

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
        """Stop the transfer on both services; Failed from now on (the abort settles off-thread)."""
        self.failed = self.failed or "aborted"
        self.mgr.bg.submit(_abort_quietly(self.mgr, self.tid))


async def _put_quietly(url: str, body: dict[str, Any]) -> int:
    """PUT ``body`` to ``url``; the status code (0 when the server could not be reached)."""
    try:
        code, _ = await asyncio.to_thread(_http, "PUT", url, body)
    except OSError as exc:
        log.info("kvservice: PUT %s failed: %s", url, exc)
        return 0
    return code


async def _abort_quietly(mgr: KVServiceManager, tid: str) -> None:
    try:
        await mgr.bg.kv.abort(tid, "aborted by SGLang")
    except Exception as exc:  # NotFound: never started or already ended
        log.debug("abort of %s: %s", tid, exc)


# -- prefill --------------------------------------------------------------------------------------
class KVServiceSender(_Side, BaseKVSender):
    def __init__(
        self,
        mgr: KVServiceManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ) -> None:
        _Side.__init__(self, mgr, bootstrap_room)
        self.url = f"http://{bootstrap_addr}/room/{self.room}"
        self.target: concurrent.futures.Future[dict[str, Any]] = mgr.bg.submit(self._lookup())
        self.num_pages: int | None = None
        self.aux_index: int | None = None
        self.state: dict[str, list[int]] = {}  # state rows, sent with the last chunk
        self.sent = 0
        self._chain: concurrent.futures.Future[Any] | None = None

    async def _lookup(self) -> dict[str, Any]:
        """Wait for the decode instance to post this room (its peer and prefix)."""
        end = time.monotonic() + self.mgr.bootstrap_timeout_s
        while not self.failed:
            code, body = await asyncio.to_thread(_http, "GET", self.mgr.reader_url(self.url))
            if code == 200:
                return body
            if time.monotonic() > end:
                wait = self.mgr.bootstrap_timeout_s
                raise TimeoutError(f"no decode instance claimed bootstrap_room {self.room} within {wait}s")
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
            self.mgr.bg.submit(_put_quietly(f"{self.url}/pages", {"pages": self.num_pages}))

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
        peer = str(self.target.result()["peer"])
        aux = {**self.mgr.aux_rows(self.aux_index), **self.state} if last else {}
        prev, mgr, tid = self._chain, self.mgr, self.tid

        async def one(kv: Any) -> TransferStatus:
            if prev is not None:  # chunks go in sequence order
                await asyncio.wrap_future(prev)
            return await kv.send_delta(  # type: ignore[no-any-return]
                tid,
                mgr.buffer_set_id,
                src_page_indices=pages,
                chunk_offset=offset,
                last_chunk=last,
                peer_address=peer,
                aux=aux,
                deadline_ms=mgr.deadline_ms,
            )

        if last:
            self.fut = self._chain = mgr.bg.transfer(tid, one, mgr.deadline_ms)
        else:
            self._chain = mgr.bg.submit(one(mgr.bg.kv))
            self._chain.add_done_callback(self._chunk_done)

    def _chunk_done(self, fut: concurrent.futures.Future[Any]) -> None:
        exc = fut.exception()
        if exc is not None and not self.failed:
            self.failed = f"{type(exc).__name__}: {exc}"

    def clear(self) -> None:
        return


# -- decode ---------------------------------------------------------------------------------------
class KVServiceReceiver(_Side, BaseKVReceiver):
    def __init__(
        self, mgr: KVServiceManager, bootstrap_addr: str, bootstrap_room: int | None = None, **_: Any
    ) -> None:
        _Side.__init__(self, mgr, bootstrap_room)
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
        body = {"peer": mgr.peer_address, "decode_prefix_len": 0, "landing": True}
        if await _put_quietly(self.url, body) != 200:
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
                sender_address=await asyncio.wrap_future(self._sender),
            )
        except KVClientError as exc:  # the pool is full, for instance: receive directly later
            log.info("kvservice: landing of %s not declared (%s); it waits for the allocation", self.tid, exc)
            return None
        if self.failed:  # aborted while it was being declared: free it now, not at its TTL
            await _abort_quietly(mgr, self.tid)
        return st

    async def _prefill_pages(self) -> int | None:
        """The prefill's page count once it posted it; None if the allocation or a failure came first."""
        end = time.monotonic() + self.mgr.bootstrap_timeout_s
        while not (self._allocated or self.failed) and time.monotonic() < end:
            try:
                code, body = await asyncio.to_thread(_http, "GET", self.mgr.reader_url(f"{self.url}/pages"))
            except OSError:
                code, body = 0, {}
            if code == 200:
                return int(body["pages"])
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
        body = {"peer": mgr.peer_address, "decode_prefix_len": prefix_len}
        url, sender = self.url, self._sender

        async def declare(kv: Any) -> TransferStatus:
            if landing is not None and await _landed(landing):  # its pages land in the service's pool
                claimed = await kv.claim(
                    tid, mgr.buffer_set_id, dst_page_indices=pages, aux=aux, wait_ms=mgr.deadline_ms
                )
                return claimed.status  # type: ignore[no-any-return]
            st = await kv.expect_delta(
                tid,
                mgr.buffer_set_id,
                prefix_pages=prefix_len // mgr.page_size,  # the prefill sends from there on
                dst_page_indices=pages,
                aux=aux,
                deadline_ms=mgr.deadline_ms,
                sender_address=await asyncio.wrap_future(sender),  # only it may fetch the plan
            )
            if self._posted:  # landing option: the room is posted already (the prefill sends from 0)
                return st  # type: ignore[no-any-return]
            try:
                code, _ = await asyncio.to_thread(_http, "PUT", url, body)  # now the prefill may send
                why = f"it answered {code}"
            except OSError as exc:
                code, why = 0, str(exc)
            if code != 200:
                await kv.abort(
                    tid, f"the prefill's bootstrap server {url} did not take room {self.room}: {why}"
                )
            return st  # type: ignore[no-any-return]

        self.fut = mgr.bg.transfer(tid, declare, mgr.deadline_ms)

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
