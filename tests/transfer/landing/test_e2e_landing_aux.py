"""End to end (loopback, every pair): landing transfers that carry aux rows.

The declaration counts the aux rows per aux region (``Landing.aux``); the senders name theirs as for
any transfer; the rows land in landing rows of the pool (host memory, inside the budget) and the
claim copies them into the rows it names. Canary pages and rows prove nothing else changed; the
pool's used bytes prove no aux byte is left behind on any ending.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from kvservice_client import FailedPrecondition, InvalidArgument, ResourceExhausted

from tests.support.poll import eventually
from tests.support.pools import assert_pages_equal, assert_unchanged, snapshot
from tests.support.transfers import LAYOUT, link, one

AUX = {"meta": (64, 32), "hid": (48, 8)}  # name -> (row bytes, rows)
PAGE_BYTES = LAYOUT.page_bytes_all_layers


def landing_used(server) -> int:
    """Bytes held in the receiving service's landing pools now."""
    return sum(a.used_bytes for a in server.app.node.transfers.landing.pool.arenas.values())


def footprint(server, bs_id: str, pages: int, aux: dict[str, int] | None = None) -> int:
    """Landing-pool bytes a landing of ``pages`` pages and ``aux`` rows takes (regions aligned)."""
    from kvservice.transfer.landing._arena import Arena
    from kvservice.transfer.landing.declare import aux_sizes, region_sizes

    bs = server.app.node.buffers.get(bs_id)
    rows = {n: np.arange(k) for n, k in (aux or {}).items()}
    return Arena.footprint(region_sizes(bs, pages) + aux_sizes(bs, rows))


def land(ln, tid: str, src: list[int], aux_src: dict[str, list[int]], *, prefix: int = 0, ttl_ms: int = 0):
    """Declare a landing of ``src`` past ``prefix`` with the aux rows ``aux_src`` names; send; LANDED."""
    counts = {n: len(r) for n, r in aux_src.items()}
    st = ln.kb.expect_landing(
        tid, ln.b, prefix_pages=prefix, pages=len(src) - prefix, ttl_ms=ttl_ms, aux=counts
    )
    assert st.state == "PENDING", st
    ln.ka.send_delta(tid, ln.a, src_page_indices=src, peer_address=ln.peer, aux=aux_src)
    (r,) = ln.kb.wait_landed(tid, timeout=10)
    assert r.state == "LANDED", r
    return r


def rows_equal(dst, name: str, dst_rows: list[int], src, src_rows: list[int]) -> bool:
    return bool(np.array_equal(dst.aux(name)[dst_rows], src.aux(name)[src_rows]))


def test_land_then_claim_moves_pages_and_aux_rows(pair, make_pool, make_client) -> None:
    """Pages and aux rows land (the sender is DONE, nothing in the engine yet); the claim puts both in."""
    ln = link(pair, make_pool, make_client, aux=AUX)
    before = snapshot(ln.pb)
    r = land(ln, "x1", [5, 9, 2, 30, 31], {"meta": [9], "hid": [1, 6]}, prefix=1)
    aux_bytes = 64 + 2 * 48
    assert r.bytes_sent == 4 * PAGE_BYTES + aux_bytes, r
    assert one(ln.ka, "x1").state == "DONE"
    assert_unchanged(ln.pb, before)  # neither pages nor rows in the engine yet
    assert landing_used(pair[1]) == footprint(pair[1], ln.b, 4, {"meta": 1, "hid": 2})
    c = ln.kb.claim("x1", ln.b, dst_page_indices=[40, 3, 17, 22], aux={"meta": [31], "hid": [7, 0]})
    assert c.status.state == "DONE", c
    assert_pages_equal(ln.pb, [40, 3, 17, 22], ln.pa, [9, 2, 30, 31])
    assert rows_equal(ln.pb, "meta", [31], ln.pa, [9]) and rows_equal(ln.pb, "hid", [7, 0], ln.pa, [1, 6])
    meta, hid = before[-2].copy(), before[-1].copy()
    meta[31], hid[[7, 0]] = ln.pa.aux("meta")[9], ln.pa.aux("hid")[[1, 6]]
    assert_unchanged(ln.pb, before[:-2] + [meta, hid], except_pages=[40, 3, 17, 22])  # no other row
    assert landing_used(pair[1]) == 0


def test_a_landing_may_carry_some_aux_regions_only(pair, make_pool, make_client) -> None:
    """Only the declared aux region lands; the claim names only it; the other region is untouched."""
    ln = link(pair, make_pool, make_client, aux=AUX)
    before = snapshot(ln.pb)
    land(ln, "x2", [1, 2], {"hid": [3]})
    ln.kb.claim("x2", ln.b, dst_page_indices=[10, 11], aux={"hid": [4]})
    assert rows_equal(ln.pb, "hid", [4], ln.pa, [3])
    assert np.array_equal(ln.pb.aux("meta"), before[-2])


