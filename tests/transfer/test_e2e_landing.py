"""End to end (loopback, every pair): landing transfers land, are claimed, expire, are refused.

The receiver declares without destination pages; the pages land in its service's landing pool
(LANDED, the sender DONE); a claim copies them into the engine's pages (DONE). Canary pages prove
nothing else changed; GetStats proves no landing byte is left behind on any path.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from kvservice_client import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)

from tests.support.poll import eventually
from tests.support.pools import assert_pages_equal, assert_unchanged, snapshot
from tests.support.transfers import LAYOUT, link, one

PAGE_BYTES = LAYOUT.page_bytes_all_layers


def landing_used(server) -> int:
    """Bytes held in the receiving service's landing pools now."""
    return sum(a.used_bytes for a in server.app.node.transfers.landing.pool.arenas.values())


def footprint(server, bs_id: str, pages: int) -> int:
    """Landing-pool bytes a landing of ``pages`` pages takes (regions aligned)."""
    from kvservice.transfer.landing._arena import Arena
    from kvservice.transfer.landing.declare import region_sizes

    return Arena.footprint(region_sizes(server.app.node.buffers.get(bs_id), pages))


def land(ln, tid: str, src: list[int], *, prefix: int = 0, ttl_ms: int = 0, **kw) -> None:
    """Declare a landing of ``len(src) - prefix`` pages and send ``src``; wait until LANDED."""
    st = ln.kb.expect_landing(tid, ln.b, prefix_pages=prefix, pages=len(src) - prefix, ttl_ms=ttl_ms, **kw)
    assert st.state == "PENDING" and st.role == "RECEIVER", st
    ln.ka.send_delta(tid, ln.a, src_page_indices=src, peer_address=ln.peer)
    (r,) = ln.kb.wait_landed(tid, timeout=10)
    assert r.state == "LANDED", r


def test_land_then_claim_moves_the_delta(pair, make_pool, make_client) -> None:
    """LANDED frees the sender (DONE) before any destination page exists; the claim puts the bytes in."""
    ln = link(pair, make_pool, make_client)
    before = snapshot(ln.pb)
    src = [5, 9, 2, 30, 31, 7]
    land(ln, "l1", src, prefix=2)
    s = one(ln.ka, "l1")
    assert s.state == "DONE" and s.pages_sent == 4 and s.pages_skipped == 2, s
    assert_unchanged(ln.pb, before)  # nothing in the engine's pool yet
    assert landing_used(pair[1]) >= 4 * PAGE_BYTES
    dst = [40, 3, 17, 22]
    c = ln.kb.claim("l1", ln.b, dst_page_indices=dst)
    assert c.status.state == "DONE" and c.claim_us > 0, c
    assert_pages_equal(ln.pb, dst, ln.pa, src[2:])
    assert_unchanged(ln.pb, before, except_pages=dst)
    (r,) = ln.kb.poll(["l1"])
    assert r.state == "DONE" and r.pages_sent == 4 and r.bytes_sent == 4 * PAGE_BYTES, r
    assert landing_used(pair[1]) == 0


def test_claim_waits_for_a_transfer_still_arriving(pair, make_pool, make_client) -> None:
    """A claim made before the sender starts waits for LANDED, then copies."""
    import threading

    ln = link(pair, make_pool, make_client)
    ln.kb.expect_landing("l2", ln.b, pages=3)
    got: list = []
    t = threading.Thread(
        target=lambda: got.append(ln.kb.claim("l2", ln.b, dst_page_indices=[1, 2, 3], wait_ms=8000))
    )
    t.start()
    time.sleep(0.3)
    ln.ka.send_delta("l2", ln.a, src_page_indices=[10, 11, 12], peer_address=ln.peer)
    t.join(10)
    assert got and got[0].status.state == "DONE", got
    assert_pages_equal(ln.pb, [1, 2, 3], ln.pa, [10, 11, 12])


def test_claim_after_ttl_names_the_expiry(pair, make_pool, make_client) -> None:
    """Unclaimed past its TTL: FAILED DEADLINE_EXCEEDED 'landing expired', bytes freed; a claim says why."""
    ln = link(pair, make_pool, make_client)
    before = snapshot(ln.pb)
    land(ln, "l3", [1, 2], ttl_ms=200)
    r = eventually(lambda: next((s for s in ln.kb.poll(["l3"]) if s.terminal), None), 5, "expiry")
    assert r.state == "FAILED" and r.error_code == "DEADLINE_EXCEEDED" and "landing expired" in r.error, r
    assert "'l3'" in r.error and "200 ms" in r.error
    assert landing_used(pair[1]) == 0
    with pytest.raises(FailedPrecondition, match=r"'l3' cannot be claimed.*landing expired"):
        ln.kb.claim("l3", ln.b, dst_page_indices=[0, 1])
    assert_unchanged(ln.pb, before)


