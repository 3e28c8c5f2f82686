"""The prefill's rendezvous (SGLang's ``--disaggregation-bootstrap-port``): a small HTTP server where
decode instances post where a room's pages go, and the prefill's senders read it::

    PUT /room/<room> {peer, decode_prefix_len[, landing][, layers]}  decode -> prefill (its kvservice, prefix)
    GET /room/<room>[?rank=r&ranks=n][&layers=a,b,..][&wait_ms=w]  each prefill rank reads it once
    PUT /room/<room>/pages {pages}                          prefill -> decode (landing option)
    GET /service                                            {peer[, pp_size]}: the decode's sender

A GET naming ``wait_ms`` is held until the entry is there (a PUT wakes it) or ``wait_ms`` passed
(then 404), so a sender learns of the decode's post at once, not at its next poll, and the server
sees one connection a request instead of one every poll.

An entry is read by every rank (attention TP x PP) of the other instance (each runs a sender or a
receiver of the room) and goes once all ``n`` read it, or at its TTL. ``GET /service`` names the
prefill's kvservice (``SGLANG_KVSERVICE_PEER_ADDRESS``, else what its kvservice tells its sessions)
and its pipeline stages; nobody can set them over HTTP.

Rooms of instances split into pipeline stages go one transfer per layer (``layers``): each decode
stage posts the model's layers it declared, and the entry keeps one part per stage::

    PUT {peer: D0, decode_prefix_len: 8, layers: [0, 1]}     stage 0 of a decode at PP 2
    PUT {peer: D1, decode_prefix_len: 8, layers: [2, 3]}     stage 1
    GET ?layers=2,3  -> {peer: D0, decode_prefix_len: 8, stages: [
                            {peer: D0, layers: [0, 1], decode_prefix_len: 8},
                            {peer: D1, layers: [2, 3], decode_prefix_len: 8}]}

A GET naming ``layers`` finds the entry only once its stages hold them all (an entry without
stages, one transfer of every layer, holds any); until then it is 404 and the rank has not read it.
"""

from __future__ import annotations

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

from kvservice_client import KVClientError, ask_service_peer_address
from sglang.srt.disaggregation.base.conn import BaseKVBootstrapServer

from .settings import service_address as local_service

__all__ = ["HOLD_MS", "KVServiceBootstrapServer", "held", "http_json"]

log = logging.getLogger(__name__)
_ROOM_TTL_S = 600.0
_PUT_USAGE = "PUT /room/<int> {peer, decode_prefix_len[, landing][, layers]} or /room/<int>/pages {pages}"
_SERVICE_LOOKUP_TIMEOUT_S = 3.0  # the bootstrap server asking its kvservice (within a GET's 5 s)
_MAX_WAIT_MS = 2000  # the longest a GET is held (within http_json's 5 s timeout)
HOLD_MS = 1000  # how long a reader asks the server to hold its GET (``held``)


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
        pp_size: int | None = None,
        **_: Any,
    ) -> None:
        if peer_address is None:
            peer_address = os.environ.get("SGLANG_KVSERVICE_PEER_ADDRESS") or None
        prefill = _PrefillService(peer_address, service_address or local_service())
        stages = _pp_size() if pp_size is None else int(pp_size)
        rooms: dict[int, tuple[float, dict[str, Any]]] = {}
        sizes: dict[int, tuple[float, dict[str, Any]]] = {}  # landing rooms: the prefill's page count
        # an entry is read by every attention TP rank of the other instance (each runs a sender or
        # a receiver of the room): the ranks that read it so far, per (book, room)
        readers: dict[tuple[int, int], set[int]] = {}
        posted = threading.Condition()  # the books' lock; a PUT wakes the GETs held for an entry

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
                with posted:
                    for d in (rooms, sizes):
                        for r in [r for r, (t, _) in d.items() if now - t > _ROOM_TTL_S]:
                            del d[r]
                            readers.pop((id(d), r), None)
                    old = book.get(room)
                    book[room] = (now, _merge(old[1] if old and book is rooms else None, entry))
                    posted.notify_all()
                self._reply(200, {})

            def do_GET(self) -> None:  # noqa: N802
                if self.path.strip("/") == "service":  # the prefill's kvservice: the decode's sender
                    service = prefill.get()
                    body = {"peer": service, **({"pp_size": stages} if stages > 1 else {})}  # absent: 1
                    return self._reply(200, body) if service else self._reply(404, {})
                room, book = self._target()
                rank, ranks = _reader(self.path)
                wanted = _layers(self.path)
                end = time.monotonic() + _wait_ms(self.path) / 1000
                with posted:
                    while True:
                        found = book.get(room) if room is not None else None
                        if found is not None and wanted and not _holds(found[1], wanted):
                            found = None  # not every stage holding this rank's layers posted yet
                        left = end - time.monotonic()
                        if found is not None or left <= 0:
                            break
                        posted.wait(left)
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


