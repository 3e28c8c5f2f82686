"""protobuf <-> domain conversions for the servicers (the only place that does them)."""

from __future__ import annotations

import numpy as np
from kvservice_client import Layout
from kvservice_client._proto import common_pb2, kvservice_pb2

from ..buffers import BufferSet
from ..errors import InvalidArgument

__all__ = ["buffer_set_info", "layout", "session_of", "token_ids"]


def layout(pb: common_pb2.Layout, field: str = "layout") -> Layout:
    if not pb.ByteSize() and field:
        raise InvalidArgument(field, "is required")
    return Layout.from_proto(pb)


def token_ids(pb: common_pb2.TokenIds, field: str) -> np.ndarray:
    """Packed u32-LE token ids as a uint32 array (zero-copy view of the message bytes)."""
    if len(pb.u32le) % 4:
        raise InvalidArgument(f"{field}.u32le", f"length {len(pb.u32le)} is not a multiple of 4")
    return np.frombuffer(pb.u32le, dtype="<u4")


def session_of(context: object) -> str | None:
    for key, value in context.invocation_metadata() or ():  # type: ignore[attr-defined]
        if key == "kvservice-session":
            return str(value)
    return None


def buffer_set_info(bs: BufferSet, indexed_pages: int) -> kvservice_pb2.BufferSetInfo:
    return kvservice_pb2.BufferSetInfo(
        buffer_set_id=bs.buffer_set_id,
        engine_id=bs.engine_id,
        layout=bs.layout.to_proto(),
        memory=bs.memory,
        total_bytes=bs.total_bytes,
        indexed_pages=indexed_pages,
        session_id=bs.session_id,
    )
