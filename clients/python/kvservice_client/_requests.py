"""Request builders shared by the sync and asyncio clients (one place converts Python -> proto)."""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import grpc
import numpy as np

from ._errors import InvalidArgument
from ._proto import common_pb2, kvservice_pb2
from .hashing import tokens_to_u32le

__all__ = ["SESSION_METADATA_KEY", "SESSION_RELEASED", "connection_broke", "new_request_id", "owned_metadata"]

SESSION_METADATA_KEY = "kvservice-session"
SESSION_RELEASED = "was released"  # in the service's UNAUTHENTICATED message for a released session
REQUEST_ID_METADATA_KEY = "kvservice-request-id"  # one per owned call, the same on each try
STATUS_ORIGIN_METADATA_KEY = "kvservice-status-origin"  # set on every status the service sends
RETRY_PAUSE_S = 0.05
_PATHS = {"auto": 0, "direct": 1, "packed": 2, "fused": 3}

TokensLike = Sequence[int] | np.ndarray | bytes
HashesLike = Sequence[int] | np.ndarray


def new_request_id() -> str:
    return secrets.token_hex(12)


def owned_metadata(session_id: str, request_id: str = "") -> tuple[tuple[str, str], ...]:
    """Metadata of an owned call: its session, and a request id the service runs once."""
    return ((SESSION_METADATA_KEY, session_id), (REQUEST_ID_METADATA_KEY, request_id or new_request_id()))


def connection_broke(exc: grpc.RpcError) -> bool:
    """UNAVAILABLE that the service did not send (the connection broke): the same call, with the
    same request id, may be tried again — the service answers a request id it ran with that
    call's outcome instead of running it twice."""
    if not hasattr(exc, "code") or exc.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    trailing = exc.trailing_metadata() or ()
    return all(key != STATUS_ORIGIN_METADATA_KEY for key, _ in trailing)


def _key(tokens: TokensLike | None, hashes: HashesLike | None) -> dict[str, object]:
    if (tokens is None) == (hashes is None):
        raise ValueError("give exactly one of tokens or hashes")
    if tokens is not None:
        return {"tokens": common_pb2.TokenIds(u32le=tokens_to_u32le(tokens))}
    return {"hashes": common_pb2.PageHashes(hashes=[int(h) for h in np.asarray(hashes, dtype=np.uint64)])}


def _aux(aux: Mapping[str, Iterable[int]] | None) -> list[common_pb2.AuxRows]:
    return [common_pb2.AuxRows(name=n, rows=_idx(rows, f"aux[{n}].rows")) for n, rows in (aux or {}).items()]


def _idx(values: Iterable[int] | np.ndarray, field: str) -> list[int]:
    """Page or row indices as a list for a uint32 field; InvalidArgument naming ``field`` if not."""
    arr = np.asarray(values if not isinstance(values, (set, frozenset)) else sorted(values))
    if arr.size and (arr.dtype.kind not in "iu" or arr.ndim != 1):
        raise InvalidArgument(f"{field}: must be a 1-D sequence of integers")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        bad = int(arr[(arr < 0) | (arr > 0xFFFFFFFF)][0])
        raise InvalidArgument(f"{field}: index {bad} is outside 0..2**32-1")
    return arr.tolist()


def _u32(value: int, field: str) -> int:
    if not 0 <= int(value) <= 0xFFFFFFFF:
        raise InvalidArgument(f"{field}: {value} is outside 0..2**32-1")
    return int(value)


def _u64(value: int, field: str) -> int:
    if not 0 <= int(value) < 2**64:
        raise InvalidArgument(f"{field}: {value} is outside 0..2**64-1")
    return int(value)


def register(args: Any) -> kvservice_pb2.RegisterBuffersRequest:
    """The request for a ``_session.RegisterArgs`` (kept by the client to register again)."""
    return kvservice_pb2.RegisterBuffersRequest(
        layout=args.layout.to_proto(),
        k_regions=[r.to_proto() for r in args.k_regions],
        v_regions=[r.to_proto() for r in args.v_regions],
        aux_regions=[a.to_proto() for a in args.aux],
        engine_id=args.engine_id,
        inbound_max_transfers=_u32(args.inbound_max_transfers, "inbound_max_transfers"),
        inbound_max_bytes=_u64(args.inbound_max_bytes, "inbound_max_bytes"),
    )


def match(
    tokens: TokensLike | None,
    hashes: HashesLike | None,
    page_size: int,
    buffer_set_ids: Sequence[str],
    dp_rank: int | None,
    scores_only: bool,
    lease_ttl_ms: int,
) -> kvservice_pb2.MatchPrefixRequest:
    return kvservice_pb2.MatchPrefixRequest(
        page_size=page_size,
        buffer_set_ids=list(buffer_set_ids),
        has_dp_rank=dp_rank is not None,
        dp_rank=dp_rank or 0,
        scores_only=scores_only,
        lease_ttl_ms=lease_ttl_ms,
        **_key(tokens, hashes),  # type: ignore[arg-type]
    )


