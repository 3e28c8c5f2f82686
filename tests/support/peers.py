"""Services that authenticate their peers, in process (loopback transport, KVPeer on its own TCP
port, no insecure listener), each with one engine whose random-filled pool is registered."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvservice_client import Client, Layout

from tests.support.pki import CA
from tests.support.pools import fill_random

__all__ = ["DST", "LAYOUT", "SRC", "PeerNode", "mtls_config", "secure_node"]

LAYOUT = Layout.mha(num_layers=2, page_size=4, num_pages=16, total_kv_heads=2, head_dim=8, dtype="float16")
SRC, DST = [3, 1, 4, 5], [9, 2, 6, 7]


@dataclasses.dataclass
class PeerNode:
    """A service and its one engine (client, pool, buffer set)."""

    server: Any
    client: Client
    pool: Any
    bs: str


def secure_node(make_server: Any, make_pool: Any, seed: int, **cfg: Any) -> PeerNode:
    s = make_server(
        transport="loopback",
        same_host_route="off",
        tcp_address="",
        peer_tcp_address="127.0.0.1:0",
        insecure=False,
        **cfg,
    )
    pool = make_pool(LAYOUT)
    fill_random(pool, seed)
    kv = Client(s.address, client_name=f"engine-{seed}", timeout=10)
    return PeerNode(s, kv, pool, kv.register_buffers(LAYOUT, pool.k_regions, pool.v_regions).buffer_set_id)


def mtls_config(ca: CA, name: str) -> dict[str, str]:
    leaf = ca.leaf(name)
    return {"peer_tls_cert": leaf.cert, "peer_tls_key": leaf.key, "peer_tls_ca": ca.cert}
