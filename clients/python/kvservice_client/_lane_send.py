"""SendDelta over the lane, for both clients (the sync :class:`Client` and :class:`AsyncClient`):
which chunk may go there, and that a transfer's chunks all take the route its first took.

    send_delta ─▶ LaneSend.try_send ─▶ the lane took the chunk: its status (queued)
                                    └─▶ None: the client makes the gRPC call

A transfer never switches routes between its chunks: the service's lane holds the chunks it took
(its stream), gRPC would not continue them. A later chunk the lane cannot take is refused there
(FailedPrecondition, the transfer ends FAILED); one that cannot even be put on the lane (its
connection is gone) is refused here the same way.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from . import lane_wire
from ._errors import FailedPrecondition, InvalidArgument
from ._lane import Lane, LaneOpener
from ._types import TransferStatus

__all__ = ["LaneSend"]

_ROUTES = 4096  # transfers between their first and last chunk remembered (abandoned ones go)
Chunk = tuple[int, bool, dict[str, np.ndarray]]  # (chunk_offset, last_chunk, aux rows by name)


def _aux_arrays(aux: Mapping[str, Iterable[int]] | None) -> dict[str, np.ndarray]:
    return {
        name: np.asarray(rows if isinstance(rows, np.ndarray) else list(rows), dtype=np.int64).reshape(-1)
        for name, rows in (aux or {}).items()
    }


class LaneSend:
    def __init__(self, opener: LaneOpener, book: Any, owned: Any, timeout: float) -> None:
        self.opener = opener
        self.book = book  # the client's Ended book (``made``)
        self.owned = owned
        self.timeout = timeout
        # (transfer id, buffer set) of a transfer whose first chunk went and whose last has not
        # -> (True: its chunks go on the lane, False: over gRPC; the peer address they name)
        self._routes: collections.OrderedDict[tuple[str, str], tuple[bool, str]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def try_send(
        self,
        session_id: str,
        transfer_id: str,
        buffer_set_id: str,
        src: Any,
        peer_address: str,
        chunk_offset: int,
        last_chunk: bool,
        aux: Mapping[str, Iterable[int]] | None,
        path: str,
        no_duplicate_mark: bool,
    ) -> TransferStatus | None:
        """The chunk on the lane: its status; None: make the gRPC call. For a later chunk of a
        transfer the lane has: InvalidArgument (a bad chunk, nothing changed: the transfer goes
        on) or FailedPrecondition (the transfer is over, or ends FAILED)."""
        whole = chunk_offset == 0 and last_chunk and not aux
        route, to = self._route(transfer_id, buffer_set_id, last_chunk)
        if route is True and peer_address != to:  # as the service says it over gRPC
            self._set_route(transfer_id, buffer_set_id, True, to)
            raise InvalidArgument(f"peer_address: differs from the transfer's {to!r}")
        if route is not False and path.lower() in ("auto", "fused"):
            chunk = None if whole else (chunk_offset, last_chunk, _aux_arrays(aux))
            lane = self.opener.get(session_id)
            try:
                sent = self._send(
                    lane, transfer_id, buffer_set_id, src, peer_address, no_duplicate_mark, path, chunk
                )
            except InvalidArgument:
                if route is True:  # a bad chunk changed nothing: the transfer goes on where it was
                    self._set_route(transfer_id, buffer_set_id, True, peer_address)
                raise
            if sent is not None:
                if not last_chunk:
                    self._set_route(transfer_id, buffer_set_id, True, peer_address)
                return sent
            if route is True:
                raise FailedPrecondition(
                    f"transfer_id {transfer_id!r}: the lane took its earlier chunks and cannot take "
                    "this one (its connection is gone, or the chunk does not fit a lane message): "
                    "the transfer ends FAILED"
                )
        if not last_chunk:
            self._set_route(transfer_id, buffer_set_id, False, peer_address)
        return None

    def _route(self, transfer_id: str, buffer_set_id: str, last: bool) -> tuple[bool | None, str]:
        """How the transfer's earlier chunks went (None: this is its first) and to which peer;
        its last chunk forgets it."""
        key = (transfer_id, buffer_set_id)
        with self._lock:
            got = self._routes.pop(key, None) if last else self._routes.get(key)
        return got if got is not None else (None, "")

    def _set_route(self, transfer_id: str, buffer_set_id: str, lane: bool, peer_address: str) -> None:
        with self._lock:
            self._routes[(transfer_id, buffer_set_id)] = (lane, peer_address)
            if len(self._routes) > _ROUTES:
                self._routes.popitem(last=False)

    def _send(
        self,
        lane: Lane | None,
        transfer_id: str,
        buffer_set_id: str,
        src: Any,
        peer_address: str,
        no_duplicate_mark: bool,
        path: str,
        chunk: Chunk | None,
    ) -> TransferStatus | None:
        """A chunk (``chunk``: offset, last, aux; None: the whole transfer) over the lane when its
        receiver is this node's service, or another service whose cross-node lane offered it,
        and the service takes it; None: make the gRPC call (see kvservice_client.lane_wire)."""
        if lane is None:
            return None
        to = "" if peer_address in lane.self_addresses else peer_address
        if to and (not lane.cross or path.lower() != "auto"):  # FUSED asked: gRPC says why not
            return None
        if chunk is not None and not lane.chunks:  # an older service: whole transfers only
            return None
        if isinstance(src, np.ndarray) and src.dtype == np.int64 and src.ndim == 1:
            pages = src  # (np.asarray costs ~9 µs a call on a GPU host's cold caches)
        else:
            pages = np.asarray(src, dtype=np.int64).reshape(-1)
        flags = lane_wire.FLAG_NO_DUPLICATE_MARK if no_duplicate_mark else 0
        if pages.size == 0 and chunk is None:
            return None
        if lane.src_i64:  # the service refuses a page outside i32 (numpy's min/max: ~20 µs cold)
            flags |= lane_wire.FLAG_SRC_I64
        elif pages.size and (pages.min() < 0 or pages.max() >= 2**31):
            return None
        if not lane.send(transfer_id, buffer_set_id, pages, flags, self.timeout, to, chunk):
            return None
        # after the SEND (off the copy's path): an END booked before it still counts (Ended.made)
        self.book.made(transfer_id, "SENDER", buffer_set_id)
        self.owned.add_transfer(transfer_id)
        return TransferStatus.queued(transfer_id, "SENDER", buffer_set_id, "PACKED" if to else "FUSED")
