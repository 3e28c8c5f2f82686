"""An owned call whose connection breaks after the service took it is tried again with its request
id, and the service answers that try with the first run's outcome: it never runs twice."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import numpy as np
import pytest
from kvservice_client import AsyncClient, Client, Layout, NotFound, ShmKVPool
from kvservice_client._proto import kvservice_pb2 as pb
from kvservice_client._proto import kvservice_pb2_grpc

from kvservice.server.replay import ReplayCache
from tests.support.tcp_proxy import TcpProxy

LAYOUT = Layout.mha(num_layers=2, page_size=4, num_pages=8, total_kv_heads=2, head_dim=8, dtype="float16")
FAST_SERVER = dict(keepalive_time_ms=200, keepalive_timeout_ms=2_000, keepalive_min_ping_interval_ms=100)


@pytest.fixture
def pool():
    with ShmKVPool.create(LAYOUT) as p:
        yield p


def _cut_during(obj, name: str, proxy: TcpProxy, calls: list[int]) -> None:
    """Wrap ``obj.name`` so its first run resets the client's connection before it returns."""
    real = getattr(obj, name)

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            proxy.cut()
            time.sleep(0.3)  # the client sees the reset while the service is still at work
        return real(*args, **kwargs)

    setattr(obj, name, wrapped)


def test_register_cut_mid_call_registers_once(make_server, pool) -> None:
    server = make_server(session_grace_s=10.0, **FAST_SERVER)
    proxy = TcpProxy(f"127.0.0.1:{server.app.tcp_port}")
    calls: list[int] = []
    try:
        with Client(proxy.address, credential_path=server.app.uds_path + ".cred", timeout=20) as kv:
            assert kv.session_id  # the session opens on first use
            _cut_during(server.node, "register_buffers", proxy, calls)
            bs = kv.register_buffers(LAYOUT, pool.k_regions, pool.v_regions)
            assert len(calls) == 1, "the retry was answered from the first run, not run again"
            owned = [b.buffer_set_id for b in server.node.buffers.all()]
            assert owned == [bs.buffer_set_id]
            assert server.app.servicer.replay.replays >= 1
    finally:
        proxy.close()


def test_async_publish_cut_mid_call_runs_once(make_server, pool) -> None:
    server = make_server(session_grace_s=10.0, **FAST_SERVER)
    proxy = TcpProxy(f"127.0.0.1:{server.app.tcp_port}")
    calls: list[int] = []

    async def main() -> int:
        cred = server.app.uds_path + ".cred"
        async with AsyncClient(proxy.address, credential_path=cred, timeout=20) as kv:
            bs = await kv.register_buffers(LAYOUT, pool.k_regions, pool.v_regions)
            _cut_during(server.node.prefix, "publish_pages", proxy, calls)
            return await kv.publish_pages(bs.buffer_set_id, [1, 2], tokens=np.arange(8))

    try:
        assert asyncio.run(main()) == 2
        assert len(calls) == 1
    finally:
        proxy.close()


def test_a_status_the_service_sent_is_not_retried_and_a_replay_repeats_it(make_server) -> None:
    """A service error carries the origin marker (no retry); the same request id gets it again."""
    server = make_server()
    with Client(server.address) as kv:
        sid = kv.session_id
        stub = kvservice_pb2_grpc.KVServiceStub(grpc.insecure_channel(server.address))
        md = (("kvservice-session", sid), ("kvservice-request-id", "r-1"))
        req = pb.EvictPagesRequest(buffer_set_id="nope", page_indices=[1])
        codes = []
        for _ in range(2):
            with pytest.raises(grpc.RpcError) as info:
                stub.EvictPages(req, metadata=md, timeout=5)
            codes.append((info.value.code(), info.value.details()))
            assert ("kvservice-status-origin", "service") in tuple(info.value.trailing_metadata())
        assert codes[0] == codes[1] and codes[0][0] == grpc.StatusCode.NOT_FOUND
        assert server.app.servicer.replay.replays == 1
        with pytest.raises(NotFound):  # the client maps it as before, without retrying
            kv.evict_pages("nope", [1])


def test_request_ids_are_per_session_and_bounded() -> None:
    async def main() -> None:
        cache = ReplayCache(ttl_s=60.0, capacity=2)
        ran: list[str] = []

        async def work(tag: str) -> str:
            ran.append(tag)
            return tag

        assert await cache.run(("s1", "r"), lambda: work("a")) == "a"
        assert await cache.run(("s1", "r"), lambda: work("b")) == "a"  # replayed
        assert await cache.run(("s2", "r"), lambda: work("c")) == "c"  # another session's id
        assert ran == ["a", "c"] and cache.replays == 1
        for i in range(5):
            await cache.run(("s3", str(i)), lambda: work("x"))
        assert len(cache) <= 3  # done entries over capacity leave (checked before each run)

    asyncio.run(main())


def test_a_finished_call_is_kept_as_its_outcome_not_its_task() -> None:
    """The cache keeps a response as its bytes and an error as itself (a task holds its
    coroutine and context: GC work for each of up to 65,536 entries); replays answer the same."""
    from kvservice_client._proto import kvservice_pb2 as pb

    from kvservice.errors import FailedPrecondition

    async def main() -> None:
        cache = ReplayCache(ttl_s=60.0, capacity=8)
        ran: list[str] = []

        async def ok() -> pb.ExpectDeltaResponse:
            ran.append("ok")
            return pb.ExpectDeltaResponse(status=pb.TransferStatus(transfer_id="t1", bytes_sent=7))

        async def bad() -> None:
            ran.append("bad")
            raise FailedPrecondition("nope")

        first = await cache.run(("s", "1"), ok)
        with pytest.raises(FailedPrecondition):
            await cache.run(("s", "2"), bad)
        await asyncio.sleep(0)  # done callbacks ran
        kept = [held for _, held in cache._tasks.values()]
        assert not any(isinstance(h, asyncio.Future) for h in kept), kept
        again = await cache.run(("s", "1"), ok)
        assert again == first and again is not first
        with pytest.raises(FailedPrecondition, match="nope"):
            await cache.run(("s", "2"), bad)
        assert ran == ["ok", "bad"] and cache.replays == 2

    asyncio.run(main())


def test_break_without_a_marker_is_retried_until_the_service_answers(make_server) -> None:
    """Refused connections (UNAVAILABLE, no marker) keep an owned call trying within its timeout;
    the service's own answer (NOT_FOUND here) ends it."""
    server = make_server(session_grace_s=10.0, **FAST_SERVER)
    proxy = TcpProxy(f"127.0.0.1:{server.app.tcp_port}")
    try:
        with Client(proxy.address, credential_path=server.app.uds_path + ".cred", timeout=8) as kv:
            assert kv.session_id
            proxy.cut(refuse=True)
            threading.Timer(1.0, proxy.allow).start()
            t0 = time.monotonic()
            with pytest.raises(NotFound, match="nope"):
                kv.evict_pages("nope", all=True)
            assert 0.5 < time.monotonic() - t0 < 8
    finally:
        proxy.close()
