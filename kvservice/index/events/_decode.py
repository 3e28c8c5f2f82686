"""Decode KV-event batches as vLLM and SGLang publish them (msgpack, msgspec structs).

Both engines encode ``msgspec`` structs; the struct options decide the wire shape, and
deployed versions differ, so every combination is accepted::

    batch   array  [ts, events]                    SGLang, older vLLM (array_like)
            array  [ts, events, dp_rank]           vLLM (dp rank omitted when None)
            map    {"ts", "events", "data_parallel_rank"?}
    event   array  ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                    lora_id?, medium?, lora_name?, extra_keys?, ...]   (tag first, array_like)
            map    {"type": "BlockStored", "block_hashes": ..., ...}   (tag field "type")

Block hashes are ints (SGLang, vLLM with int hashes) or bytes (vLLM sha256). A batch decodes
completely or raises ``EventFormatError``; the caller then applies nothing of it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "EventFormatError",
    "decode_batch",
]

BlockHash = int | bytes
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                  "lora_name", "extra_keys")  # fmt: skip
_REMOVED_FIELDS = ("block_hashes", "medium")


class EventFormatError(ValueError):
    """A payload that is not a KV-event batch of a known shape."""


@dataclasses.dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: Any = None


@dataclasses.dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None


@dataclasses.dataclass(frozen=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclasses.dataclass(frozen=True)
class EventBatch:
    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None
    unknown_events: int  # events of a type this version does not know (skipped)


def _fields(raw: Any, names: tuple[str, ...], required: int) -> dict[str, Any]:
    if isinstance(raw, list):
        if not required <= len(raw) - 1:
            raise EventFormatError(f"{raw[0]} has {len(raw) - 1} fields, needs {required}")
        return dict(zip(names, raw[1 : 1 + len(names)], strict=False))
    missing = [n for n in names[:required] if n not in raw]
    if missing:
        raise EventFormatError(f"{raw.get('type')} lacks {missing}")
    return {n: raw[n] for n in names if n in raw}


def _hashes(v: Any, what: str) -> tuple[BlockHash, ...]:
    if not isinstance(v, list) or not all(isinstance(h, (int, bytes)) and not isinstance(h, bool) for h in v):
        raise EventFormatError(f"{what}: block hashes must be a list of ints or bytes")
    return tuple(v)


def _event(raw: Any) -> Event | None:
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag = raw[0]
    elif isinstance(raw, dict) and isinstance(raw.get("type"), str):
        tag = raw["type"]
    else:
        raise EventFormatError("event is neither a tagged array nor a tagged map")
    if tag == "BlockStored":
        f = _fields(raw, _STORED_FIELDS, 4)
        parent, tokens, size = f["parent_block_hash"], f["token_ids"], f["block_size"]
        if parent is not None and not isinstance(parent, (int, bytes)):
            raise EventFormatError("BlockStored: parent_block_hash must be int, bytes or nil")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < 2**32 for t in tokens):
            raise EventFormatError("BlockStored: token_ids must be a list of u32")
        if not isinstance(size, int) or size <= 0:
            raise EventFormatError("BlockStored: block_size must be a positive int")
        f["block_hashes"] = _hashes(f["block_hashes"], "BlockStored")
        f["token_ids"] = tuple(tokens)
        return BlockStored(**f)
    if tag == "BlockRemoved":
        f = _fields(raw, _REMOVED_FIELDS, 1)
        return BlockRemoved(_hashes(f["block_hashes"], "BlockRemoved"), f.get("medium"))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one msgpack payload (the third frame of a published message)."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types for garbage
        raise EventFormatError(f"not msgpack: {e}") from e
    if isinstance(obj, list) and len(obj) in (2, 3):
        ts, raw_events, dp = obj[0], obj[1], obj[2] if len(obj) == 3 else None
    elif isinstance(obj, dict) and "events" in obj:
        ts, raw_events, dp = obj.get("ts", 0.0), obj["events"], obj.get("data_parallel_rank")
    else:
        raise EventFormatError("batch is neither [ts, events, dp_rank?] nor a map with events")
    if not isinstance(ts, (int, float)) or not isinstance(raw_events, list):
        raise EventFormatError("batch: ts must be a number and events a list")
    if dp is not None and not isinstance(dp, int):
        raise EventFormatError("batch: data_parallel_rank must be an int or nil")
    decoded = [_event(e) for e in raw_events]
    known = tuple(e for e in decoded if e is not None)
    return EventBatch(float(ts), known, dp, len(decoded) - len(known))
