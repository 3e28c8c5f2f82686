"""Sessions survive idle periods and transport loss; past the grace period they are lost, loudly.

Short keepalive settings make "several keepalive intervals" take seconds; one soak test (marked
slow) idles for two minutes with every default, over the UDS and over TCP.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from kvservice_client import AsyncClient, Client, KeepalivePolicy, Layout, SessionLost, ShmKVPool

from tests.support.poll import eventually
from tests.support.tcp_proxy import TcpProxy

LAYOUT = Layout.mha(num_layers=2, page_size=4, num_pages=8, total_kv_heads=2, head_dim=8, dtype="float16")
# Client pings every 200 ms; the server (configured to match) accepts pings every 100 ms.
FAST = KeepalivePolicy(time_ms=200, timeout_ms=2_000, server_time_ms=200, min_recv_ping_interval_ms=100)
FAST_SERVER = dict(keepalive_time_ms=200, keepalive_timeout_ms=2_000, keepalive_min_ping_interval_ms=100)


@pytest.fixture
def pool():
    with ShmKVPool.create(LAYOUT) as p:
        yield p


def _cred(server) -> str:
    """The service's credential socket: TCP clients on this host prove their uid through it."""
    return server.app.uds_path + ".cred"


def _buffer_sets(server) -> set[str]:
    return {b.buffer_set_id for b in server.node.buffers.all()}


def test_idle_client_keeps_its_session_through_many_keepalive_intervals(make_server, pool) -> None:
    """15+ keepalive pings on an idle connection: no GOAWAY, no resume, the registration stays."""
    server = make_server(**FAST_SERVER)
    for address in (server.address, f"127.0.0.1:{server.app.tcp_port}"):
        with Client(address, keepalive=FAST, credential_path=_cred(server)) as kv:
            bs = kv.register_buffers(LAYOUT, pool.k_regions, pool.v_regions)
            time.sleep(3.0)
            assert bs.buffer_set_id in _buffer_sets(server)
            assert kv.publish_pages(bs.buffer_set_id, [0], tokens=np.arange(4)) == 1
            assert kv.session_resumes == 0


def test_pings_faster_than_the_server_allows_are_cut_but_the_session_resumes(make_server, pool) -> None:
    """A real GOAWAY (too_many_pings) breaks the stream; the session is resumed, nothing released."""
    server = make_server(session_grace_s=5.0)  # default ping policy: at most one ping per 5 s
    greedy = KeepalivePolicy(time_ms=200, min_recv_ping_interval_ms=100)
    with Client(f"127.0.0.1:{server.app.tcp_port}", keepalive=greedy, credential_path=_cred(server)) as kv:
        bs = kv.register_buffers(LAYOUT, pool.k_regions, pool.v_regions)
        sid = kv.session_id
        eventually(lambda: kv.session_resumes >= 1, 15)
        assert kv.session_id == sid
        assert kv.publish_pages(bs.buffer_set_id, [1], tokens=np.arange(4)) == 1
        assert bs.buffer_set_id in _buffer_sets(server)
    assert server.node.sessions.resumes >= 1


def test_cut_connection_resumes_the_same_session_within_the_grace_period(make_server, pool) -> None:
    """A reset TCP connection detaches the session; the client resumes it and keeps its buffer set."""
    server = make_server(session_grace_s=5.0, **FAST_SERVER)
    proxy = TcpProxy(f"127.0.0.1:{server.app.tcp_port}")
    try:
        with Client(proxy.address, credential_path=_cred(server), keepalive=FAST) as kv:
            bs = kv.register_buffers(LAYOUT, pool.k_regions, pool.v_regions)
            sid = kv.session_id
            proxy.cut()
            eventually(lambda: kv.session_resumes == 1)
            assert kv.session_id == sid
            assert kv.publish_pages(bs.buffer_set_id, [2], tokens=np.arange(4)) == 1
            assert _buffer_sets(server) == {bs.buffer_set_id}
            assert server.node.sessions.resumes == 1 and not server.node.sessions.lost
        eventually(lambda: not _buffer_sets(server), 2)  # close() releases at once
    finally:
        proxy.close()


