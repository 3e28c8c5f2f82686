"""msgspec structs with the options vLLM and SGLang publish KV events with (test fixtures).

Declared from the engines' published schemas (vllm/distributed/kv_events.py,
sglang/srt/disaggregation/kv_events.py): the struct options (array_like, tag, omit_defaults)
decide the bytes, so encoding these gives byte-for-byte what those engines send.
"""

from __future__ import annotations

from typing import Any

import msgspec


def vllm_structs(array_events: bool) -> dict[str, Any]:
    """vLLM: batch array_like; events tagged maps (current) or tagged arrays (older releases)."""

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, array_like=array_events, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[bytes | int]
        parent_block_hash: bytes | int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[Any] | None = None
        group_idx: int | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[bytes | int]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    return {"batch": EventBatch, "stored": BlockStored, "removed": BlockRemoved, "cleared": AllBlocksCleared}


def sglang_structs() -> dict[str, Any]:
    """SGLang: batch [ts, events] and tagged-array events with int hashes."""

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]

    class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]

    class AllBlocksCleared(KVCacheEvent):
        pass

    return {"batch": EventBatch, "stored": BlockStored, "removed": BlockRemoved, "cleared": AllBlocksCleared}


def stored(s: dict[str, Any], hashes: list, parent: Any, tokens: list[int], size: int) -> Any:
    """A BlockStored of either engine with no LoRA and GPU medium where the schema has one."""
    fields = s["stored"].__struct_fields__
    extra = {"medium": "GPU", "lora_name": None} if "medium" in fields else {}
    return s["stored"](block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=size,
                       lora_id=None, **extra)  # fmt: skip


def removed(s: dict[str, Any], hashes: list) -> Any:
    extra = {"medium": "GPU"} if "medium" in s["removed"].__struct_fields__ else {}
    return s["removed"](block_hashes=hashes, **extra)