def _wait_ms(path: str) -> int:
    """A GET's ``?wait_ms=<w>``: how long to hold it for its entry (0: answer at once; at most 2 s)."""
    raw = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query).get("wait_ms", ["0"])[0]
    try:
        return min(max(0, int(raw)), _MAX_WAIT_MS)
    except ValueError:
        return 0


def _reader(path: str) -> tuple[int, int]:
    """A GET's ``?rank=<r>&ranks=<n>``: which of the reading instance's ``n`` attention TP ranks
    reads (each reads the entry once; none given: the only one)."""
    q = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query)
    try:
        ranks = max(1, int(q.get("ranks", ["1"])[0]))
        return min(max(0, int(q.get("rank", ["0"])[0])), ranks - 1), ranks
    except ValueError:
        return 0, 1


def _pp_size() -> int:
    """The prefill's pipeline stages, as SGLang's published server args say (1 where they are not
    published in this process)."""
    try:
        from sglang.srt.runtime_context import get_server_args

        return max(1, int(getattr(get_server_args(), "pp_size", 1) or 1))
    except (ImportError, AttributeError, AssertionError, RuntimeError, ValueError, TypeError):
        return 1


def _layers(path: str) -> list[int]:
    """A GET's ``?layers=a,b,...``: the model's layers the reading rank sends (none: any entry)."""
    raw = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query).get("layers", [""])[0]
    try:
        return [int(x) for x in raw.split(",") if x]
    except ValueError:
        return []


def _holds(entry: dict[str, Any], layers: list[int]) -> bool:
    """Whether the decode stages that posted ``entry`` hold all of ``layers`` (an entry without
    stages is one transfer of every layer)."""
    if "stages" not in entry:
        return True
    held = {i for s in entry["stages"] for i in s["layers"]}
    return held.issuperset(layers)


def _merge(old: dict[str, Any] | None, entry: dict[str, Any]) -> dict[str, Any]:
    """A decode stage's post (``layers``) joins the stages posted before it (replacing one with the
    same layers: its other TP ranks post it too); any other post replaces the entry. The merged
    prefix is the smallest (the prefill sends from there; each layer transfer skips its own)."""
    layers = entry.pop("layers", None)
    if layers is None:
        return entry
    stage = {"peer": entry["peer"], "layers": layers, "decode_prefix_len": entry["decode_prefix_len"]}
    parts = [s for s in (old or {}).get("stages", []) if s["layers"] != layers] + [stage]
    return {
        "peer": parts[0]["peer"],
        "decode_prefix_len": min(s["decode_prefix_len"] for s in parts),
        "stages": parts,
    }


def _room_entry(body: dict[str, Any]) -> dict[str, Any] | None:
    """A decode instance's post for a room (its service, prefix, whether it lands the pages, and
    the model's layers of its stage when the room goes per layer)."""
    if not isinstance(body.get("peer"), str) or not body["peer"]:
        return None
    entry: dict[str, Any] = {"peer": body["peer"], "decode_prefix_len": int(body.get("decode_prefix_len", 0))}
    if body.get("landing"):
        entry["landing"] = True
    if "layers" in body:
        layers = body["layers"]
        if (
            not isinstance(layers, list)
            or not layers
            or not all(isinstance(i, int) and i >= 0 for i in layers)
        ):
            return None
        entry["layers"] = sorted(set(layers))
    return entry


def held(url: str, wait_ms: int = HOLD_MS) -> str:
    """``url`` (a GET of a room entry) asking the server to hold it up to ``wait_ms`` for the entry."""
    return f"{url}{'&' if '?' in url else '?'}wait_ms={wait_ms}"


def http_json(method: str, url: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, {}
