"""Decode KV-event batches as vLLM and SGLang publish them (msgpack, msgspec structs).

Both engines encode ``msgspec`` structs; the struct options decide the wire shape, and
deployed versions differ, so every combination is accepted::

    batch   array  [ts, events]                    SGLang, older vLLM (array_like)
            array  [ts, events, dp_rank]           vLLM (dp rank omitted when None)
            map    {"ts", "events", "data_parallel_rank"?}
    event   array  ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                    lora_id?, medium?, lora_name?, extra_keys?, group_idx?,
                    kv_cache_spec_kind?, kv_cache_spec_sliding_window?, locality?,
                    ownership?, session_id?]                          (tag first, array_like)
            map    {"type": "BlockStored", "block_hashes": ..., ...}   (tag field "type"; vLLM
                    0.32 sends this, omitting fields that hold their default)

vLLM 0.32 (vllm/distributed/kv_events.py) as recorded from a real run::

    [ts, [{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": None,
           "token_ids": [...], "block_size": 32, "lora_id": None, "medium": "GPU",
           "lora_name": None, "extra_keys": [None], "group_idx": 0,
           "kv_cache_spec_kind": "full_attention"}], dp_rank?]

``extra_keys`` has one entry per block (None: the block has none).

Block hashes are ints (SGLang, vLLM with int hashes) or bytes (vLLM sha256). A batch decodes
completely or raises ``EventFormatError``; the caller then applies nothing of it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import numpy as np

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
                  "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                  "kv_cache_spec_sliding_window", "locality", "ownership", "session_id",
                  "cache_salt")  # fmt: skip
# NOTE: array-encoded events follow vLLM's field order; SGLang (0.5.23) sends tagged maps only,
# whose fields (medium, cache_salt, session_id, lora_name) are matched by name.
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")


class EventFormatError(ValueError):
    """A payload that is not a KV-event batch of a known shape."""


@dataclasses.dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: np.ndarray  # uint32
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: Any = None  # None, or one entry per block (None: that block has no extra keys)
    group_idx: int | None = None  # KV-cache group (hybrid models have several)
    kv_cache_spec_kind: str | None = None  # "full_attention", "sliding_window", "mamba", ...
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None  # "LOCAL" / "REMOTE" relative to the publisher
    ownership: str | None = None
    session_id: str | None = None
    cache_salt: str | None = None  # SGLang: the engine's hashes are namespaced by it

    def block_has_extra_keys(self) -> list[bool]:
        """Per block: does its hash include extra keys (multimodal, cache salt, LoRA name)?"""
        n = len(self.block_hashes)
        if not self.extra_keys:
            return [False] * n
        if not isinstance(self.extra_keys, list) or len(self.extra_keys) != n:
            return [True] * n  # older single-value form, or malformed: treat every block as keyed
        return [k is not None and k != [] for k in self.extra_keys]


@dataclasses.dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


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


def _u32(tokens: Any) -> np.ndarray:
    """Token ids as uint32, checked without a Python loop per token."""
    if not isinstance(tokens, list):
        raise EventFormatError("BlockStored: token_ids must be a list of u32")
    if not tokens:
        return np.empty(0, np.uint32)
    try:
        arr = np.asarray(tokens)
    except (OverflowError, ValueError):
        raise EventFormatError("BlockStored: token_ids must be a list of u32") from None
    if arr.ndim != 1 or arr.dtype.kind not in "iu" or arr.min() < 0 or arr.max() >= 2**32:
        raise EventFormatError("BlockStored: token_ids must be a list of u32")
    return arr.astype(np.uint32)


def _group(f: dict[str, Any], what: str) -> None:
    g = f.get("group_idx")
    if g is not None and (not isinstance(g, int) or isinstance(g, bool) or g < 0):
        raise EventFormatError(f"{what}: group_idx must be a non-negative int or nil")


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
        f["token_ids"] = _u32(tokens)
        if not isinstance(size, int) or size <= 0:
            raise EventFormatError("BlockStored: block_size must be a positive int")
        f["block_hashes"] = _hashes(f["block_hashes"], "BlockStored")
        _group(f, "BlockStored")
        return BlockStored(**f)
    if tag == "BlockRemoved":
        f = _fields(raw, _REMOVED_FIELDS, 1)
        f["block_hashes"] = _hashes(f["block_hashes"], "BlockRemoved")
        _group(f, "BlockRemoved")
        return BlockRemoved(**f)
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
