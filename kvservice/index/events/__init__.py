"""KV-event ingestion (vLLM / SGLang ZMQ publishers) into presence-only buffer sets."""

from __future__ import annotations

from ._apply import EventApplier, StreamConfig
from ._decode import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, EventFormatError, decode_batch
from .subscriber import EventSubscriber

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventApplier",
    "EventBatch",
    "EventFormatError",
    "EventSubscriber",
    "StreamConfig",
    "decode_batch",
]