def test_calls_made_while_disconnected_wait_for_the_resume(make_server, pool) -> None:
    """A call issued while the service is unreachable completes once the connection is back."""
    server = make_server(session_grace_s=5.0, **FAST_SERVER)
    proxy = TcpProxy(f"127.0.0.1:{server.app.tcp_port}")
    try:
        with Client(proxy.address, credential_path=_cred(server), keepalive=FAST, timeout=10) as kv:
            bs = kv.register_buffers(LAYOUT, pool.k_regions, pool.v_regions)
            proxy.cut(refuse=True)
            threading.Timer(1.0, proxy.allow).start()
            t0 = time.monotonic()
            assert kv.publish_pages(bs.buffer_set_id, [3], tokens=np.arange(4)) == 1
            assert 0.5 < time.monotonic() - t0 < 8
            assert bs.buffer_set_id in _buffer_sets(server)
    finally:
        proxy.close()


def test_past_the_grace_period_the_session_is_lost_and_named(make_server, pool) -> None:
    """Unreachable for longer than the grace: the service releases everything; SessionLost names it."""
    server = make_server(session_grace_s=1.0, **FAST_SERVER)
    proxy = TcpProxy(f"127.0.0.1:{server.app.tcp_port}")
    lost: list[SessionLost] = []
    try:
        kv = Client(
            proxy.address,
            credential_path=_cred(server),
            keepalive=FAST,
            timeout=10,
            on_session_lost=lost.append,
        )
        bs = kv.register_buffers(LAYOUT, pool.k_regions, pool.v_regions)
        kv.publish_pages(bs.buffer_set_id, [0, 1], tokens=np.arange(8))
        m = kv.match_prefix(tokens=np.arange(8), page_size=4, lease_ttl_ms=60_000)
        kv.expect_delta("t-lost", bs.buffer_set_id, prefix_pages=0, dst_page_indices=[5], deadline_ms=60_000)
        sid = kv.session_id
        proxy.cut(refuse=True)
        eventually(lambda: not _buffer_sets(server), 5)  # released by the service at grace expiry
        assert server.node.sessions.lost["grace_expired"] == 1
        eventually(lambda: bool(lost), 5)
        proxy.allow()
        with pytest.raises(SessionLost) as info:
            kv.publish_pages(bs.buffer_set_id, [2], tokens=np.arange(12))
        err = info.value
        assert err is lost[0] and err.session_id == sid
        assert err.buffer_set_ids == (bs.buffer_set_id,)
        assert err.lease_ids == (m.lease_id,) and err.transfer_ids == ("t-lost",)
        assert "grace" in err.reason and bs.buffer_set_id in str(err)
        again = kv.reopen_session(reregister=True)
        assert set(again) == {bs.buffer_set_id} and kv.session_id != sid
        assert _buffer_sets(server) == {again[bs.buffer_set_id].buffer_set_id}
        kv.close()
        eventually(lambda: not _buffer_sets(server), 2)
    finally:
        proxy.close()


def test_a_call_refused_because_the_session_was_released_raises_session_lost(make_server, pool) -> None:
    """When the service already released the session, the next owned call says so as SessionLost."""
    server = make_server(session_grace_s=5.0)
    with Client(server.address) as kv:
        bs = kv.register_buffers(LAYOUT, pool.k_regions, pool.v_regions)
        server.call(server.node.close_session(kv.session_id, "operator"))
        with pytest.raises(SessionLost, match="operator") as info:
            kv.unregister_buffers(bs.buffer_set_id)
        assert info.value.buffer_set_ids == (bs.buffer_set_id,)


def test_async_client_resumes_and_reports_loss(make_server, pool) -> None:
    """The asyncio client resumes a cut connection, and past the grace raises SessionLost."""
    server = make_server(session_grace_s=1.0, **FAST_SERVER)
    proxy = TcpProxy(f"127.0.0.1:{server.app.tcp_port}")

    async def main() -> None:
        async with AsyncClient(
            proxy.address,
            credential_path=_cred(server),
            keepalive=FAST,
            timeout=10,
        ) as kv:
            bs = await kv.register_buffers(LAYOUT, pool.k_regions, pool.v_regions)
            sid = await kv.session_id()
            await asyncio.sleep(1.0)  # idle through several pings
            proxy.cut()
            for _ in range(250):
                if kv.session_resumes:
                    break
                await asyncio.sleep(0.02)
            assert kv.session_resumes == 1 and await kv.session_id() == sid
            assert await kv.publish_pages(bs.buffer_set_id, [0], tokens=np.arange(4)) == 1
            proxy.cut(refuse=True)
            await asyncio.sleep(2.5)
            proxy.allow()
            with pytest.raises(SessionLost) as info:
                await kv.publish_pages(bs.buffer_set_id, [1], tokens=np.arange(8))
            assert info.value.buffer_set_ids == (bs.buffer_set_id,)
            again = await kv.reopen_session()
            assert set(again) == {bs.buffer_set_id}

    try:
        asyncio.run(main())
    finally:
        proxy.close()
    assert not _buffer_sets(server)


