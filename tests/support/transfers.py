"""Transfers in tests: two engines linked across a service pair, statuses until terminal, exactly
one record, the route of a pair, staging left idle."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvservice_client import Client, Layout, ShmKVPool, TransferStatus

from tests.support.poll import eventually
from tests.support.pools import fill_random

__all__ = ["LAYOUT", "TERMINAL", "Link", "fused_pair", "link", "one", "staging_idle", "wait_all"]

TERMINAL = ("DONE", "FAILED", "ABORTED")
LAYOUT = Layout.mha(num_layers=2, page_size=4, num_pages=48, total_kv_heads=2, head_dim=8, dtype="float16")


def fused_pair(pair: tuple[Any, Any]) -> bool:
    """Whether transfers between the pair's services take the fused route (see conftest.pair)."""
    return pair[0] is pair[1] or pair[0].app.node.config.transfer.same_host_route == "auto"


def wait_all(client: Client, tid: str, n: int = 1, timeout: float = 10.0) -> list[TransferStatus]:
    """Poll until ``n`` records of ``tid`` on this client are terminal (bounded)."""
    last: list[TransferStatus] = []

    def terminal() -> tuple[list[TransferStatus]] | None:  # a tuple: an empty list is an answer (n=0)
        last[:] = sts = client.poll([tid])
        return (sts,) if len(sts) >= n and all(s.terminal for s in sts) else None

    return list(eventually(terminal, timeout, lambda: f"{tid}: terminal (last: {last})")[0])


def one(client: Client, tid: str, timeout: float = 10.0) -> TransferStatus:
    sts = wait_all(client, tid, 1, timeout)
    assert len(sts) == 1, sts
    return sts[0]


@dataclasses.dataclass
class Link:
    """Two engines, one on each service of a pair, their pools registered."""

    ka: Client  # sender engine's client (prefill node)
    kb: Client  # receiver engine's client (decode node)
    pa: ShmKVPool
    pb: ShmKVPool
    a: str  # sender buffer set
    b: str  # receiver buffer set
    peer: str  # receiver service's peer address


def link(pair: Any, make_pool: Any, make_client: Any, layout: Layout = LAYOUT, aux: Any = None) -> Link:
    sa, sb = pair
    pa, pb = make_pool(layout, aux), make_pool(layout, aux)
    fill_random(pa, 1)
    fill_random(pb, 2)  # random, not zero: a stray write is visible
    ka, kb = make_client(sa), make_client(sb)
    a = ka.register_buffers(layout, pa.k_regions, pa.v_regions, pa.aux_specs).buffer_set_id
    b = kb.register_buffers(layout, pb.k_regions, pb.v_regions, pb.aux_specs).buffer_set_id
    return Link(ka, kb, pa, pb, a, b, sb.app.peer_address)


def staging_idle(server: Any) -> bool:
    """No staging slot of the in-process ``server`` is in use."""
    return all(st.slots_in_use == 0 for st in server.app.node.transfers.memory.staging_stats())