def test_budget_refuses_at_once_and_changes_nothing(pair, make_pool, make_client) -> None:
    """A landing that cannot fit the pool is refused at once (RESOURCE_EXHAUSTED) and declares nothing."""
    ln = link(pair, make_pool, make_client)
    pool = pair[1].app.node.transfers.landing.pool
    # this test's budget (the arena is made at first use): 4 pages fit, 3 more do not
    pool.capacity_bytes = footprint(pair[1], ln.b, 4) + footprint(pair[1], ln.b, 3) - 256
    pool.arenas.clear()
    land(ln, "b1", [1, 2, 3, 4])
    t0 = time.monotonic()
    with pytest.raises(ResourceExhausted, match=r"landing_pool_mb: a landing of 3 pages needs"):
        ln.kb.expect_landing("b2", ln.b, pages=3)
    assert time.monotonic() - t0 < 1.0
    assert ln.kb.poll(["b2"]) == []  # nothing declared
    st = ln.kb.get_stats()
    (ls,) = st.landing
    assert ls.refused == 1 and ls.landings == 1 and ls.used_bytes <= ls.capacity_bytes, ls
    ln.kb.claim("b1", ln.b, dst_page_indices=[10, 11, 12, 13])
    land(ln, "b3", [5, 6, 7])  # room again once claimed
    ln.kb.abort("b3")
    assert landing_used(pair[1]) == 0
    text = pair[1].app.metrics.exposition().decode()
    kind = ls.location
    for line in (
        f'kvservice_landing_refused_total{{location="{kind}"}} 1.0',
        f'kvservice_landing_claims_total{{location="{kind}"}} 1.0',
        f'kvservice_landing_bytes{{location="{kind}"}} 0.0',
        f'kvservice_landing_transfers{{location="{kind}"}} 0.0',
    ):
        assert line in text, (line, [x for x in text.splitlines() if "landing" in x])


def test_oldest_landed_is_evicted_with_a_reason(make_server, make_pool, make_client) -> None:
    """landing_evict=oldest: a new landing evicts the oldest LANDED one (FAILED, reason), never silently."""
    s = make_server(transport="loopback", landing_evict="oldest")
    ln = link((s, s), make_pool, make_client)
    pool = s.app.node.transfers.landing.pool
    pool.capacity_bytes = footprint(s, ln.b, 3) + footprint(s, ln.b, 2) + 256
    land(ln, "e1", [1, 2, 3])
    land(ln, "e2", [4, 5])
    land(ln, "e3", [6, 7, 8])  # needs e1's room
    (r,) = ln.kb.poll(["e1"])
    assert r.state == "FAILED" and r.error_code == "RESOURCE_EXHAUSTED" and "landing evicted" in r.error, r
    with pytest.raises(FailedPrecondition, match="landing evicted"):
        ln.kb.claim("e1", ln.b, dst_page_indices=[0, 1, 2])
    assert [x.state for x in ln.kb.poll(["e2", "e3"])] == ["LANDED", "LANDED"]
    with pytest.raises(ResourceExhausted):  # would need more than every landed one: evicts nothing
        ln.kb.expect_landing("e4", ln.b, pages=7)
    assert [x.state for x in ln.kb.poll(["e2", "e3"])] == ["LANDED", "LANDED"]


def test_abort_of_a_landed_transfer_frees_it(pair, make_pool, make_client) -> None:
    """Abort after LANDED: ABORTED at once (no sender to tell), bytes freed, a claim says ABORTED."""
    ln = link(pair, make_pool, make_client)
    land(ln, "a1", [3, 4, 5])
    t0 = time.monotonic()
    (r,) = ln.kb.abort("a1", reason="request cancelled")
    assert r.state == "ABORTED" and "request cancelled" in r.error and time.monotonic() - t0 < 1.0, r
    assert landing_used(pair[1]) == 0
    with pytest.raises(FailedPrecondition, match="ABORTED"):
        ln.kb.claim("a1", ln.b, dst_page_indices=[0, 1, 2])