def test_expiry_frees_the_aux_rows_too(pair, make_pool, make_client) -> None:
    """Unclaimed past its TTL: FAILED 'landing expired', pages and aux rows freed, engine untouched."""
    ln = link(pair, make_pool, make_client, aux=AUX)
    before = snapshot(ln.pb)
    land(ln, "e1", [1, 2], {"meta": [0], "hid": [1, 2]}, ttl_ms=200)
    assert landing_used(pair[1]) == footprint(pair[1], ln.b, 2, {"meta": 1, "hid": 2})
    r = eventually(lambda: next((s for s in ln.kb.poll(["e1"]) if s.terminal), None), 5, "expiry")
    assert r.state == "FAILED" and "landing expired" in r.error, r
    assert landing_used(pair[1]) == 0
    with pytest.raises(FailedPrecondition, match="landing expired"):
        ln.kb.claim("e1", ln.b, dst_page_indices=[0, 1], aux={"meta": [0], "hid": [1, 2]})
    assert_unchanged(ln.pb, before)


def test_budget_refusal_counts_the_aux_rows(pair, make_pool, make_client) -> None:
    """A budget that holds the pages but not the pages and their aux rows refuses at once, naming them."""
    ln = link(pair, make_pool, make_client, aux=AUX)
    pool = pair[1].app.node.transfers.landing.pool
    pool.capacity_bytes = footprint(pair[1], ln.b, 3)  # the pages alone fit exactly
    pool.arenas.clear()
    t0 = time.monotonic()
    with pytest.raises(
        ResourceExhausted, match=r"landing_pool_mb: a landing of 3 pages and 1 aux rows needs"
    ):
        ln.kb.expect_landing("b1", ln.b, pages=3, aux={"meta": 1})
    assert time.monotonic() - t0 < 1.0
    assert ln.kb.poll(["b1"]) == [] and landing_used(pair[1]) == 0  # nothing declared, nothing held
    land(ln, "b2", [1, 2, 3], {})  # without the rows it fits
    (ls,) = ln.kb.get_stats().landing
    assert ls.refused == 1 and ls.used_bytes == ls.capacity_bytes and ls.landings == 1, ls
    ln.kb.abort("b2")
    assert landing_used(pair[1]) == 0


def test_eviction_frees_aux_rows_and_counts_them(make_server, make_pool, make_client) -> None:
    """landing_evict=oldest: the oldest LANDED landing goes (pages and rows) when that makes room."""
    s = make_server(transport="loopback", landing_evict="oldest")
    ln = link((s, s), make_pool, make_client, aux=AUX)
    pool = s.app.node.transfers.landing.pool
    one_landing = footprint(s, ln.b, 2, {"meta": 1})
    pool.capacity_bytes = 2 * one_landing
    pool.arenas.clear()
    land(ln, "v1", [1, 2], {"meta": [1]})
    land(ln, "v2", [3, 4], {"meta": [2]})
    land(ln, "v3", [5, 6], {"meta": [3]})  # needs v1's pages and row
    (r,) = ln.kb.poll(["v1"])
    assert r.state == "FAILED" and "landing evicted" in r.error, r
    assert landing_used(s) == 2 * one_landing
    ln.kb.claim("v3", ln.b, dst_page_indices=[7, 8], aux={"meta": [9]})
    assert rows_equal(ln.pb, "meta", [9], ln.pa, [3])
    assert [x.state for x in ln.kb.poll(["v2"])] == ["LANDED"]


def test_abort_of_a_landed_transfer_with_aux_frees_it(pair, make_pool, make_client) -> None:
    """Abort after LANDED: ABORTED, pages and rows freed, nothing written into the engine."""
    ln = link(pair, make_pool, make_client, aux=AUX)
    before = snapshot(ln.pb)
    land(ln, "a1", [3, 4, 5], {"meta": [2], "hid": [0]})
    (r,) = ln.kb.abort("a1", reason="request cancelled")
    assert r.state == "ABORTED" and "request cancelled" in r.error, r
    assert landing_used(pair[1]) == 0
    with pytest.raises(FailedPrecondition, match="ABORTED"):
        ln.kb.claim("a1", ln.b, dst_page_indices=[0, 1, 2], aux={"meta": [2], "hid": [0]})
    assert_unchanged(ln.pb, before)


def test_bad_aux_destinations_are_refused_and_the_landing_stays_claimable(
    pair, make_pool, make_client
) -> None:
    """Each bad aux field is INVALID_ARGUMENT naming it; nothing is written; a good claim then works."""
    ln = link(pair, make_pool, make_client, aux=AUX)
    before = snapshot(ln.pb)
    land(ln, "g1", [1, 2], {"meta": [4]})
    pages = [6, 7]
    for aux, why in (
        ({}, r"aux: name the destination rows of every aux region transfer 'g1' lands: \['meta'\]"),
        ({"meta": [1, 2]}, r"aux\[meta\]\.rows: 2 rows for the 1 rows transfer 'g1' lands"),
        ({"meta": [32]}, r"aux\[meta\]\.rows: row outside 0\.\.31"),
        ({"meta": [1], "nope": [0]}, "aux: buffer set has no aux region named 'nope'"),
        ({"meta": [1], "hid": [0]}, r"aux\[hid\]: transfer 'g1' landed no rows of 'hid'"),
    ):
        with pytest.raises(InvalidArgument, match=why):
            ln.kb.claim("g1", ln.b, dst_page_indices=pages, aux=aux)
    assert_unchanged(ln.pb, before)
    assert [x.state for x in ln.kb.poll(["g1"])] == ["LANDED"]
    assert ln.kb.claim("g1", ln.b, dst_page_indices=pages, aux={"meta": [5]}).status.state == "DONE"
    assert_pages_equal(ln.pb, pages, ln.pa, [1, 2])
    assert rows_equal(ln.pb, "meta", [5], ln.pa, [4])