def publish(
    buffer_set_id: str,
    page_indices: Iterable[int] | np.ndarray,
    tokens: TokensLike | None,
    hashes: HashesLike | None,
    priority: int,
) -> kvservice_pb2.PublishPagesRequest:
    return kvservice_pb2.PublishPagesRequest(
        buffer_set_id=buffer_set_id,
        page_indices=_idx(page_indices, "page_indices"),
        priority=priority,
        **_key(tokens, hashes),  # type: ignore[arg-type]
    )


def offload(
    buffer_set_id: str, page_indices: Iterable[int] | np.ndarray, hashes: HashesLike | None
) -> kvservice_pb2.OffloadPagesRequest:
    return kvservice_pb2.OffloadPagesRequest(
        buffer_set_id=buffer_set_id,
        page_indices=_idx(page_indices, "page_indices"),
        hashes=_hashes(hashes if hashes is not None else (), "hashes"),
    )


def load(
    buffer_set_id: str, page_indices: Iterable[int] | np.ndarray, hashes: HashesLike
) -> kvservice_pb2.LoadPagesRequest:
    return kvservice_pb2.LoadPagesRequest(
        buffer_set_id=buffer_set_id,
        page_indices=_idx(page_indices, "page_indices"),
        hashes=_hashes(hashes, "hashes"),
    )


def _hashes(values: HashesLike, field: str) -> list[int]:
    """Page hashes as a list for a uint64 field; InvalidArgument naming ``field`` if not."""
    if isinstance(values, np.ndarray):
        if values.size and (values.dtype.kind not in "iu" or values.ndim != 1 or (values < 0).any()):
            raise InvalidArgument(f"{field}: must be a 1-D array of unsigned 64-bit page hashes")
        return values.astype(np.uint64, copy=False).tolist()
    vals = list(values)
    if not all(isinstance(v, (int, np.integer)) for v in vals):
        raise InvalidArgument(f"{field}: must be integers (unsigned 64-bit page hashes)")
    try:
        return np.asarray(vals, dtype=np.uint64).tolist()
    except OverflowError as e:
        raise InvalidArgument(f"{field}: must be unsigned 64-bit page hashes ({e})") from None


def expect(
    transfer_id: str,
    buffer_set_id: str,
    prefix_pages: int,
    dst_page_indices: Iterable[int] | np.ndarray,
    expected_senders: int,
    deadline_ms: int,
    aux: Mapping[str, Iterable[int]] | None,
    publish_tokens: TokensLike | None,
    prefix_page_indices: Iterable[int] | np.ndarray,
    allowed_senders: Iterable[str] = (),
) -> kvservice_pb2.ExpectDeltaRequest:
    req = kvservice_pb2.ExpectDeltaRequest(
        transfer_id=transfer_id,
        buffer_set_id=buffer_set_id,
        prefix_pages=_u32(prefix_pages, "prefix_pages"),
        dst_page_indices=_idx(dst_page_indices, "dst_page_indices"),
        expected_senders=_u32(expected_senders, "expected_senders"),
        deadline_ms=_u32(deadline_ms, "deadline_ms"),
        aux=_aux(aux),
        prefix_page_indices=_idx(prefix_page_indices, "prefix_page_indices"),
        allowed_senders=list(allowed_senders),
    )
    if publish_tokens is not None:
        req.publish_tokens.u32le = tokens_to_u32le(publish_tokens)
    return req


def send(
    transfer_id: str,
    buffer_set_id: str,
    src_page_indices: Iterable[int] | np.ndarray,
    chunk_offset: int,
    last_chunk: bool,
    peer_address: str,
    aux: Mapping[str, Iterable[int]] | None,
    deadline_ms: int,
    path: str,
    no_duplicate_mark: bool = False,
) -> kvservice_pb2.SendDeltaRequest:
    if path not in _PATHS:
        raise InvalidArgument(f"path: must be one of {sorted(_PATHS)}")
    return kvservice_pb2.SendDeltaRequest(
        transfer_id=transfer_id,
        buffer_set_id=buffer_set_id,
        chunk_offset=_u32(chunk_offset, "chunk_offset"),
        src_page_indices=_idx(src_page_indices, "src_page_indices"),
        last_chunk=last_chunk,
        peer_address=peer_address,
        aux=_aux(aux),
        deadline_ms=_u32(deadline_ms, "deadline_ms"),
        path=_PATHS[path],  # type: ignore[arg-type]
        no_duplicate_mark=no_duplicate_mark,
    )
