"""Engines beside one or two services (the robustness tests): shm pools filled with random
bytes, a client and a buffer set each, and what changed in a pool."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from kvservice_client import Client, Layout, ShmKVPool

from tests.support.lane import lane_of
from tests.support.poll import eventually

LAYOUT = Layout.mha(num_layers=2, page_size=4, num_pages=32, total_kv_heads=2, head_dim=8, dtype="float16")


def regions(pool: ShmKVPool, layout: Layout = LAYOUT) -> list[np.ndarray]:
    """Every KV region of ``pool`` as ``[num_pages, page_bytes]`` uint8 (K layers, then V)."""
    return [pool.k(i) for i in range(layout.num_layers)] + [pool.v(i) for i in range(layout.num_v_regions)]


class Engine:
    """One engine rank: a pool of random bytes registered with the service at ``address``."""

    def __init__(self, address: str, name: str, seed: int, layout: Layout = LAYOUT, **pool_kw: Any) -> None:
        self.layout = layout
        self.pool = ShmKVPool.create(layout, **pool_kw)
        rng = np.random.default_rng(seed)
        self.aux_names = list(pool_kw.get("aux") or {})
        for r in regions(self.pool, layout) + [self.pool.aux(n) for n in self.aux_names]:
            r[:] = rng.integers(0, 256, r.shape, dtype=np.uint8)
        self.kv = Client(address, client_name=name)
        self.bs = self.kv.register_buffers(
            layout, self.pool.k_regions, self.pool.v_regions, aux=self.pool.aux_specs
        ).buffer_set_id
        self.truncated = False

    def pages(self, pages: list[int]) -> list[bytes]:
        return [r[p].tobytes() for r in regions(self.pool, self.layout) for p in pages]

    def rows(self, name: str, rows: list[int]) -> bytes:
        return self.pool.aux(name)[rows].tobytes()

    def snapshot(self) -> list[np.ndarray]:
        return [r.copy() for r in regions(self.pool, self.layout)]

    def changed(self, before: list[np.ndarray]) -> set[int]:
        got: set[int] = set()
        for old, now in zip(before, regions(self.pool, self.layout), strict=True):
            got |= set(np.flatnonzero((old != now).any(axis=1)).tolist())
        return got

    def truncate(self, size: int = 0) -> None:
        """Shrink this engine's segment under the service, as its owner may. NOTE: this process
        must not touch the pool's memory afterwards (it would fault here, unguarded)."""
        fd = os.open("/dev/shm/" + self.pool.name.lstrip("/"), os.O_RDWR)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        self.truncated = True

    def close(self) -> None:
        self.kv.close()
        self.pool.close()  # unmaps and unlinks without touching the memory


class Node:
    """One service and three engines: a sender, a receiver and a bystander pair's receiver."""

    def __init__(self, server: Any, lane: bool) -> None:
        self.server = server
        if lane:
            lane_of(server)
        self.a = Engine(server.address, "prefill", 1)
        self.b = Engine(server.address, "decode", 2)
        self.c = Engine(server.address, "bystander", 3)
        self.peer = server.app.peer_address

    def move(self, tid: str, src: list[int], dst: list[int], into: Engine | None = None) -> tuple[Any, Any]:
        into = into or self.b
        into.kv.expect_delta(tid, into.bs, prefix_pages=0, dst_page_indices=dst)
        self.a.kv.send_delta(tid, self.a.bs, src_page_indices=src, peer_address=self.peer)
        (r,) = into.kv.wait(tid, timeout=20)
        (s,) = self.a.kv.wait(tid, timeout=20)
        return r, s

    def close(self) -> None:
        for e in (self.a, self.b, self.c):
            e.close()


