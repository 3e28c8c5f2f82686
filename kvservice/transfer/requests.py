"""Validating ExpectDelta / SendDelta arguments into receiver declarations and sender chunks.

Every check happens before anything changes; errors name the request field.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..buffers import BufferSet
from ..errors import FailedPrecondition, InvalidArgument
from ..kernels import distinct
from ..peers_allow import check_peer_address
from .load import expected_bytes
from .plan import src_pages_array
from .receiver import Incoming
from .records import Record
from .sender import Chunk, Outgoing

if TYPE_CHECKING:
    from .engine import TransferEngine

__all__ = ["build_chunk", "build_incoming", "check_aux"]

MAX_ID = 256
MAX_ALLOWED_SENDERS = 64


def _transfer_id(tid: str) -> str:
    if not tid:
        raise InvalidArgument("transfer_id", "is required")
    if len(tid) > MAX_ID:
        raise InvalidArgument("transfer_id", f"longer than {MAX_ID} characters")
    return tid


def _deadline(engine: TransferEngine, deadline_ms: int) -> float:
    cfg = engine.config
    if deadline_ms > cfg.transfer.max_deadline_ms:
        raise InvalidArgument(
            "deadline_ms", f"{deadline_ms} exceeds the service maximum {cfg.transfer.max_deadline_ms}"
        )
    return time.monotonic() + (deadline_ms or cfg.transfer.default_deadline_ms) / 1000


def check_aux(bs: BufferSet, aux: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``aux`` (name -> rows) if every name is an aux region of ``bs`` and its rows are distinct
    and in range; InvalidArgument naming the field otherwise."""
    for name, rows in aux.items():
        mine = bs.aux_by_name(name)
        if mine is None:
            raise InvalidArgument("aux", f"buffer set has no aux region named {name!r}")
        if rows.size and (rows.min() < 0 or rows.max() >= mine.num_rows):
            raise InvalidArgument(f"aux[{name}].rows", f"row outside 0..{mine.num_rows - 1}")
        if rows.size and not distinct(rows.astype(np.int64, copy=False), mine.num_rows):
            raise InvalidArgument(f"aux[{name}].rows", "rows must be distinct")
    return aux


def check_whole(bs: BufferSet) -> None:
    """FailedPrecondition once ``bs``'s owner shrank its memory under the service (guard.py)."""
    why = bs.lost()
    if why:
        raise FailedPrecondition(f"buffer_set_id: {why}")


def build_incoming(
    engine: TransferEngine,
    session_id: str,
    *,
    transfer_id: str,
    buffer_set_id: str,
    prefix_pages: int,
    dst_page_indices: Any,
    aux: dict[str, np.ndarray],
    expected_senders: int,
    deadline_ms: int,
    publish_tokens: np.ndarray | None,
    publish_hashes: np.ndarray | None,
    prefix_page_indices: Any,
    allowed_senders: Sequence[str] = (),
    landing_pages: int | None = None,
    landing_aux: dict[str, int] | None = None,
) -> Incoming:
    """A receiver declaration; with ``landing_pages`` (not None) a landing one, whose delta pages
    are pages ``0..n-1`` of a landing view and whose aux rows (``landing_aux``: a count per name)
    are rows ``0..count-1`` of its aux regions (``kvservice.transfer.landing.declare`` fills it in)."""
    tid = _transfer_id(transfer_id)
    if len(allowed_senders) > MAX_ALLOWED_SENDERS:
        raise InvalidArgument("allowed_senders", f"at most {MAX_ALLOWED_SENDERS} identities")
    for i, name in enumerate(allowed_senders):
        if not name or len(name) > 255:
            raise InvalidArgument(f"allowed_senders[{i}]", "must be a peer identity of 1..255 characters")
    bs = engine.buffers.get(buffer_set_id, session_id)
    check_whole(bs)
    if publish_tokens is not None:
        from kvservice_client.hashing import page_hashes

        publish_hashes = page_hashes(publish_tokens, bs.layout.page_size, engine.config.index.hash_seed)
    if landing_pages is None:
        dst = src_pages_array(dst_page_indices, bs.layout.num_pages, "dst_page_indices")
    else:
        from .landing.declare import landing_aux_rows, landing_dst

        dst = landing_dst(bs, landing_pages, dst_page_indices, aux, publish_tokens, prefix_pages)
        aux = landing_aux_rows(bs, landing_aux or {})
    prefix_idx = src_pages_array(prefix_page_indices, bs.layout.num_pages, "prefix_page_indices")
    if expected_senders > 1024:
        raise InvalidArgument("expected_senders", "must be <= 1024 (0 derives it from the layouts)")
    if publish_hashes is not None:
        total = prefix_pages + dst.size
        if publish_hashes.size < total - (landing_pages is not None):  # a landing's partial last page
            raise InvalidArgument(
                "publish", f"covers {publish_hashes.size} full pages, the transfer has {total}"
            )
        if prefix_idx.size != prefix_pages:
            raise InvalidArgument(
                "prefix_page_indices", f"need one per prefix page ({prefix_pages}) to publish"
            )
        if landing_pages is None and np.intersect1d(prefix_idx, dst).size:
            raise InvalidArgument("prefix_page_indices", "overlap dst_page_indices")
        publish_hashes = publish_hashes[:total]
    rec = Record(tid, "RECEIVER", bs.buffer_set_id, session_id, _deadline(engine, deadline_ms))
    aux = check_aux(bs, aux)
    rec.expected_bytes = expected_bytes(bs, int(dst.size), aux)
    return Incoming(
        rec,
        bs,
        prefix_pages,
        dst,
        aux,
        expected_senders,
        publish_hashes,
        prefix_idx,
        publish_tokens,
        allowed_senders=frozenset(allowed_senders),
    )


