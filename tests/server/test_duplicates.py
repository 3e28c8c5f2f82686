"""P/D duplicate marks (set on DONE, cleared when the receiver's copy goes) and SuggestEvictions."""

from __future__ import annotations

import numpy as np
import pytest
from kvservice_client import Client, InvalidArgument, Layout, NotFound, ShmKVPool

from tests.support.poll import eventually
from tests.support.services import ServerThread, make_config

LAYOUT = Layout.mha(num_layers=2, page_size=4, num_pages=32, total_kv_heads=2, head_dim=8, dtype="float16")
TOKENS = np.arange(500, 500 + 6 * 4)  # 6 pages
SRC = [0, 1, 2, 3, 4, 5]
DST = [10, 11, 12, 13, 14, 15]


def _dup(client: Client, bs_id: str) -> int:
    (info,) = [i for i in client.get_stats().buffer_sets if i.buffer_set_id == bs_id]
    return info.duplicated_pages


def _transfer(make_server, publish: bool = True, check_ms: int = 100, b=None, no_mark: bool = False, **cfg):  # noqa: ANN001, ANN202, E501
    """A prefill service (a) whose engine published the sequence, a decode service (b)."""
    a = make_server(transport="loopback", duplicate_check_ms=check_ms, **cfg)
    b = b or make_server(transport="loopback")
    pa, pb = ShmKVPool.create(LAYOUT), ShmKVPool.create(LAYOUT)
    ka, kb = Client(a.address), Client(b.address)
    ka.duplicate_events = []  # type: ignore[attr-defined]
    ka.on_duplicates(lambda bs, n: ka.duplicate_events.append((bs, n)))  # type: ignore[attr-defined]
    sa = ka.register_buffers(LAYOUT, pa.k_regions, pa.v_regions).buffer_set_id
    sb = kb.register_buffers(LAYOUT, pb.k_regions, pb.v_regions).buffer_set_id
    ka.publish_pages(sa, SRC, tokens=TOKENS)
    ka.publish_pages(sa, [20, 21], tokens=np.arange(9000, 9008))  # another sequence, not sent
    kb.expect_delta("t", sb, prefix_pages=0, dst_page_indices=DST, publish_tokens=TOKENS if publish else None)
    ka.send_delta("t", sa, src_page_indices=SRC, peer_address=b.app.peer_address, no_duplicate_mark=no_mark)
    assert {s.state for s in kb.wait("t", timeout=20)} == {"DONE"}
    eventually(lambda: {s.state for s in ka.poll(["t"])} == {"DONE"}, 10, "sender DONE")
    return a, b, ka, kb, sa, sb, (pa, pb)


@pytest.fixture
def closing():  # noqa: ANN201
    held: list = []
    yield held.append
    for x in held:
        for obj in x:
            obj.close()


def test_marks_set_on_done_and_offered_first(make_server, closing) -> None:
    a, b, ka, kb, sa, sb, pools = _transfer(make_server)
    closing((ka, kb, *pools))
    assert eventually(lambda: _dup(ka, sa) == 6, 5, "6 duplicated pages")
    sug = ka.suggest_evictions(sa, 32)
    assert sug.page_indices[:6] == (5, 4, 3, 2, 1, 0)  # leaves before parents, all duplicated
    assert sug.duplicated == (True,) * 6 + (False,) * 2
    assert sug.priorities[:6] == (-1000,) * 6 and sug.priorities[6:] == (0, 0)
    assert _dup(kb, sb) == 0  # the receiver marks nothing
    assert eventually(lambda: (sa, 6) in ka.duplicate_events, 5, "a notice on the session stream")


def test_no_mark_when_the_receiver_does_not_index_the_pages(make_server, closing) -> None:
    a, b, ka, kb, sa, sb, pools = _transfer(make_server, publish=False)
    closing((ka, kb, *pools))
    assert _dup(ka, sa) == 0
    assert not any(ka.suggest_evictions(sa, 32).duplicated)