def test_bad_aux_declarations_change_nothing(pair, make_pool, make_client) -> None:
    """Rows named the non-landing way, unknown names, bad counts: INVALID_ARGUMENT, no bytes held."""
    from kvservice_client._landing import landing_request

    ln = link(pair, make_pool, make_client, aux=AUX)
    req = landing_request("d1", ln.b, 0, 1, 0, 0, 0, None, (), (), "")
    req.aux.add(name="meta", rows=[1])
    with pytest.raises(
        InvalidArgument, match=r"aux: must be empty for a landing transfer \(count its aux rows"
    ):
        ln.kb._transfer_call("expect_delta", "ExpectDelta", req)
    for aux, why in (
        ({"nope": 1}, "landing.aux: buffer set has no aux region named 'nope'"),
        ({"meta": 0}, r"landing.aux\[meta\].num_rows: must be 1\.\.32"),
        ({"hid": 9}, r"landing.aux\[hid\].num_rows: must be 1\.\.8"),
    ):
        with pytest.raises(InvalidArgument, match=why):
            ln.kb.expect_landing("d1", ln.b, pages=1, aux=aux)
    assert ln.kb.poll(["d1"]) == [] and landing_used(pair[1]) == 0


def test_a_sender_naming_other_row_counts_fails_the_landing_and_frees_it(
    pair, make_pool, make_client
) -> None:
    """The sender's aux rows must match the landed count: FAILED with the reason, bytes freed."""
    ln = link(pair, make_pool, make_client, aux=AUX)
    ln.kb.expect_landing("m1", ln.b, pages=2, aux={"meta": 1})
    ln.ka.send_delta("m1", ln.a, src_page_indices=[1, 2], peer_address=ln.peer, aux={"meta": [1, 2]})
    (r,) = ln.kb.wait("m1", timeout=10)
    assert r.state == "FAILED" and "aux[meta]" in r.error, r
    eventually(lambda: landing_used(pair[1]) == 0, 5, "landing freed")


def test_load_and_stats_count_the_aux_bytes(pair, make_pool, make_client) -> None:
    """TransferLoad.landed_bytes and GetStats.landing include the landed aux rows."""
    ln = link(pair, make_pool, make_client, aux=AUX)
    land(ln, "s1", [1, 2], {"meta": [0], "hid": [5]})
    (m,) = [
        x
        for x in ln.kb.match_prefix(tokens=np.arange(8, dtype=np.uint32), page_size=4).matches
        if x.buffer_set_id == ln.b
    ]
    assert m.load.landed_transfers == 1 and m.load.landed_bytes == 2 * PAGE_BYTES + 64 + 48, m.load
    (ls,) = ln.kb.get_stats().landing
    assert ls.used_bytes == footprint(pair[1], ln.b, 2, {"meta": 1, "hid": 1}) and ls.landings == 1, ls
    ln.kb.claim("s1", ln.b, dst_page_indices=[3, 4], aux={"meta": [1], "hid": [2]})
    (ls,) = ln.kb.get_stats().landing
    assert ls.used_bytes == 0 and ls.claims == 1, ls


def test_async_client_lands_and_claims_aux_rows(pair, make_pool, make_client) -> None:
    """AsyncClient: expect_landing(aux=counts) and claim(aux=rows) do what the sync ones do."""
    import asyncio

    from kvservice_client import AsyncClient

    ln = link(pair, make_pool, make_client, aux=AUX)

    async def main() -> None:
        async with AsyncClient(pair[1].address, client_name="aio-landing-aux") as kv:
            reg = await kv.register_buffers(LAYOUT, ln.pb.k_regions, ln.pb.v_regions, ln.pb.aux_specs)
            bs = reg.buffer_set_id
            assert (await kv.expect_landing("aio2", bs, pages=2, aux={"hid": 2})).state == "PENDING"
            await asyncio.to_thread(
                ln.ka.send_delta,
                "aio2",
                ln.a,
                src_page_indices=[7, 8],
                peer_address=ln.peer,
                aux={"hid": [0, 1]},
            )
            (st,) = await kv.wait_landed("aio2", timeout=10)
            assert st.state == "LANDED", st
            c = await kv.claim("aio2", bs, dst_page_indices=[40, 41], aux={"hid": [6, 5]})
            assert c.status.state == "DONE", c

    asyncio.run(main())
    assert_pages_equal(ln.pb, [40, 41], ln.pa, [7, 8])
    assert rows_equal(ln.pb, "hid", [6, 5], ln.pa, [0, 1])
