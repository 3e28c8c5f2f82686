"""Plans offered before the sender asks (data path v3 §3, docs/decisions/0016).

An ExpectDelta naming a sending service whose peer channel is open pushes the declaration's plan
on that channel; the sender's SendDelta then starts writing without a plan round trip, and its
rank binds at its first commit with every check GetReceivePlan makes. The ask stays for every
other case (no channel yet, a rank not offered, an offer dropped by an abort).
"""

from __future__ import annotations

import time
import types

import numpy as np
import pytest
from kvservice_client import Layout

from kvservice.errors import FailedPrecondition, PermissionDenied
from kvservice.staging import StagingPool
from kvservice.transfer.receiver import Incoming, Receiver
from kvservice.transfer.records import Record, TransferTable
from tests.support.pki import CA, mtls_peer
from tests.support.poll import eventually
from tests.support.pools import (
    assert_pages_equal,
    assert_tp_pages,
    assert_unchanged,
    fill_random,
    fill_tp,
    global_kv,
    snapshot,
)
from tests.support.transfers import one

PAGES = 32


def _layout(tp: int = 1, rank: int = 0, heads: int = 4) -> Layout:
    return Layout.mha(
        num_layers=2, page_size=4, num_pages=PAGES, total_kv_heads=heads, head_dim=8, dtype="float16",
        tp_size=tp, tp_rank=rank,
    )  # fmt: skip


def _services(make_server, tmp_path):  # type: ignore[no-untyped-def]
    """A prefill and a decode service over mutual TLS: offers go only to a proven identity."""
    ca = CA(str(tmp_path), "cluster")
    return tuple(
        make_server(transport="loopback", same_host_route="off", **mtls_peer(ca, name))
        for name in ("prefill-a", "decode-b")
    )


def _engine(server, make_pool, make_client, layout: Layout, seed: int):  # type: ignore[no-untyped-def]
    pool = make_pool(layout)
    fill_random(pool, seed)
    kv = make_client(server)
    return kv, pool, kv.register_buffers(layout, pool.k_regions, pool.v_regions).buffer_set_id


def _no_asking(server, monkeypatch) -> list[str]:  # type: ignore[no-untyped-def]
    """Record every plan the sending ``server`` asks for (GetReceivePlan on its channels)."""
    asked: list[str] = []
    from kvservice.transfer.peer_channel import OutboundChannel

    real = OutboundChannel.plans

    async def plans(self, req, timeout):  # type: ignore[no-untyped-def]
        asked.append(req.transfer_id)
        return await real(self, req, timeout)

    monkeypatch.setattr(OutboundChannel, "plans", plans)
    return asked


def _declare_offered(kb, b, sa, sender, peer, tid, dst, prefix=0):  # type: ignore[no-untyped-def]
    """ExpectDelta naming the sender; returns once its offer reached the sender's channel."""
    kb.expect_delta(tid, b, prefix_pages=prefix, dst_page_indices=dst, sender_address=sender)
    chan = sa.app.node.transfers.dispatch.channels[peer]
    eventually(lambda: chan.offers.get(tid) is not None, 5, "the offer reached the sender")
    return chan


def _warm(ka, kb, a, b, sender, peer) -> None:  # type: ignore[no-untyped-def]
    """One transfer that opens the sender's channel (nothing to push on before it)."""
    kb.expect_delta("warm", b, prefix_pages=0, dst_page_indices=[0], sender_address=sender)
    ka.send_delta("warm", a, src_page_indices=[0], peer_address=peer)
    assert one(kb, "warm").state == "DONE"


@pytest.mark.parametrize("path", ["packed", "direct"])
def test_an_offered_plan_needs_no_ask_and_binds_at_the_first_commit(
    make_server, make_pool, make_client, tmp_path, monkeypatch, path
) -> None:
    sa, sb = _services(make_server, tmp_path)
    ka, pa, a = _engine(sa, make_pool, make_client, _layout(), 1)
    kb, pb, b = _engine(sb, make_pool, make_client, _layout(), 2)
    sender, peer = sa.app.peer_address, sb.app.peer_address
    _warm(ka, kb, a, b, sender, peer)
    asked = _no_asking(sa, monkeypatch)
    src, dst = [3, 7, 1, 9, 12], [20, 4, 17, 2, 30]
    before = snapshot(pb)
    _declare_offered(kb, b, sa, sender, peer, "t", dst[1:], prefix=1)
    ka.send_delta("t", a, src_page_indices=src, peer_address=peer, path=path)
    r, s = one(kb, "t"), one(ka, "t")
    assert (r.state, s.state) == ("DONE", "DONE"), (r, s)
    assert asked == []  # no plan round trip
    assert (r.pages_sent, r.pages_skipped) == (4, 1)
    assert_pages_equal(pb, dst[1:], pa, src[1:])
    assert_unchanged(pb, before, except_pages=dst[1:])
    inc = sb.app.node.transfers.receiver.incoming[("t", b)]
    sid = sa.app.node.transfers.service_id
    assert inc.tickets[f"{sid}/0"] == inc.offers[sid].ticket  # bound by the commit, not by an ask