class Nodes:
    """A prefill service (A) and a decode service (B) on NIXL that do not map each other's
    pools. Peers by ``auth``: "mtls" (each proves its certificate's name), "token" (a shared
    peer token: membership, no identity) or "insecure" (nothing). ``layouts``: the prefill
    engine's and the decode engines' (both LAYOUT by default); ``server``: more service options."""

    def __init__(
        self,
        make_server: Any,
        tmp: str,
        cross_lane: bool,
        auth: str = "mtls",
        aux: dict[str, tuple[int, int]] | None = None,
        layouts: tuple[Layout, Layout] = (LAYOUT, LAYOUT),
        **server: Any,
    ) -> None:
        kw: dict[str, Any] = {
            "transport": "nixl",
            "same_host_route": "off",
            "transfer_integrity": False,
            **server,
        }
        if not cross_lane:
            kw["lane_cross_mb"] = 0
        peer = {"tcp_address": "", "peer_tcp_address": "127.0.0.1:0"}
        if auth == "mtls":
            from tests.support.pki import CA, mtls_peer  # (cryptography: not on every GPU host)

            ca = CA(tmp, "cluster")
            auths = [mtls_peer(ca, name) for name in ("prefill-a", "decode-b")]
        elif auth == "token":
            token = os.path.join(tmp, "peer-token")
            with open(token, "w") as f:
                f.write("cluster-secret\n")
            auths = [{**peer, "insecure": False, "peer_token_file": token}] * 2
        else:
            auths = [{**peer, "insecure": True}] * 2
        self.sa, self.sb = (make_server(**kw, **a) for a in auths)
        lane_of(self.sa), lane_of(self.sb)
        self.a = Engine(self.sa.address, "prefill", 1, layouts[0], aux=aux)
        self.b = Engine(self.sb.address, "decode", 2, layouts[1], aux=aux)
        self.c = Engine(self.sb.address, "bystander", 3, layouts[1], aux=aux)
        self.peer = self.sb.app.peer_address

    def move(self, tid: str, src: list[int], dst: list[int], into: Engine | None = None) -> tuple[Any, Any]:
        into = into or self.b
        into.kv.expect_delta(
            tid, into.bs, prefix_pages=0, dst_page_indices=dst, sender_address=self.sa.app.peer_address
        )
        self.a.kv.send_delta(tid, self.a.bs, src_page_indices=src, peer_address=self.peer)
        (r,) = into.kv.wait(tid, timeout=30)
        (s,) = self.a.kv.wait(tid, timeout=30)
        return r, s

    def close(self) -> None:
        for e in (self.a, self.b, self.c):
            e.close()


class Converting:
    """The Nodes of one test whose two services' pools differ in layout (conversions across
    services), each made with A's channel to B open (a first transfer over gRPC: offers travel on
    it); closed with it."""

    def __init__(self, make_server: Any, tmp: str, aux: dict[str, tuple[int, int]] | None = None) -> None:
        self.make_server, self.tmp, self.aux = make_server, tmp, aux
        self.made: list[Nodes] = []

    def __call__(self, src: Layout, dst: Layout, **kw: Any) -> Nodes:
        n = Nodes(self.make_server, self.tmp, cross_lane=True, aux=self.aux, layouts=(src, dst), **kw)
        self.made.append(n)
        n.b.kv.expect_delta(
            "warm", n.b.bs, prefix_pages=0, dst_page_indices=[0], sender_address=n.sa.app.peer_address
        )
        n.a.kv.send_delta("warm", n.a.bs, src_page_indices=[0], peer_address=n.peer)
        assert n.b.kv.wait("warm", timeout=30)[0].state == "DONE"
        return n

    def close(self) -> None:
        for n in self.made:
            n.close()


def expect_offered(n: Nodes, tid: str, dst: list[int], prefix: int, **kw: Any) -> None:
    """The decode engine declares ``tid`` from A; until A's lane holds the offer."""
    n.b.kv.expect_delta(
        tid, n.b.bs, prefix_pages=prefix, dst_page_indices=dst, sender_address=n.sa.app.peer_address, **kw
    )
    eventually(lambda: n.sa.app.lane.result().book.cross.tx.holds_offer(tid), 10, f"offer of {tid}")


def send_chunks(n: Nodes, tid: str, src: list[int], cuts: list[int], start: int = 0, aux: Any = None) -> None:
    """The prefill engine sends ``src`` (from transfer page ``start``) cut at ``cuts``, ``aux``
    rows on the last chunk."""
    bounds = [0, *cuts, len(src)]
    for i in range(len(bounds) - 1):
        last = i == len(bounds) - 2
        n.a.kv.send_delta(
            tid,
            n.a.bs,
            src_page_indices=src[bounds[i] : bounds[i + 1]],
            chunk_offset=start + bounds[i],
            last_chunk=last,
            aux=aux if last else None,
            peer_address=n.peer,
        )


__all__ = [
    "LAYOUT",
    "Converting",
    "Engine",
    "Node",
    "Nodes",
    "eventually",
    "expect_offered",
    "lane_of",
    "regions",
    "send_chunks",
]