def test_no_mark_when_the_sender_says_it_needs_the_pages_again(make_server, closing) -> None:
    """SendDelta(no_duplicate_mark): the router sends the next turn back to the prefill engine,
    so the pages keep their priority although the receiver indexed them."""
    a, b, ka, kb, sa, sb, pools = _transfer(make_server, no_mark=True)
    closing((ka, kb, *pools))
    assert kb.match_prefix(tokens=TOKENS, page_size=4).best.matched_pages == 6  # the receiver holds them
    assert _dup(ka, sa) == 0
    sug = ka.suggest_evictions(sa, 32)
    assert not any(sug.duplicated) and set(sug.priorities) == {0}


def test_cleared_when_the_receiver_evicts(make_server, closing) -> None:
    a, b, ka, kb, sa, sb, pools = _transfer(make_server)
    closing((ka, kb, *pools))
    eventually(lambda: _dup(ka, sa) == 6, 5)
    kb.evict_pages(sb, [13])  # drops pages 13, 14, 15 (the tail below it)
    eventually(lambda: _dup(ka, sa) == 3, 5, "tail marks cleared by the periodic check")
    kb.evict_pages(sb, all=True)
    eventually(lambda: _dup(ka, sa) == 0, 5, "all marks cleared")
    eventually(lambda: ka.duplicate_events[-1] == (sa, 0), 5, "the engine is told")


def test_suggestion_rechecks_marks_at_once(make_server, closing) -> None:
    a, b, ka, kb, sa, sb, pools = _transfer(make_server, check_ms=3_600_000)
    closing((ka, kb, *pools))
    assert _dup(ka, sa) == 6
    kb.evict_pages(sb, all=True)
    sug = ka.suggest_evictions(sa, 32)  # verified with the receiver before answering
    assert not any(sug.duplicated) and _dup(ka, sa) == 0


def test_cleared_when_the_receiver_unregisters(make_server, closing) -> None:
    a, b, ka, kb, sa, sb, pools = _transfer(make_server)
    closing((ka, kb, *pools))
    eventually(lambda: _dup(ka, sa) == 6, 5)
    kb.unregister_buffers(sb)
    eventually(lambda: _dup(ka, sa) == 0, 5, "marks cleared after unregister")


def test_cleared_when_the_receiver_service_goes_away(make_server, closing) -> None:
    own = ServerThread(make_config(transport="loopback"))  # stopped here, not by the fixture
    a, b, ka, kb, sa, sb, pools = _transfer(make_server, b=own)
    closing((ka, *pools))
    eventually(lambda: _dup(ka, sa) == 6, 5)
    kb.close()
    b.stop()
    eventually(lambda: _dup(ka, sa) == 0, 10, "marks cleared after the receiver's service stopped")


def test_keep_policy_marks_without_lowering(make_server, closing) -> None:
    a, b, ka, kb, sa, sb, pools = _transfer(make_server, duplicate_policy="keep")
    closing((ka, kb, *pools))
    eventually(lambda: _dup(ka, sa) == 6, 5)
    sug = ka.suggest_evictions(sa, 32)
    assert set(sug.priorities) == {0} and sum(sug.duplicated) == 6