def test_a_same_host_offer_carries_the_pools_and_the_fused_route_needs_no_ask(
    make_server, make_pool, make_client, monkeypatch
) -> None:
    """Two services on one host over their Unix sockets (identity ``local``): the offered plan
    carries the receiver's pool handles, as an asked one does, so the sender copies page to page
    (FUSED) without a plan round trip and binds at its first commit."""
    sa, sb = (make_server(transport="loopback", tcp_address="") for _ in range(2))
    ka, pa, a = _engine(sa, make_pool, make_client, _layout(), 1)
    kb, pb, b = _engine(sb, make_pool, make_client, _layout(), 2)
    sender, peer = sa.app.peer_address, sb.app.peer_address
    assert sender.startswith("unix:") and peer.startswith("unix:")
    _warm(ka, kb, a, b, sender, peer)
    asked = _no_asking(sa, monkeypatch)
    src, dst = [3, 7, 1, 9], [20, 4, 17, 2]
    before = snapshot(pb)
    chan = _declare_offered(kb, b, sa, sender, peer, "t", dst[1:], prefix=1)
    assert all(p.kv_handles for p in chan.offers.get("t").plans.values())
    ka.send_delta("t", a, src_page_indices=src, peer_address=peer)
    r, s = one(kb, "t"), one(ka, "t")
    assert (r.state, s.state, r.path, s.path) == ("DONE", "DONE", "FUSED", "FUSED"), (r, s)
    assert asked == [] and s.route_note == "", s
    assert_pages_equal(pb, dst[1:], pa, src[1:])
    assert_unchanged(pb, before, except_pages=dst[1:])
    inc = sb.app.node.transfers.receiver.incoming[("t", b)]
    sid = sa.app.node.transfers.service_id
    assert inc.tickets[f"{sid}/0"] == inc.offers[sid].ticket


def test_two_sender_ranks_share_one_offer_mixed_tp(
    make_server, make_pool, make_client, tmp_path, monkeypatch
) -> None:
    """TP 2 -> 1: both ranks of the sending service write their heads through the one offer."""
    sa, sb = _services(make_server, tmp_path)
    glob = global_kv(_layout(), 5)
    senders = []
    for rank in (0, 1):
        pool = make_pool(_layout(2, rank))
        fill_tp(pool, glob)
        kv = make_client(sa)
        senders.append((kv, kv.register_buffers(pool.layout, pool.k_regions, pool.v_regions).buffer_set_id))
    kb, pb, b = _engine(sb, make_pool, make_client, _layout(), 2)
    sender, peer = sa.app.peer_address, sb.app.peer_address
    kb.expect_delta("warm", b, prefix_pages=0, dst_page_indices=[0], sender_address=sender)
    for kv, bs in senders:
        kv.send_delta("warm", bs, src_page_indices=[0], peer_address=peer)
    assert one(kb, "warm").state == "DONE"
    asked = _no_asking(sa, monkeypatch)
    src, dst = [3, 7, 1], [20, 4, 17]
    _declare_offered(kb, b, sa, sender, peer, "t", dst)
    for kv, bs in senders:
        kv.send_delta("t", bs, src_page_indices=src, peer_address=peer)
    r = one(kb, "t")
    assert [r.state] + [one(kv, "t").state for kv, _ in senders] == ["DONE"] * 3, r
    assert asked == []
    inc = sb.app.node.transfers.receiver.incoming[("t", b)]
    assert inc.expected_senders == 2 and len(inc.finished) == 2
    assert_tp_pages(pb, dst, glob, src)


def test_a_receiver_abort_drops_the_offer_and_nothing_is_written(
    make_server, make_pool, make_client, tmp_path
) -> None:
    sa, sb = _services(make_server, tmp_path)
    ka, pa, a = _engine(sa, make_pool, make_client, _layout(), 1)
    kb, pb, b = _engine(sb, make_pool, make_client, _layout(), 2)
    sender, peer = sa.app.peer_address, sb.app.peer_address
    _warm(ka, kb, a, b, sender, peer)
    before = snapshot(pb)
    chan = _declare_offered(kb, b, sa, sender, peer, "t", [5, 6])
    kb.abort("t", "decode gave up")
    eventually(lambda: chan.offers.get("t") is None, 5, "the sender dropped the offer")
    ka.send_delta("t", a, src_page_indices=[1, 2], peer_address=peer)
    s = one(ka, "t")
    assert s.state in ("ABORTED", "FAILED") and s.error_code == "ABORTED", s
    assert_unchanged(pb, before)