def test_watch_waits_through_a_long_idle_and_survives_a_cut(make_server, pool) -> None:
    """A WatchTransfers stream idle for many keepalive intervals (and cut once) still delivers."""
    server = make_server(session_grace_s=5.0, **FAST_SERVER)
    proxy = TcpProxy(f"127.0.0.1:{server.app.tcp_port}")
    try:
        with Client(proxy.address, credential_path=_cred(server), keepalive=FAST) as kv:
            bs = kv.register_buffers(LAYOUT, pool.k_regions, pool.v_regions)
            kv.expect_delta(
                "t-idle", bs.buffer_set_id, prefix_pages=0, dst_page_indices=[4], deadline_ms=60_000
            )
            seen: list[str] = []
            watcher = threading.Thread(target=lambda: seen.extend(s.state for s in kv.wait("t-idle", 30)))
            watcher.start()
            time.sleep(2.0)
            proxy.cut()
            time.sleep(1.5)
            with Client(server.address) as other_path:  # abort through another connection
                assert other_path.get_stats() is not None
            kv.abort("t-idle", "test over")
            watcher.join(10)
            assert seen == ["ABORTED"]
    finally:
        proxy.close()


def test_a_silent_dead_client_is_found_by_server_keepalive(make_server, pool) -> None:
    """No RST, no FIN (a frozen network): the server's pings find the dead client in seconds."""
    server = make_server(session_grace_s=0.5, **FAST_SERVER)  # pings every 200 ms, 2 s timeout
    proxy = TcpProxy(f"127.0.0.1:{server.app.tcp_port}")
    kv = Client(proxy.address, credential_path=_cred(server), keepalive=FAST, timeout=5)
    try:
        kv.register_buffers(LAYOUT, pool.k_regions, pool.v_regions)
        proxy.freeze()
        t0 = time.monotonic()
        eventually(lambda: not _buffer_sets(server), 10)
        assert time.monotonic() - t0 < 5.0  # keepalive (0.2 + 2 s) + grace (0.5 s), not TCP's minutes
        assert server.node.sessions.lost["grace_expired"] == 1
    finally:
        proxy.close()
        kv.close()


def test_killed_engine_is_released_within_the_grace_period(make_server, pool) -> None:
    """SIGKILL of the engine process: its buffer sets go once the grace period ends, not later."""
    import subprocess
    import sys
    import textwrap

    server = make_server(session_grace_s=1.0)
    code = textwrap.dedent(
        f"""
        import time
        from kvservice_client import Client, Layout, ShmKVPool
        layout = {LAYOUT!r}
        p = ShmKVPool.attach({pool.name!r}, layout)
        kv = Client({server.address!r})
        kv.register_buffers(layout, p.k_regions, p.v_regions)
        print("registered", flush=True)
        time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "registered"
        assert len(_buffer_sets(server)) == 1
        proc.kill()
        t0 = time.monotonic()
        eventually(lambda: not _buffer_sets(server), 5)
        assert 0.8 < time.monotonic() - t0 < 3.0
        assert server.node.sessions.lost["grace_expired"] == 1
    finally:
        proc.kill()


@pytest.mark.slow
def test_soak_idle_two_minutes_with_default_settings(make_server, pool) -> None:
    """Every default, UDS and TCP: two minutes without a call, then the next call just works."""
    server = make_server()
    clients = [
        Client(server.address),
        Client(f"127.0.0.1:{server.app.tcp_port}", credential_path=_cred(server)),
    ]
    try:
        ids = [kv.register_buffers(LAYOUT, pool.k_regions, pool.v_regions).buffer_set_id for kv in clients]
        time.sleep(125)
        assert _buffer_sets(server) == set(ids)
        for kv, bs_id in zip(clients, ids, strict=True):
            assert kv.publish_pages(bs_id, [0], tokens=np.arange(4)) == 1
            assert kv.session_resumes == 0
        assert server.node.sessions.resumes == 0 and not server.node.sessions.lost
    finally:
        for kv in clients:
            kv.close()
