"""The lane's messages: the per-transfer path between an engine and its node's kvservice.

A lane is a ``SOCK_SEQPACKET`` Unix socket at ``<engine socket>.lane`` (same file mode). The
engine opens it after its session, says which session it is (the service checks the kernel's
``SO_PEERCRED`` against that session's identity and ``allowed_uids``), then sends SEND commands
and reads REPLY and END messages. Every message is one packet, little endian::

    SEND   u32 type=1, seq, n_src, tid_len, bs_len, flags │ tid │ buffer set id │ i32 src[n_src]
           (i64 with flag FLAG_SRC_I64, to a service whose welcome says ``src_i64``: the SDK
           sends the engine's int64 pages unchecked, the service refuses one outside i32)
           │ with flag FLAG_CHUNK (a service whose welcome says ``chunks``): u64 chunk_offset,
           u32 last_chunk, n_aux │ n_aux times: u32 name_len, n_rows │ name │ i64 rows[n_rows]
    SEND_TO u32 type=4, seq, n_src, tid_len, bs_len, flags, addr_len │ tid │ buffer set id │
           the receiving service's address │ i32 (i64) src[n_src] │ FLAG_CHUNK: as SEND
           (the cross-node lane; chunks only of a delta that fits the receiver's slot)
    CALL   u32 type=5, seq, kind (1: ExpectDelta), rid_len, body_len │ request id │ the serialized
           request (to a service whose welcome lists the call in ``calls``)
    REPLY  u32 type=2, seq │ i32 code (0 accepted, 1 fallback, 2 invalid, 3 refused, 4 error) │
           u32 msg_len │ msg (a CALL's: the serialized response when accepted; with 4 its error,
           the gRPC code name, a newline, the message)
    END    u32 type=3, role (0 receiver, 1 sender), state (0 DONE, 1 FAILED), tid_len, bs_len,
           msg_len │ u64 bytes, pages, skipped pages, copy_us │ tid │ buffer set id │ msg │
           u32 flags (END_CROSS: the cross-node lane moved it; absent from older services) │
           f64 times[5] (a same-node copy's: the SEND read, checked, its copy launched, seen done,
           the END sent, CLOCK_MONOTONIC seconds; absent otherwise: see :func:`end_times`)

A GPU copy's REPLY goes once the copy is launched (a host copy's before the copy): an END can
come before its REPLY.

A SEND is one chunk of a transfer (SendDelta's ``chunk_offset``, ``last_chunk`` and ``aux``),
or without FLAG_CHUNK the whole transfer in one chunk: the receiver's prefix and delta pages,
in order. The service accepts a transfer's first chunk only for a transfer its receiver
declared and the service armed; anything else is answered *fallback* and the engine makes the
same call over gRPC, which has the full validation and its errors. Its later chunks then go the
same way: on the lane or over gRPC. On the lane a bad later chunk is *invalid* (INVALID_ARGUMENT
naming the field; nothing changed, the transfer goes on, as over gRPC), and one of a transfer
that is over or cannot complete is *refused* (FAILED_PRECONDITION; the transfer ends FAILED).
gRPC stays the API: an END here is also reported on the engine's Transfers stream and by Poll.

A CALL is a transfer call the service's Python answers (ExpectDelta) without gRPC: the same
request and response messages, the same request id (a call whose REPLY never came is made again
over gRPC with it, and runs once). *fallback*: make it over gRPC.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np

__all__ = [
    "ACCEPTED",
    "CALL_ERROR",
    "CALL_EXPECT",
    "FALLBACK",
    "FLAG_CHUNK",
    "FLAG_NO_DUPLICATE_MARK",
    "FLAG_SRC_I64",
    "INVALID",
    "MAX_MESSAGE",
    "REFUSED",
    "End",
    "Reply",
    "decode",
    "encode_send",
    "encode_send_to",
    "encode_call",
    "end_times",
    "hello",
    "lane_path",
    "parse_hello",
    "parse_welcome",
    "welcome",
]

MSG_SEND, MSG_REPLY, MSG_END, MSG_SEND_TO, MSG_CALL = 1, 2, 3, 4, 5
END_CROSS = 1
ACCEPTED, FALLBACK, INVALID, REFUSED, CALL_ERROR = 0, 1, 2, 3, 4
CALL_EXPECT = 1  # a CALL's kind: ExpectDelta
MAX_REQUEST_ID = 64
FLAG_NO_DUPLICATE_MARK = 1
FLAG_SRC_I64 = 2
FLAG_CHUNK = 4
MAX_MESSAGE = 256 * 1024  # the service's receive buffer: a larger SEND goes over gRPC
_SEND = struct.Struct("<6I")
_SEND_TO = struct.Struct("<7I")
_CALL = struct.Struct("<5I")
_CHUNK = struct.Struct("<QII")
_AUX = struct.Struct("<II")
_REPLY = struct.Struct("<IIiI")
_END = struct.Struct("<6I4Q")
_TIMES = struct.Struct("<5d")


def lane_path(uds_path: str) -> str:
    return uds_path + ".lane"


def _pages(src: np.ndarray, flags: int) -> np.ndarray:
    return np.ascontiguousarray(src, dtype="<i8" if flags & FLAG_SRC_I64 else "<i4")


def encode_send(
    seq: int,
    transfer_id: str,
    buffer_set_id: str,
    src: np.ndarray,
    flags: int = 0,
    chunk: tuple[int, bool, dict[str, np.ndarray]] | None = None,
) -> bytes:
    """A SEND; ``chunk``: (chunk_offset, last_chunk, aux rows by name) of a chunk that is not
    the whole transfer (sets FLAG_CHUNK)."""
    t, b = transfer_id.encode(), buffer_set_id.encode()
    pages = _pages(src, flags)
    if chunk is None:
        return _SEND.pack(MSG_SEND, seq, pages.size, len(t), len(b), flags) + t + b + pages.tobytes()
    head = _SEND.pack(MSG_SEND, seq, pages.size, len(t), len(b), flags | FLAG_CHUNK)
    return head + t + b + pages.tobytes() + _trailer(chunk)


def encode_send_to(
    seq: int,
    transfer_id: str,
    buffer_set_id: str,
    src: np.ndarray,
    flags: int,
    address: str,
    chunk: tuple[int, bool, dict[str, np.ndarray]] | None = None,
) -> bytes:
    """A SEND to another service's engine (the cross-node lane): + that service's address, as
    the engine names it in SendDelta; the service accepts it only for an offer from there.
    ``chunk``: as :func:`encode_send` (the trailer follows the pages)."""
    t, b, a = transfer_id.encode(), buffer_set_id.encode(), address.encode()
    pages = _pages(src, flags)
    if chunk is not None:
        flags |= FLAG_CHUNK
    head = _SEND_TO.pack(MSG_SEND_TO, seq, pages.size, len(t), len(b), flags, len(a))
    return head + t + b + a + pages.tobytes() + (_trailer(chunk) if chunk is not None else b"")


def encode_call(seq: int, kind: int, request_id: str, body: bytes) -> bytes:
    """A CALL: ``body`` is the serialized request (ExpectDeltaRequest for CALL_EXPECT)."""
    rid = request_id.encode()
    if len(rid) > MAX_REQUEST_ID:
        raise ValueError(f"request_id: longer than {MAX_REQUEST_ID}")
    return _CALL.pack(MSG_CALL, seq, kind, len(rid), len(body)) + rid + body


def _trailer(chunk: tuple[int, bool, dict[str, np.ndarray]]) -> bytes:
    offset, last, aux = chunk
    parts = [_CHUNK.pack(offset, int(last), len(aux))]
    for name, rows in aux.items():
        n, r = name.encode(), np.ascontiguousarray(rows, dtype="<i8").reshape(-1)
        parts += [_AUX.pack(len(n), r.size), n, r.tobytes()]
    return b"".join(parts)


class Reply(tuple):  # (seq, code, message, the message's bytes)
    __slots__ = ()


class End(tuple):  # (role, ok, transfer_id, buffer_set_id, error, nbytes, pages, skipped, copy_us, flags)
    __slots__ = ()


def decode(msg: bytes) -> Reply | End:
    kind = struct.unpack_from("<I", msg)[0]
    if kind == MSG_REPLY:
        _, seq, code, n = _REPLY.unpack_from(msg)
        raw = msg[_REPLY.size : _REPLY.size + n]
        return Reply((seq, code, raw.decode(errors="replace"), raw))
    if kind == MSG_END:
        _, role, state, tl, bl, ml, nbytes, pages, skipped, us = _END.unpack_from(msg)
        o = _END.size
        tid, bs = msg[o : o + tl].decode(), msg[o + tl : o + tl + bl].decode()
        err = msg[o + tl + bl : o + tl + bl + ml].decode(errors="replace")
        tail = o + tl + bl + ml
        flags = struct.unpack_from("<I", msg, tail)[0] if len(msg) >= tail + 4 else 0
        return End((role, state == 0, tid, bs, err, nbytes, pages, skipped, us, flags))
    raise ValueError(f"lane: unknown message type {kind}")


def end_times(msg: bytes) -> tuple[float, ...] | None:
    """An END's timeline trailer (the service's clock, which is this host's ``time.perf_counter``
    on Linux: both read CLOCK_MONOTONIC), or None when it has none. For benchmarks."""
    tl, bl, ml = _END.unpack_from(msg)[3:6]
    tail = _END.size + tl + bl + ml + 4  # + the u32 flags
    if len(msg) < tail + _TIMES.size:
        return None
    return tuple(_TIMES.unpack_from(msg, tail))


# -- handshake (one JSON packet each way, then the socket carries the messages above) ----------
def hello(session_id: str) -> bytes:
    return json.dumps({"v": 1, "session_id": session_id}).encode()


MAX_HELLO = 1024  # bytes: a hello is one flat JSON object naming a session


def parse_hello(data: bytes) -> str:
    """The session a hello names; ValueError for anything else (too long, not UTF-8, not JSON,
    nested past the parser's depth, not a v1 hello): another process wrote it."""
    if len(data) > MAX_HELLO:
        raise ValueError(f"not a lane hello: {len(data)} bytes (at most {MAX_HELLO})")
    try:
        msg = json.loads(data.decode())
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ValueError("not a lane hello: not a JSON object") from None
    if not isinstance(msg, dict) or msg.get("v") != 1 or not isinstance(msg.get("session_id"), str):
        raise ValueError("not a lane hello")
    return str(msg["session_id"])


def welcome(
    ok: bool,
    error: str = "",
    self_addresses: list[str] | None = None,
    cross: bool = False,
    wait_spin_us: int = 0,
    calls: tuple[str, ...] = (),
) -> bytes:
    """``cross``: the service's cross-node lane runs (SEND_TO is worth trying). ``calls``: the
    CALLs it answers ("expect_delta"). ``src_i64``: it
    reads i64 source pages (FLAG_SRC_I64). ``chunks``: it takes chunks with aux rows
    (FLAG_CHUNK). ``wait_spin_us``: how long the service advises a
    waiting thread to poll before it sleeps (the engine's own setting wins)."""
    msg = {
        "ok": ok,
        "error": error,
        "self_addresses": self_addresses or [],
        "cross": cross,
        "src_i64": True,
        "chunks": True,
        "wait_spin_us": wait_spin_us,
        "calls": list(calls),
    }
    return json.dumps(msg).encode()


def parse_welcome(data: bytes) -> dict[str, Any]:
    msg = json.loads(data.decode())
    if not isinstance(msg, dict) or "ok" not in msg:
        raise ValueError("not a lane welcome")
    return msg
