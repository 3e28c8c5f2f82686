"""kvservice client SDK: sync and asyncio clients, regions, layouts, hashing, typed results."""

from ._aio import AsyncClient
from ._background import BackgroundClient, ChunkedSend
from ._client import Client, ask_service_peer_address
from ._errors import (
    Aborted,
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KVClientError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    ServerError,
    SessionLost,
    Unauthenticated,
    Unavailable,
    Unimplemented,
)
from ._keepalive import DEFAULT_KEEPALIVE, KeepalivePolicy
from ._landing import Claimed
from ._layout import Layout
from ._regions import AuxSpec, Region, ShmKVPool, cuda_region, pointer_region, shm_region
from ._security import ChannelSecurity
from ._types import (
    EvictionSuggestion,
    MatchResult,
    Offloaded,
    PrefixMatch,
    RegisteredBuffers,
    TransferLoad,
    TransferStatus,
)
from .hashing import page_hashes, tokens_to_u32le

__all__ = [
    "ask_service_peer_address",
    "Aborted",
    "AlreadyExists",
    "AsyncClient",
    "BackgroundClient",
    "ChannelSecurity",
    "ChunkedSend",
    "AuxSpec",
    "Claimed",
    "Client",
    "DEFAULT_KEEPALIVE",
    "DeadlineExceeded",
    "EvictionSuggestion",
    "FailedPrecondition",
    "InvalidArgument",
    "KVClientError",
    "KeepalivePolicy",
    "Layout",
    "MatchResult",
    "Offloaded",
    "NotFound",
    "PermissionDenied",
    "PrefixMatch",
    "Region",
    "RegisteredBuffers",
    "ResourceExhausted",
    "ServerError",
    "SessionLost",
    "ShmKVPool",
    "TransferLoad",
    "TransferStatus",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "cuda_region",
    "pointer_region",
    "page_hashes",
    "shm_region",
    "tokens_to_u32le",
]
__version__ = "0.1.0"