def test_suggestions_never_include_leased_pages_or_their_ancestors(make_server) -> None:
    srv = make_server(transport="loopback")
    with ShmKVPool.create(LAYOUT) as pool, Client(srv.address) as kc:
        bs = kc.register_buffers(LAYOUT, pool.k_regions, pool.v_regions).buffer_set_id
        base = np.arange(4 * 4)
        kc.publish_pages(bs, [0, 1, 2, 3], tokens=base)
        kc.publish_pages(bs, [0, 1, 6, 7], tokens=np.concatenate([base[:8], np.arange(70, 78)]))
        kc.publish_pages(bs, [9], tokens=np.arange(900, 904), priority=5)
        lease = kc.match_prefix(tokens=base, page_size=4, buffer_set_ids=[bs], lease_ttl_ms=60_000)
        sug = kc.suggest_evictions(bs, 32)
        assert set(sug.page_indices) == {6, 7, 9}  # 0..3 leased; 0, 1 are also ancestors of 6, 7
        assert sug.page_indices.index(7) < sug.page_indices.index(6)  # a leaf before its parent
        assert sug.page_indices[-1] == 9  # higher priority goes last
        kc.release_lease(lease.lease_id)
        assert set(kc.suggest_evictions(bs, 32).page_indices) == {0, 1, 2, 3, 6, 7, 9}
        assert len(kc.suggest_evictions(bs, 2).page_indices) == 2
        with pytest.raises(InvalidArgument, match="max_pages"):
            kc.suggest_evictions(bs, 0)
        with pytest.raises(NotFound):
            kc.suggest_evictions("no-such-set", 4)


def test_concurrent_checks_do_not_trip_over_each_other(make_server, closing) -> None:
    """The periodic check and SuggestEvictions' check may overlap; each mark is cleared once."""
    import asyncio

    a, b, ka, kb, sa, sb, pools = _transfer(make_server, check_ms=3_600_000)
    closing((ka, kb, *pools))
    assert _dup(ka, sa) == 6
    kb.evict_pages(sb, [13])
    book = a.node.transfers.duplicates

    async def both() -> None:
        await asyncio.gather(book.check(), book.check(sa), book.check())

    a.call(both())
    assert _dup(ka, sa) == 3
    assert ka.suggest_evictions(sa, 32).duplicated.count(True) == 3


def test_resending_a_prefix_marks_it_once_and_own_evictions_prune_the_mark(make_server, closing) -> None:
    a, b, ka, kb, sa, sb, pools = _transfer(make_server, check_ms=3_600_000)
    closing((ka, kb, *pools))
    book = a.node.transfers.duplicates
    # turn 2 of the conversation: the receiver holds the 6 pages, 2 new ones move
    turn2 = np.concatenate([TOKENS, np.arange(7000, 7008)])
    ka.publish_pages(sa, [*SRC, 6, 7], tokens=turn2)
    kb.expect_delta(
        "t2", sb, prefix_pages=6, dst_page_indices=[16, 17], publish_tokens=turn2, prefix_page_indices=DST
    )
    ka.send_delta("t2", sa, src_page_indices=[*SRC, 6, 7], peer_address=b.app.peer_address)
    assert {s.state for s in kb.wait("t2", timeout=20)} == {"DONE"}
    eventually(lambda: _dup(ka, sa) == 8, 5, "the 2 new pages join the mark")
    (mark,) = book.marks.values()
    assert mark.slots.size == 8  # not 6 + 8: one mark per receiver, each entry once
    ka.evict_pages(sa, [3])  # the sender evicts 3.. itself (pages 3, 4, 5, 6, 7)
    a.call(book.check())
    assert _dup(ka, sa) == 3 and book.marks[mark.mark_id].slots.size == 3


def test_a_duplicate_used_again_here_keeps_its_priority(make_server, closing) -> None:
    """Only duplicates idle on this side are lowered; a router's scores-only probe is no use."""
    a, b, ka, kb, sa, sb, pools = _transfer(make_server)
    closing((ka, kb, *pools))
    eventually(lambda: _dup(ka, sa) == 6, 5)
    ka.match_prefix(tokens=TOKENS, page_size=4, buffer_set_ids=[sa], scores_only=True)
    assert ka.suggest_evictions(sa, 32).priorities[:6] == (-1000,) * 6
    ka.match_prefix(tokens=TOKENS[:8], page_size=4, buffer_set_ids=[sa])  # the engine uses pages 0, 1
    sug = ka.suggest_evictions(sa, 32)
    prio = dict(zip(sug.page_indices, sug.priorities, strict=True))
    assert (prio[0], prio[1], prio[2], prio[5]) == (0, 0, -1000, -1000)
    assert all(sug.duplicated[sug.page_indices.index(p)] for p in SRC)