def test_bad_declarations_and_claims_change_nothing(pair, make_pool, make_client) -> None:
    """Bad fields are INVALID_ARGUMENT naming the field; a bad claim leaves the landing claimable."""
    ln = link(pair, make_pool, make_client)
    with pytest.raises(InvalidArgument, match="dst_page_indices: must be empty"):
        ln.kb._transfer_call("expect_delta", "ExpectDelta", _landing_req(ln, dst=[1]))
    with pytest.raises(InvalidArgument, match="landing.pages: is required"):
        ln.kb.expect_landing("x", ln.b)
    with pytest.raises(InvalidArgument, match="landing.pages: 99 pages exceed"):
        ln.kb.expect_landing("x", ln.b, pages=99)
    with pytest.raises(InvalidArgument, match="landing.ttl_ms"):
        ln.kb.expect_landing("x", ln.b, pages=1, ttl_ms=10**9)
    assert landing_used(pair[1]) == 0 and ln.kb.poll(["x"]) == []
    land(ln, "g1", [1, 2])
    for dst, why in (([1], "1 pages for the 2"), ([4, 4], "distinct"), ([1, 999], "outside")):
        with pytest.raises(InvalidArgument, match=why):
            ln.kb.claim("g1", ln.b, dst_page_indices=dst)
    with pytest.raises(NotFound, match="no landing transfer 'nope'"):
        ln.kb.claim("nope", ln.b, dst_page_indices=[1])
    with pytest.raises(PermissionDenied):  # another client of that service: not its buffer set
        make_client(pair[1]).claim("g1", ln.b, dst_page_indices=[1, 2])
    assert ln.kb.claim("g1", ln.b, dst_page_indices=[6, 7]).status.state == "DONE"
    assert_pages_equal(ln.pb, [6, 7], ln.pa, [1, 2])


def _landing_req(ln, dst):
    from kvservice_client._landing import landing_request

    req = landing_request("bad", ln.b, 0, 1, 0, 0, 0, None, (), (), "")
    req.dst_page_indices.extend(dst)
    return req


def test_a_normal_transfer_is_not_claimable(pair, make_pool, make_client) -> None:
    """Claiming a transfer declared with destination pages says there is nothing to claim."""
    ln = link(pair, make_pool, make_client)
    ln.kb.expect_delta("n1", ln.b, prefix_pages=0, dst_page_indices=[1])
    with pytest.raises(FailedPrecondition, match="not as a landing"):
        ln.kb.claim("n1", ln.b, dst_page_indices=[2])
    ln.kb.abort("n1")


def test_owner_closing_releases_landed_bytes(pair, make_pool, make_client) -> None:
    """The claiming engine's session closes before the claim: ABORTED, the landing bytes freed."""
    ln = link(pair, make_pool, make_client)
    land(ln, "o1", [1, 2, 3])
    ln.kb.close()
    eventually(lambda: landing_used(pair[1]) == 0, 5, "landing freed")
    recs = pair[1].app.node.transfers.table.find("o1", "RECEIVER")
    assert recs and recs[0].state == "ABORTED", recs


def test_landed_pages_are_visible_to_match_prefix_and_published_by_the_claim(
    pair, make_pool, make_client
) -> None:
    """MatchPrefix reports the landed pages and transfer; after the claim the index holds the sequence."""
    ln = link(pair, make_pool, make_client)
    tokens = np.arange(7 * LAYOUT.page_size, dtype=np.uint32) + 1000
    ln.kb.publish_pages(ln.b, tokens=tokens[: 2 * LAYOUT.page_size], page_indices=[20, 21])
    st = ln.kb.expect_landing("m1", ln.b, prefix_pages=2, publish_tokens=tokens, prefix_page_indices=[20, 21])
    assert st.state == "PENDING"
    ln.ka.send_delta("m1", ln.a, src_page_indices=list(range(7)), peer_address=ln.peer)
    ln.kb.wait_landed("m1")
    (m,) = [
        x
        for x in ln.kb.match_prefix(tokens=tokens, page_size=LAYOUT.page_size).matches
        if x.buffer_set_id == ln.b
    ]
    assert (m.matched_pages, m.landed_pages, m.landed_transfer_id) == (2, 7, "m1"), m
    assert (
        m.load.landed_transfers == 1
        and m.load.landed_bytes == 5 * PAGE_BYTES
        and m.load.inbound_transfers == 0
    )
    ln.kb.claim("m1", ln.b, dst_page_indices=[30, 31, 32, 33, 34])
    (m,) = [
        x
        for x in ln.kb.match_prefix(tokens=tokens, page_size=LAYOUT.page_size).matches
        if x.buffer_set_id == ln.b
    ]
    assert (m.matched_pages, m.landed_pages) == (7, 0) and list(m.page_indices) == [
        20,
        21,
        30,
        31,
        32,
        33,
        34,
    ]
    assert m.load.landed_transfers == 0


