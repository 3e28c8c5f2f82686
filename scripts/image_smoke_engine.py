"""One real transfer through a (containerised) kvservice, run by scripts/image-smoke.sh.

    python image_smoke_engine.py ENGINE_ADDRESS [PEER_ADDRESS] [--expect-lane]

Two engine pools in POSIX shared memory, registered with the service at ``argv[1]``; pages move
from one to the other (ExpectDelta + SendDelta to the service's own peer address) and every
destination page is compared byte for byte, every other page must stay zero. With
``--expect-lane`` the SendDelta must have gone over the service's native lane (a same-node
transfer, ``Client.lane_sent``), not gRPC. Exit 0 on success.
"""

from __future__ import annotations

import sys

import numpy as np
from kvservice_client import Client, Layout, ShmKVPool

LAYOUT = Layout.mha(num_layers=4, page_size=16, num_pages=64, total_kv_heads=4, head_dim=64, dtype="float16")


def main(address: str, peer_address: str, expect_lane: bool = False) -> int:
    with ShmKVPool.create(LAYOUT) as src, ShmKVPool.create(LAYOUT) as dst, Client(address) as kv:
        rng = np.random.default_rng(0)
        for layer in range(LAYOUT.num_layers):  # views are [num_pages, page_bytes] uint8
            src.k(layer)[:] = rng.integers(0, 256, src.k(layer).shape, dtype=np.uint8)
            src.v(layer)[:] = rng.integers(0, 256, src.v(layer).shape, dtype=np.uint8)
        a = kv.register_buffers(LAYOUT, src.k_regions, src.v_regions, engine_id="smoke-prefill")
        b = kv.register_buffers(LAYOUT, dst.k_regions, dst.v_regions, engine_id="smoke-decode")
        src_pages, dst_pages = np.arange(8, 24), np.arange(40, 56)
        kv.expect_delta("smoke-1", b.buffer_set_id, prefix_pages=0, dst_page_indices=dst_pages)
        # The receiver is on the same service: its address as the service itself sees it.
        kv.send_delta("smoke-1", a.buffer_set_id, src_page_indices=src_pages, peer_address=peer_address)
        states = {s.role: s.state for s in kv.wait("smoke-1", timeout=60)}
        if set(states.values()) != {"DONE"}:
            print(f"transfer did not finish: {states}", file=sys.stderr)
            return 1
        others = np.setdiff1d(np.arange(LAYOUT.num_pages), dst_pages)
        for layer in range(LAYOUT.num_layers):
            for want, got in ((src.k(layer), dst.k(layer)), (src.v(layer), dst.v(layer))):
                if not np.array_equal(got[dst_pages], want[src_pages]) or got[others].any():
                    print(f"layer {layer}: bytes differ", file=sys.stderr)
                    return 1
        via = f"native lane ({kv.lane_sent} sent)" if kv.lane_sent else "gRPC"
        pages = f"{src_pages.size} pages x {LAYOUT.num_layers} layers"
        print(f"transfer: {pages} verified byte for byte, via {via}")
        if expect_lane and not kv.lane_sent:
            print("transfer did not go over the native lane", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    flags = {a for a in sys.argv[1:] if a.startswith("--")}
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    sys.exit(main(args[0], args[1] if len(args) > 1 else args[0], "--expect-lane" in flags))
