"""decode_batch: every wire shape vLLM and SGLang emit, and malformed payloads."""

from __future__ import annotations

import dataclasses

import msgpack
import msgspec
import pytest

from kvservice.index.events import AllBlocksCleared, BlockRemoved, BlockStored, EventFormatError, decode_batch
from tests.support.engine_schemas import removed, sglang_structs, stored, vllm_structs

SCHEMAS = {
    "vllm-map-events": vllm_structs(array_events=False),
    "vllm-array-events": vllm_structs(array_events=True),
    "sglang": sglang_structs(),
}


@pytest.mark.parametrize("name", SCHEMAS)
def test_engine_batches_decode(name: str) -> None:
    """Batches encoded with each engine's structs decode to the same events."""
    s = SCHEMAS[name]
    h = [b"\x01" * 32, b"\x02" * 32] if name.startswith("vllm") else [11, 12]
    events = [stored(s, h, None, list(range(8)), 4), removed(s, h[1:]), s["cleared"]()]
    kw = {"data_parallel_rank": 3} if "data_parallel_rank" in s["batch"].__struct_fields__ else {}
    batch = decode_batch(msgspec.msgpack.encode(s["batch"](ts=1.5, events=events, **kw)))
    got = batch.events[0]
    assert isinstance(got, BlockStored) and got.token_ids.tolist() == list(range(8))
    assert dataclasses.replace(got, token_ids=None) == BlockStored(tuple(h), None, None, 4, medium=got.medium)
    assert batch.events[1:] == (BlockRemoved((h[1],), batch.events[1].medium), AllBlocksCleared())
    assert batch.data_parallel_rank == kw.get("data_parallel_rank") and batch.ts == 1.5


def test_map_encoded_batch_decodes() -> None:
    """The map encoding of a batch (non array_like structs) decodes too."""
    raw = {"ts": 2.0, "events": [{"type": "BlockRemoved", "block_hashes": [5]}], "data_parallel_rank": 1}
    batch = decode_batch(msgpack.packb(raw))
    assert batch.events == (BlockRemoved((5,)),) and batch.data_parallel_rank == 1


def test_unknown_event_types_are_counted_not_fatal() -> None:
    """A newer event type is skipped and counted; the rest of the batch applies."""
    batch = decode_batch(msgpack.packb([0.0, [["FutureEvent", 1], ["AllBlocksCleared"]]]))
    assert batch.events == (AllBlocksCleared(),) and batch.unknown_events == 1


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1garbage",
        msgpack.packb("x"),
        msgpack.packb([0.0, "events"]),
        msgpack.packb([0.0, [["BlockStored", [1], None]]]),
        msgpack.packb([0.0, [["BlockStored", [1.5], None, [1, 2], 2]]]),
        msgpack.packb([0.0, [["BlockStored", [1], None, [-1, 2], 2]]]),
        msgpack.packb([0.0, [["BlockStored", [1], None, [1, 2], 0]]]),
        msgpack.packb([0.0, [{"block_hashes": [1]}]]),
        msgpack.packb({"ts": 0.0, "events": [], "data_parallel_rank": "x"}),
    ],
)
def test_malformed_payloads_raise(payload: bytes) -> None:
    """Garbage, wrong shapes and wrong field types raise EventFormatError."""
    with pytest.raises(EventFormatError):
        decode_batch(payload)
