"""KV events: ingestion (vLLM / SGLang ZMQ publishers) into presence-only buffer sets, and
re-publication of the node's index in vLLM's format."""

from __future__ import annotations

from ._apply import EventApplier, StreamConfig
from ._decode import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, EventFormatError, decode_batch
from .republisher import EventRepublisher, RepublishConfig
from .subscriber import EventSubscriber

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventApplier",
    "EventBatch",
    "EventFormatError",
    "EventRepublisher",
    "EventSubscriber",
    "RepublishConfig",
    "StreamConfig",
    "decode_batch",
]