def test_unregistering_the_buffer_set_frees_its_landings(pair, make_pool, make_client) -> None:
    """UnregisterBuffers with a LANDED transfer: ABORTED, the landing bytes freed."""
    ln = link(pair, make_pool, make_client)
    land(ln, "u1", [1, 2])
    ln.kb.unregister_buffers(ln.b)
    assert landing_used(pair[1]) == 0
    (r,) = pair[1].app.node.transfers.table.find("u1", "RECEIVER")
    assert r.state == "ABORTED" and "unregistered" in r.error, r


def test_async_client_lands_and_claims(pair, make_pool, make_client) -> None:
    """AsyncClient: expect_landing, wait_landed and claim (unary calls) do what the sync ones do."""
    import asyncio

    from kvservice_client import AsyncClient

    ln = link(pair, make_pool, make_client)

    async def main() -> None:
        async with AsyncClient(pair[1].address, client_name="aio-landing") as kv:
            bs = (await kv.register_buffers(LAYOUT, ln.pb.k_regions, ln.pb.v_regions)).buffer_set_id
            assert (await kv.expect_landing("aio1", bs, pages=3)).state == "PENDING"
            await asyncio.to_thread(
                ln.ka.send_delta, "aio1", ln.a, src_page_indices=[7, 8, 9], peer_address=ln.peer
            )
            (st,) = await kv.wait_landed("aio1", timeout=10)
            assert st.state == "LANDED", st
            c = await kv.claim("aio1", bs, dst_page_indices=[40, 41, 42])
            assert c.status.state == "DONE" and c.claim_us > 0, c

    asyncio.run(main())
    assert_pages_equal(ln.pb, [40, 41, 42], ln.pa, [7, 8, 9])


def test_two_racing_claims_one_wins(pair, make_pool, make_client) -> None:
    """Two claims of one landing at once: exactly one copies (DONE), the other is refused with a reason."""
    import threading

    ln = link(pair, make_pool, make_client)
    land(ln, "r1", list(range(20)))
    out: list = []

    def claim(kv, dst) -> None:
        try:
            out.append(kv.claim("r1", ln.b, dst_page_indices=dst).status.state)
        except Exception as exc:  # the loser
            out.append(type(exc).__name__)

    ts = [threading.Thread(target=claim, args=(ln.kb, list(range(20, 40))))]
    ts += [threading.Thread(target=claim, args=(ln.kb, list(range(24, 44))))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    assert sorted(out) == ["DONE", "FailedPrecondition"], out
    assert landing_used(pair[1]) == 0


def test_expiry_reaches_the_engine_as_a_final_status(pair, make_pool, make_client) -> None:
    """A landing that expires is never lost silently: wait() returns its FAILED status and reason."""
    ln = link(pair, make_pool, make_client)
    land(ln, "w1", [1, 2, 3], ttl_ms=150)
    (st,) = ln.kb.wait("w1", timeout=5)
    assert st.state == "FAILED" and "landing expired" in st.error, st


def test_a_ttl_that_fires_as_a_claim_begins_does_not_fail_it(make_server, make_pool, make_client) -> None:
    """The TTL's expiry task and a claim race: once the claim began, the expiry does nothing."""
    s = make_server(transport="loopback")
    ln = link((s, s), make_pool, make_client)
    land(ln, "t1", [1, 2, 3], ttl_ms=60_000)
    book = s.app.node.transfers.landing
    entry = book.entries[("t1", ln.b)]

    async def race() -> None:  # the timer's task runs after a claim marked the landing
        entry.claiming = True
        await book._expire(entry)
        entry.claiming = False

    s.call(race())
    assert [x.state for x in ln.kb.poll(["t1"])] == ["LANDED"]
    assert ln.kb.claim("t1", ln.b, dst_page_indices=[4, 5, 6]).status.state == "DONE"
    assert_pages_equal(ln.pb, [4, 5, 6], ln.pa, [1, 2, 3])
