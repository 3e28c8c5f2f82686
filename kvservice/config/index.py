"""The prefix index: page hashing, leases, KV events in and out, P/D duplicate marks."""

from __future__ import annotations

import dataclasses
from typing import Any

from ._option import ConfigError, check_choice, check_range, object_list, opt

__all__ = ["Index"]


@dataclasses.dataclass(frozen=True)
class Index:
    """Prefix index, KV events and P/D duplicates."""

    hash_seed: int = opt(0, "Seed of the canonical page hash (XXH3-64); must match clients.")
    max_lease_ttl_ms: int = opt(600_000, "Largest lease a MatchPrefix call may ask for.")
    kv_events: str = opt(
        "",
        "KV-event streams to ingest, as a JSON list (a YAML list in --config): each "
        '{"engine_id", "endpoint", "page_size", optional "replay_endpoint", "topic", "dp_rank", '
        '"scheme": "canonical"|"engine"}.',
    )
    republish_events: str = opt(
        "",
        "Re-publish this node's index as vLLM-format KV events, as a JSON list (a YAML list in "
        '--config): each {"endpoint" (ZMQ bind, e.g. "tcp://*:5600"), optional "replay_endpoint", '
        '"topic" (default "kv"), "engine_id" (default "*": every buffer set)}.',
    )
    duplicate_policy: str = opt(
        "lower",
        "What a sender's index does with pages a DONE transfer copied to a receiver that indexes "
        "them (the P/D duplicate): 'keep' (mark only), 'lower' (eviction priority lowered to "
        "duplicate_priority while the mark holds) or 'off' (no marks).",
    )
    duplicate_priority: int = opt(-1000, "Eviction priority of duplicated pages under policy 'lower'.")
    duplicate_check_ms: int = opt(
        1000,
        "How often a sender checks with the receivers' services that its duplicate marks still "
        "hold; a mark whose receiver evicted the pages, unregistered or went away is cleared "
        "within this period (plus one peer call timeout).",
    )

    def validate(self) -> None:
        if not 0 <= self.hash_seed < 2**64:
            raise ConfigError("hash_seed: must fit in an unsigned 64-bit integer")
        if self.max_lease_ttl_ms <= 0:
            raise ConfigError("max_lease_ttl_ms: must be > 0")
        self.event_streams()  # raises ConfigError naming kv_events
        self.republish_streams()  # raises ConfigError naming republish_events
        check_choice("duplicate_policy", self.duplicate_policy, ("keep", "lower", "off"))
        if not -(2**31) <= self.duplicate_priority < 2**31:
            raise ConfigError("duplicate_priority: must fit in int32")
        check_range("duplicate_check_ms", self.duplicate_check_ms, 50, 3_600_000)

    def event_streams(self) -> list[dict[str, Any]]:
        """The parsed ``kv_events`` list, validated."""
        keys = {"engine_id", "endpoint", "page_size", "replay_endpoint", "topic", "dp_rank", "scheme"}
        streams = object_list("kv_events", self.kv_events, keys, required=("engine_id", "endpoint"))
        seen = set()
        for i, st in enumerate(streams):
            if not isinstance(st.get("page_size"), int) or st["page_size"] <= 0:
                raise ConfigError(f"kv_events[{i}].page_size: a positive integer is required")
            if st.get("scheme", "canonical") not in ("canonical", "engine"):
                raise ConfigError(f"kv_events[{i}].scheme: must be 'canonical' or 'engine'")
            if st["engine_id"] in seen:
                raise ConfigError(f"kv_events[{i}].engine_id: duplicate {st['engine_id']!r}")
            seen.add(st["engine_id"])
        return streams

    def republish_streams(self) -> list[dict[str, Any]]:
        """The parsed ``republish_events`` list, validated."""
        keys = {"endpoint", "replay_endpoint", "topic", "engine_id"}
        streams = object_list("republish_events", self.republish_events, keys, required=("endpoint",))
        for i, st in enumerate(streams):
            for key in ("replay_endpoint", "topic", "engine_id"):
                if key in st and not isinstance(st[key], str):
                    raise ConfigError(f"republish_events[{i}].{key}: must be a string")
        return streams
