"""KV events end to end: a service configured with a stream answers MatchPrefix from it."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from kvservice_client import Client  # noqa: E402

from tests.support.engine_schemas import stored, vllm_structs
from tests.support.kv_events import Publisher
from tests.support.poll import eventually


def test_router_sees_prefix_published_by_vllm_events(make_server) -> None:
    """vLLM BlockStored events over ZMQ make MatchPrefix (scores) report the engine's prefix."""
    pub = Publisher()
    streams = [
        {
            "engine_id": "vllm-0",
            "endpoint": f"tcp://127.0.0.1:{pub.port}",
            "page_size": 4,
            "replay_endpoint": f"tcp://127.0.0.1:{pub.rport}",
        }
    ]
    try:
        server = make_server(transport="loopback", kv_events=json.dumps(streams))
        pub.wait_subscriber()
        s = vllm_structs(array_events=True)
        tokens = np.arange(500, 500 + 6 * 4)
        pub.send(
            s["batch"](
                ts=0.0, events=[stored(s, [b"a" * 32, b"b" * 32, b"c" * 32], None, tokens[:12].tolist(), 4)]
            )
        )
        with Client(server.address) as router:
            seen: list[Any] = [None]

            def three_pages() -> Any:
                seen[0] = m = router.match_prefix(tokens=tokens, page_size=4, scores_only=True)
                return m if m.best and m.best.matched_pages == 3 else None

            m = eventually(three_pages, timeout=10, what=lambda: repr(seen[0]), interval=0.02)
            assert m.best.engine_id == "vllm-0" and m.query_pages == 6 and m.best.page_indices == ()
    finally:
        pub.close()
