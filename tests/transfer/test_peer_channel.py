"""The peer channel (data path v2): packed batches go into credit slots the receiver granted once,
commits and acks ride one stream — no ReserveStaging or CommitChunk call per batch — and a broken
channel fails its transfers with a reason while every slot comes back.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from kvservice_client import Layout

from tests.support.poll import eventually
from tests.support.pools import assert_pages_equal, assert_unchanged, fill_random, snapshot
from tests.support.transfers import one, staging_idle

LAYOUT = Layout.mha(num_layers=2, page_size=16, num_pages=256, total_kv_heads=4, head_dim=64, dtype="float16")
N = 200  # pages: 32 KiB each over all regions; credit slots of 128 KiB hold 4 -> 50 batches


def _services(make_server, n_senders: int = 1):  # type: ignore[no-untyped-def]
    kw = {"transport": "loopback", "same_host_route": "off", "host_staging_mb": 1}
    return [make_server(**kw) for _ in range(n_senders)], make_server(**kw)


def _no_reservations(server, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    async def refuse(*a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError("ReserveStaging was called: packed batches must use channel credits")

    monkeypatch.setattr(server.app.node.transfers.receiver, "reserve", refuse)


def _slow_unpacks(server, monkeypatch, delay: float, jitter: float = 0.0) -> None:  # type: ignore[no-untyped-def]
    """Every receiver-side unpack waits ``delay`` (+ up to ``jitter``, random: batches then finish
    out of order) before it runs."""
    inbound = server.app.node.transfers.inbound
    real = inbound._unpack
    rng = np.random.default_rng(7)

    async def slow(*a, **k):  # type: ignore[no-untyped-def]
        await asyncio.sleep(delay + jitter * rng.random())
        return await real(*a, **k)

    monkeypatch.setattr(inbound, "_unpack", slow)


def _send(ka, kb, a, b, peer, tid, src, dst, deadline_ms=20_000):  # type: ignore[no-untyped-def]
    kb.expect_delta(tid, b, prefix_pages=0, dst_page_indices=dst, deadline_ms=deadline_ms)
    ka.send_delta(tid, a, src_page_indices=src, peer_address=peer, path="packed", deadline_ms=deadline_ms)


def _register(server, make_pool, make_client, seed):  # type: ignore[no-untyped-def]
    pool = make_pool(LAYOUT)
    fill_random(pool, seed)
    kv = make_client(server)
    return kv, pool, kv.register_buffers(LAYOUT, pool.k_regions, pool.v_regions).buffer_set_id


def test_packed_batches_use_credits_and_one_stream(make_server, make_pool, make_client, monkeypatch) -> None:
    (sa,), sb = _services(make_server)
    _no_reservations(sb, monkeypatch)
    _slow_unpacks(sb, monkeypatch, 0.005)  # a slow receiver: the sender waits for credits, never deadlocks
    ka, pa, a = _register(sa, make_pool, make_client, 1)
    kb, pb, b = _register(sb, make_pool, make_client, 2)
    rng = np.random.default_rng(0)
    src, dst = rng.permutation(256)[:N].tolist(), rng.permutation(256)[:N].tolist()
    before = snapshot(pb)
    _send(ka, kb, a, b, sb.app.peer_address, "cr", src, dst)
    r, s = one(kb, "cr", timeout=30), one(ka, "cr", timeout=30)
    assert (r.state, s.state, s.path) == ("DONE", "DONE", "PACKED"), (r, s)
    assert s.descriptors >= N // 4, s  # many batches went through the window of credits
    assert_pages_equal(pb, dst, pa, src)
    assert_unchanged(pb, before, except_pages=dst)
    chan = sa.app.node.transfers.dispatch.channels[sb.app.peer_address]
    assert chan.epoch == 1  # one stream for the whole transfer
    eventually(lambda: len(chan._credits[("DRAM", 0)]) == chan._granted[("DRAM", 0)], 3, "every credit back")


def test_batches_completing_out_of_order_land_byte_exact(
    make_server, make_pool, make_client, monkeypatch
) -> None:
    """Unpacks of a transfer's batches finish in random order (each waits 0-20 ms): the receiver
    still reports DONE only when every page landed, byte-exact, and every credit comes back."""
    (sa,), sb = _services(make_server)
    _no_reservations(sb, monkeypatch)
    _slow_unpacks(sb, monkeypatch, 0.0, jitter=0.02)
    started: list[int] = []
    finished: list[int] = []
    inbound = sb.app.node.transfers.inbound
    inner = inbound._unpack

    async def record(inc, sender, held, commit, *a, **k):  # type: ignore[no-untyped-def]
        started.append(int(commit.positions[0]))
        out = await inner(inc, sender, held, commit, *a, **k)
        finished.append(int(commit.positions[0]))
        return out

    monkeypatch.setattr(inbound, "_unpack", record)
    ka, pa, a = _register(sa, make_pool, make_client, 3)
    kb, pb, b = _register(sb, make_pool, make_client, 4)
    rng = np.random.default_rng(1)
    src, dst = rng.permutation(256)[:N].tolist(), rng.permutation(256)[:N].tolist()
    before = snapshot(pb)
    _send(ka, kb, a, b, sb.app.peer_address, "ooo", src, dst)
    r, s = one(kb, "ooo", timeout=30), one(ka, "ooo", timeout=30)
    assert (r.state, s.state) == ("DONE", "DONE"), (r, s)
    assert sorted(finished) == sorted(started) and len(started) >= 10, "every batch unpacked once"
    assert finished != started, "batches completed out of order"
    assert_pages_equal(pb, dst, pa, src)
    assert_unchanged(pb, before, except_pages=dst)
    chan = sa.app.node.transfers.dispatch.channels[sb.app.peer_address]
    eventually(lambda: len(chan._credits[("DRAM", 0)]) == chan._granted[("DRAM", 0)], 3, "every credit back")


def test_many_senders_share_one_receiver(make_server, make_pool, make_client, monkeypatch) -> None:
    """Three sending services, one receiver whose pool holds fewer credit windows than senders:
    every transfer completes (credits rotate), byte-exact."""
    senders, sb = _services(make_server, 3)
    _slow_unpacks(sb, monkeypatch, 0.002)
    kb, pb, b = _register(sb, make_pool, make_client, 9)
    sent = []
    for i, sa in enumerate(senders):
        ka, pa, a = _register(sa, make_pool, make_client, 10 + i)
        src = list(range(i * 60, i * 60 + 60))
        dst = list(range(i * 80, i * 80 + 60))
        _send(ka, kb, a, b, sb.app.peer_address, f"m{i}", src, dst)
        sent.append((ka, pa, src, dst, f"m{i}"))
    for ka, pa, src, dst, tid in sent:
        assert one(ka, tid, timeout=30).state == "DONE"
        assert one(kb, tid, timeout=30).state == "DONE"
        assert_pages_equal(pb, dst, pa, src)
    # the channels went idle: their credits go back and the receiver's pool empties
    eventually(lambda: staging_idle(sb), 5, "idle channels returned their credits")


def test_broken_channel_fails_transfers_and_frees_every_slot(
    make_server, make_pool, make_client, monkeypatch
) -> None:
    """The stream breaks mid-transfer: the sender fails with the reason well before its deadline,
    the receiver too (told by the sender), the receiver's channel slots and both sides' staging come
    back; the next transfer opens a new channel and succeeds."""
    (sa,), sb = _services(make_server)
    _slow_unpacks(sb, monkeypatch, 0.02)
    ka, pa, a = _register(sa, make_pool, make_client, 3)
    kb, pb, b = _register(sb, make_pool, make_client, 4)
    _send(ka, kb, a, b, sb.app.peer_address, "brk", list(range(N)), list(range(N)), deadline_ms=15_000)
    dispatch = sa.app.node.transfers.dispatch
    eventually(lambda: ka.poll(["brk"])[0].bytes_sent > 0, 5, "batches moving")
    chan = dispatch.channels[sb.app.peer_address]
    sa.call(_cancel(chan))
    s = one(ka, "brk", timeout=5)
    assert s.state == "FAILED" and s.error_code == "UNAVAILABLE" and "channel" in s.error, s
    r = one(kb, "brk", timeout=5)
    assert r.state in ("FAILED", "ABORTED") and r.error, r
    eventually(lambda: staging_idle(sa), 5, "sender's staging released")
    eventually(
        lambda: staging_idle(sb),
        5,
        f"receiver's slots released {sb.app.node.transfers.memory.staging_stats()}",
    )
    _send(ka, kb, a, b, sb.app.peer_address, "again", [1, 2, 3], [7, 8, 9])
    assert one(ka, "again", timeout=10).state == "DONE"
    assert chan.epoch == 2
    assert_pages_equal(pb, [7, 8, 9], pa, [1, 2, 3])


async def _cancel(chan) -> None:  # type: ignore[no-untyped-def]
    chan._call.cancel()


@pytest.mark.parametrize("side", ["receiver", "sender"])
def test_abort_racing_credit_writes_lands_nothing_after_the_ack(
    make_server, make_pool, make_client, monkeypatch, side
) -> None:
    (sa,), sb = _services(make_server)
    _slow_unpacks(sb, monkeypatch, 0.01)
    ka, pa, a = _register(sa, make_pool, make_client, 5)
    kb, pb, b = _register(sb, make_pool, make_client, 6)
    _send(ka, kb, a, b, sb.app.peer_address, "ab", list(range(N)), list(range(N)))
    eventually(lambda: kb.poll(["ab"])[0].pages_sent > 0, 5, "pages landing")
    me = kb if side == "receiver" else ka
    me.abort("ab", reason="gave up")
    at_ack = snapshot(pb)
    assert one(ka, "ab", timeout=5).state == "ABORTED"
    assert one(kb, "ab", timeout=5).state == "ABORTED"
    import time

    time.sleep(0.3)
    assert_unchanged(pb, at_ack)
    eventually(lambda: staging_idle(sa), 5, "sender staging released")