def build_chunk(
    engine: TransferEngine,
    session_id: str,
    *,
    transfer_id: str,
    buffer_set_id: str,
    chunk_offset: int,
    src_page_indices: Any,
    last_chunk: bool,
    peer_address: str,
    aux: dict[str, np.ndarray],
    deadline_ms: int,
    path: str,
    no_duplicate_mark: bool = False,
) -> tuple[Outgoing, Chunk]:
    tid = _transfer_id(transfer_id)
    bs = engine.buffers.get(buffer_set_id, session_id)
    check_whole(bs)
    src = src_pages_array(src_page_indices, bs.layout.num_pages)
    aux = check_aux(bs, aux)
    if not peer_address:
        raise InvalidArgument("peer_address", "is required (the receiver's kvservice address)")
    check_peer_address(peer_address, engine.config.security.peer_allowlist_entries)
    out = engine.sender.outgoing.get((tid, bs.buffer_set_id))
    if out is not None and out.rec.terminal and out.got_last and 0 < chunk_offset == out.next_offset:
        raise InvalidArgument(
            "chunk_offset",
            f"{chunk_offset} follows the last chunk of transfer {tid!r} (ended {out.rec.state}); "
            "a new transfer under this id starts with its own first chunk",
        )
    if out is None or (out.rec.terminal and out.got_last):
        # NOTE: the first chunk may start past 0 (a sender that knows the receiver's prefix sends
        # from there, e.g. SGLang's decode_prefix_len); positions it never sends must be in the
        # receiver's prefix, or the receiver ends FAILED naming the unsent pages.
        rec = Record(tid, "SENDER", bs.buffer_set_id, session_id, _deadline(engine, deadline_ms))
        out = Outgoing(rec, bs, peer_address, path, no_duplicate_mark=no_duplicate_mark)
    else:
        if out.rec.terminal:
            raise FailedPrecondition(f"transfer_id: {tid!r} already ended {out.rec.state}: {out.rec.error}")
        if out.got_last:
            raise FailedPrecondition(f"transfer_id: {tid!r} already received its last chunk")
        if peer_address != out.peer_address:
            raise InvalidArgument("peer_address", f"differs from the transfer's {out.peer_address!r}")
        if chunk_offset != out.next_offset:
            raise InvalidArgument(
                "chunk_offset", f"chunks must be contiguous and in order: expected {out.next_offset}"
            )
    chunk = Chunk(out.seq, chunk_offset, src, last_chunk, aux, time.monotonic())
    out.seq += 1
    out.next_offset = chunk_offset + src.size
    out.got_last = last_chunk
    return out, chunk
