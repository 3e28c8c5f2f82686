"""A live node with transfers running, for the CLI tests and for trying ``kvservice top`` by hand.

    python tests/cli/live_load.py ADDRESS_FILE [SECONDS]

Starts two in-process services (A and B, loopback transport) and keeps transfers going: A -> B
(a peer, over the transport) and A -> A (one service, the fused route), a few per second. A's
address goes into ADDRESS_FILE once everything runs; it stops after SECONDS (default 600) or
when the file is deleted.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from kvservice_client import Client, Layout, ShmKVPool  # noqa: E402

from tests.support.services import ServerThread, make_config

LAYOUT = Layout.mha(num_layers=2, page_size=4, num_pages=64, total_kv_heads=2, head_dim=8, dtype="float16")


def main(address_file: str, seconds: float = 600.0) -> int:
    a = ServerThread(make_config(transport="loopback"))
    b = ServerThread(make_config(transport="loopback"))
    end = time.monotonic() + seconds
    try:
        with (
            ShmKVPool.create(LAYOUT) as p_src,
            ShmKVPool.create(LAYOUT) as p_dst,
            ShmKVPool.create(LAYOUT) as p_local,
            Client(a.address, client_name="prefill-0") as ka,
            Client(a.address, client_name="decode-l") as kl,
            Client(b.address, client_name="decode-0") as kb,
        ):
            src = ka.register_buffers(LAYOUT, p_src.k_regions, p_src.v_regions, engine_id="prefill-0")
            local = kl.register_buffers(LAYOUT, p_local.k_regions, p_local.v_regions, engine_id="decode-l")
            dst = kb.register_buffers(LAYOUT, p_dst.k_regions, p_dst.v_regions, engine_id="decode-0")
            with open(address_file + ".tmp", "w") as f:
                f.write(a.address)
            os.replace(address_file + ".tmp", address_file)
            i = 0
            while time.monotonic() < end and os.path.exists(address_file):
                pages = list(np.arange(8) + (i % 7) * 8)
                for name, kv, bs, peer in (
                    (f"peer-{i}", kb, dst.buffer_set_id, b.app.peer_address),
                    (f"local-{i}", kl, local.buffer_set_id, a.app.peer_address),
                ):
                    kv.expect_delta(name, bs, prefix_pages=0, dst_page_indices=pages, deadline_ms=10_000)
                    ka.send_delta(name, src.buffer_set_id, src_page_indices=pages, peer_address=peer)
                    kv.wait(name, timeout=10)
                i += 1
                time.sleep(0.1)
    finally:
        a.stop()
        b.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 600.0))
