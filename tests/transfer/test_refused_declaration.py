"""A refused declaration answers the sender that came first (``Receiver.refuse``).

An engine may post its room to the prefill beside its ExpectDelta rather than after it (the
SGLang backend does: the prefill then computes while the decode declares). When that ExpectDelta
is refused, the prefill's SendDelta is already waiting for a plan that will never come: its
service's plan request now fails at once with the receiver's reason, not at its deadline. Only
the sender the refused call named is told (any sender when it named none, as any could then
have fetched the plan); a later declaration of the id clears the refusal.
"""

from __future__ import annotations

import asyncio
import time
import types

import numpy as np
import pytest
from kvservice_client import KVClientError, Layout

from kvservice.errors import FailedPrecondition, NotFound
from kvservice.staging import StagingPool
from kvservice.transfer.receiver import Incoming, Receiver
from kvservice.transfer.records import Record, TransferTable
from tests.support.pools import assert_unchanged, snapshot
from tests.support.transfers import link, one

PAGES = 16
LAYOUT = Layout.mha(num_layers=2, page_size=4, num_pages=PAGES, total_kv_heads=2, head_dim=8, dtype="float16")


def test_a_sender_waiting_for_a_refused_declaration_fails_at_once_with_the_reason(
    make_server, make_pool, make_client
) -> None:
    sa, sb = (make_server(transport="loopback", same_host_route="off") for _ in range(2))
    lk = link((sa, sb), make_pool, make_client, LAYOUT)
    ka, kb, pb, a, b, peer, sender = lk.ka, lk.kb, lk.pb, lk.a, lk.b, lk.peer, sa.app.peer_address
    before = snapshot(pb)
    t0 = time.monotonic()
    # the prefill first (the room was posted beside the declaration), a 30 s deadline
    ka.send_delta("r", a, src_page_indices=[1, 2], peer_address=peer, deadline_ms=30_000)
    time.sleep(0.2)  # its plan request is waiting at the receiver
    with pytest.raises(KVClientError, match="dst_page_indices"):
        kb.expect_delta("r", b, prefix_pages=0, dst_page_indices=[3, PAGES + 7], sender_address=sender)
    s = one(ka, "r", timeout=10)
    assert s.state == "FAILED", s
    assert "refused the declaration" in s.error and "dst_page_indices" in s.error, s.error
    assert time.monotonic() - t0 < 10  # at once, not at its 30 s deadline
    assert_unchanged(pb, before)

    # declared after all, under the same id: the refusal is gone, a new send goes through
    kb.expect_delta("r", b, prefix_pages=0, dst_page_indices=[3, 4], sender_address=sender)
    ka.send_delta("r2", a, src_page_indices=[0], peer_address=peer)  # (warm: any id works)
    assert sb.app.node.transfers.receiver._refusal("r", sender) is None


# -- the receiver's rules, in-process --------------------------------------------------------------
def _receiver() -> Receiver:
    return Receiver(TransferTable(60.0), lambda _bs: StagingPool(1 << 20, "host"))


def _incoming(tid: str = "t") -> Incoming:
    bs = types.SimpleNamespace(buffer_set_id="d-bs", layout=LAYOUT)
    rec = Record(tid, "RECEIVER", "d-bs", "s", time.monotonic() + 30)
    empty = np.arange(0, dtype=np.int64)
    return Incoming(rec, bs, 0, np.arange(4, dtype=np.int64), {}, 0, None, empty)  # type: ignore[arg-type]


async def _plans(receiver: Receiver, tid: str, sender_address: str, wait_s: float) -> object:
    return await receiver.plans(tid, LAYOUT, "prefill", sender_address, wait_s, "")


def test_refuse_wakes_the_named_senders_waiting_plan_request() -> None:
    async def go() -> None:
        receiver = _receiver()
        waiting = asyncio.ensure_future(_plans(receiver, "t", "prefill:1", 30.0))
        await asyncio.sleep(0.01)
        receiver.refuse("t", "prefill:1", "dst_page_indices: out of range")
        with pytest.raises(FailedPrecondition, match="refused the declaration of 't': dst_page_indices"):
            await asyncio.wait_for(waiting, 2.0)

    asyncio.run(go())


def test_another_sender_is_not_told_and_waits_as_before() -> None:
    async def go() -> None:
        receiver = _receiver()
        receiver.refuse("t", "prefill:1", "no")
        with pytest.raises(NotFound, match="never declared"):
            await _plans(receiver, "t", "elsewhere:9", 0.05)

    asyncio.run(go())


def test_a_declaration_clears_the_refusal_and_a_live_one_is_never_refused() -> None:
    async def go() -> None:
        receiver = _receiver()
        receiver.refuse("t", "prefill:1", "no")
        await receiver.expect(_incoming("t"))
        assert receiver._refusal("t", "prefill:1") is None
        found = await _plans(receiver, "t", "prefill:1", 1.0)
        assert len(found) == 1  # type: ignore[arg-type]
        receiver.refuse("t", "prefill:1", "a duplicate ExpectDelta")  # the live declaration stays
        assert receiver._refusal("t", "prefill:1") is None

    asyncio.run(go())


def test_refusals_expire_and_are_bounded(monkeypatch) -> None:
    import kvservice.transfer.receiver as mod

    receiver = _receiver()
    monkeypatch.setattr(mod, "REFUSED_MAX", 3)
    for i in range(5):
        receiver.refuse(f"t{i}", "p", "no")
    assert [receiver._refusal(f"t{i}", "p") for i in range(5)] == [None, None, "no", "no", "no"]
    monkeypatch.setattr(mod, "REFUSED_KEEP_S", -1.0)
    receiver.refuse("old", "p", "no")
    assert receiver._refusal("old", "p") is None
    receiver.refuse("", "p", "no")
    assert receiver._refusal("", "p") is None


def test_a_refusal_naming_no_sender_answers_any_sender() -> None:
    """No sender named: any sender could have fetched the declaration's plan, so any is told."""
    receiver = _receiver()
    receiver.refuse("x", "", "no")
    assert receiver._refusal("x", "prefill:1") == receiver._refusal("x", "other:2") == "no"


def test_a_refusal_the_engine_may_retry_leaves_the_sender_waiting(
    make_server, make_pool, make_client
) -> None:
    """ResourceExhausted (here the per-session cap): the engine may declare again, so the waiting
    sender is not failed; the declaration that follows is sent to, DONE."""
    sa = make_server(transport="loopback", same_host_route="off")
    sb = make_server(transport="loopback", same_host_route="off", max_transfers_per_session=1)
    lk = link((sa, sb), make_pool, make_client, LAYOUT)
    ka, kb, a, b, peer, sender = lk.ka, lk.kb, lk.a, lk.b, lk.peer, sa.app.peer_address
    kb.expect_delta("busy", b, prefix_pages=0, dst_page_indices=[0], sender_address=sender)
    ka.send_delta("r", a, src_page_indices=[1], peer_address=peer, deadline_ms=30_000)
    with pytest.raises(KVClientError, match="max_transfers_per_session"):
        kb.expect_delta("r", b, prefix_pages=0, dst_page_indices=[5], sender_address=sender)
    assert sb.app.node.transfers.receiver._refusal("r", sender) is None
    kb.abort("busy", "make room")
    kb.expect_delta("r", b, prefix_pages=0, dst_page_indices=[5], sender_address=sender)
    assert one(kb, "r").state == one(ka, "r").state == "DONE"