def test_no_open_channel_means_the_sender_asks(
    make_server, make_pool, make_client, tmp_path, monkeypatch
) -> None:
    sa, sb = _services(make_server, tmp_path)
    ka, pa, a = _engine(sa, make_pool, make_client, _layout(), 1)
    kb, pb, b = _engine(sb, make_pool, make_client, _layout(), 2)
    asked = _no_asking(sa, monkeypatch)
    kb.expect_delta("t", b, prefix_pages=0, dst_page_indices=[5], sender_address=sa.app.peer_address)
    ka.send_delta("t", a, src_page_indices=[1], peer_address=sb.app.peer_address)
    assert one(kb, "t").state == "DONE" and asked == ["t"]
    assert not sb.app.node.transfers.receiver.incoming[("t", b)].offers


# -- the receiver's binding rules, in-process ------------------------------------------------------
def _declared(allowed: frozenset[str] = frozenset({"peer-a"})) -> tuple[Receiver, Incoming]:
    receiver = Receiver(TransferTable(60.0), lambda _bs: StagingPool(1 << 20, "host"))
    bs = types.SimpleNamespace(buffer_set_id="d-bs", layout=_layout())
    rec = Record("t", "RECEIVER", "d-bs", "s", time.monotonic() + 30)
    inc = Incoming(rec, bs, 0, np.arange(4, dtype=np.int64), {}, 0, None, np.arange(0, dtype=np.int64))  # type: ignore[arg-type]
    inc.allowed_senders = allowed
    import asyncio

    asyncio.run(receiver.expect(inc))
    return receiver, inc


def test_an_offer_binds_only_its_ticket_and_identity() -> None:
    receiver, inc = _declared()
    offer = receiver.senders.offer(inc, "prefill", "prefill:1", "peer-a")
    assert offer is not None and receiver.senders.offer(inc, "prefill", "prefill:1", "peer-a") is None  # once
    receiver.senders.bind_offered(inc, _layout(), "prefill/0", "prefill", "peer-a", "not-the-ticket")
    assert "prefill/0" not in inc.tickets  # a wrong ticket binds nothing; check_sender refuses it
    with pytest.raises(PermissionDenied, match="no receive plan"):
        receiver.senders.check_sender(inc, "prefill", "peer-a", "prefill/0", "not-the-ticket")
    with pytest.raises(PermissionDenied, match="offered to another peer"):
        receiver.senders.bind_offered(inc, _layout(), "prefill/0", "prefill", "peer-b", offer.ticket)
    receiver.senders.bind_offered(inc, _layout(2, 1), "prefill/1", "prefill", "peer-a", offer.ticket)
    assert (
        inc.tickets["prefill/1"] == offer.ticket
        and inc.expected_senders == 2
        and inc.senders == {"prefill": "prefill:1"}
    )
    receiver.senders.check_sender(inc, "prefill", "peer-a", "prefill/1", offer.ticket)


def test_an_offered_rank_with_a_layout_that_cannot_write_fails_the_declaration() -> None:
    receiver, inc = _declared()
    offer = receiver.senders.offer(inc, "prefill", "prefill:1", "peer-a")
    assert offer is not None
    bad = Layout.mha(
        num_layers=3, page_size=4, num_pages=PAGES, total_kv_heads=4, head_dim=8, dtype="float16"
    )
    with pytest.raises(FailedPrecondition, match="num_layers"):
        receiver.senders.bind_offered(inc, bad, "prefill/0", "prefill", "peer-a", offer.ticket)
    assert inc.rec.state == "FAILED"


def test_offers_go_only_to_a_proven_identity_the_declaration_names() -> None:
    """A channel's service id and address are its own claims: a declaration naming identities
    offers only to one of them; one naming none (peers by token: none can be proven) offers to
    the token peer claiming the sender's address, never to a peer of another proven identity."""
    receiver, inc = _declared(frozenset({"prefill-a"}))
    assert receiver.senders.offer(inc, "prefill", "prefill:1", "prefill-c") is None
    assert receiver.senders.offer(inc, "prefill", "prefill:1", "") is None
    assert receiver.senders.offer(inc, "prefill", "prefill:1", "prefill-a") is not None
    receiver, inc = _declared(frozenset())
    assert receiver.senders.offer(inc, "prefill", "prefill:1", "prefill-c") is None
    assert receiver.senders.offer(inc, "prefill", "prefill:1", "") is not None


def test_a_channel_claiming_the_address_under_another_identity_gets_no_offer() -> None:
    from kvservice.transfer.peer_channel import OfferChannels

    chans = OfferChannels()
    real = types.SimpleNamespace(address="prefill:1", identity="prefill-a")
    rogue = types.SimpleNamespace(address="prefill:1", identity="intruder")
    chans.opened(real)  # type: ignore[arg-type]
    chans.opened(rogue)  # type: ignore[arg-type]
    assert chans.get("prefill:1", frozenset({"prefill-a", "local"})) is real
    chans.closed(real)  # type: ignore[arg-type]
    assert chans.get("prefill:1", frozenset({"prefill-a", "local"})) is None
    token = types.SimpleNamespace(address="prefill:1", identity="")  # a token peer proves no name
    chans.opened(token)  # type: ignore[arg-type]
    assert chans.get("prefill:1", frozenset({"prefill-a", "local"})) is None
    assert chans.get("prefill:1", frozenset()) is token  # a declaration naming no identity
