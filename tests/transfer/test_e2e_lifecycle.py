"""End to end (loopback): aborts from either side, WatchTransfers / Poll, and the owner going away.

After an abort is acknowledged no byte may change in the receiver's pages: we snapshot at the
acknowledgement, let in-flight work settle, and compare.
"""

from __future__ import annotations

import queue
import threading
import time

import pytest
from kvservice_client import FailedPrecondition, Layout, NotFound

from tests.support.poll import eventually
from tests.support.pools import assert_unchanged, snapshot
from tests.support.transfers import link, one, staging_idle, wait_all

BIG = Layout.mha(num_layers=4, page_size=8, num_pages=512, total_kv_heads=2, head_dim=64, dtype="float16")


def test_receiver_abort_before_sender_starts(pair, make_pool, make_client) -> None:
    """Receiver aborts a declared transfer; the sender that comes later ends ABORTED; nothing written."""
    ln = link(pair, make_pool, make_client)
    before = snapshot(ln.pb)
    ln.kb.expect_delta("ra", ln.b, prefix_pages=0, dst_page_indices=[1, 2])
    acked = ln.kb.abort("ra", reason="decode preempted")
    assert [(s.role, s.state) for s in acked] == [("RECEIVER", "ABORTED")], acked
    assert "decode preempted" in acked[0].error
    ln.ka.send_delta("ra", ln.a, src_page_indices=[3, 4], peer_address=ln.peer, deadline_ms=2000)
    s = one(ln.ka, "ra", timeout=3)
    assert s.state == "ABORTED" and s.error_code == "ABORTED" and "ABORTED" in s.error, s
    assert_unchanged(ln.pb, before)


@pytest.mark.parametrize("path", ["direct", "packed"])
@pytest.mark.parametrize("side", ["receiver", "sender"])
def test_abort_mid_transfer_stops_every_write(pair, make_pool, make_client, side, path) -> None:
    """Chunks queued and moving; abort from one side: both ABORTED with reasons, no byte after the ack."""
    ln = link(pair, make_pool, make_client, layout=BIG)
    n = 480
    dst = list(range(n))
    ln.kb.expect_delta("mid", ln.b, prefix_pages=0, dst_page_indices=dst, deadline_ms=20_000)
    step = 16
    for off in range(0, n - step, step):  # every chunk but the last: the transfer stays open
        ln.ka.send_delta(
            "mid",
            ln.a,
            src_page_indices=list(range(off, off + step)),
            chunk_offset=off,
            peer_address=ln.peer,
            last_chunk=False,
            path=path,
        )
    me, other = (ln.kb, ln.ka) if side == "receiver" else (ln.ka, ln.kb)
    acked = me.abort("mid", reason=f"{side} gave up")
    assert all(s.state == "ABORTED" for s in acked) and acked, acked
    at_ack = snapshot(ln.pb)
    o = one(other, "mid", timeout=5)
    assert o.state == "ABORTED" and f"{side} gave up" in o.error, o
    time.sleep(0.2)  # anything still in flight would land now
    assert_unchanged(ln.pb, at_ack)
    with pytest.raises(FailedPrecondition):
        ln.ka.send_delta("mid", ln.a, src_page_indices=[500], chunk_offset=n - step, peer_address=ln.peer)
    assert_unchanged(ln.pb, at_ack)
    eventually(lambda: staging_idle(pair[0]) and staging_idle(pair[1]), 3, "staging slots released")


def test_abort_unknown_transfer_not_found(pair, make_pool, make_client) -> None:
    """Abort of a transfer this client does not have: NOT_FOUND."""
    ln = link(pair, make_pool, make_client)
    with pytest.raises(NotFound, match="nope"):
        ln.kb.abort("nope")


def test_watch_sees_pending_transferring_done(pair, make_pool, make_client) -> None:
    """WatchTransfers streams PENDING, TRANSFERRING and DONE of the receiver and the sender."""
    ln = link(pair, make_pool, make_client)
    seen: dict[str, queue.Queue] = {"RECEIVER": queue.Queue(), "SENDER": queue.Queue()}

    def watch(kv, role):
        for st in kv.watch(["w"]):
            seen[role].put(st.state)
            if st.terminal:
                return

    threads = [
        threading.Thread(target=watch, args=(kv, r), daemon=True)
        for kv, r in ((ln.kb, "RECEIVER"), (ln.ka, "SENDER"))
    ]
    for t in threads:
        t.start()
    time.sleep(0.1)  # watchers subscribed before the transfer exists
    ln.kb.expect_delta("w", ln.b, prefix_pages=1, dst_page_indices=[4, 5, 6])
    ln.ka.send_delta("w", ln.a, src_page_indices=[0, 1], peer_address=ln.peer, last_chunk=False)
    eventually(lambda: ln.kb.poll(["w"])[0].state == "TRANSFERRING", 3, "receiver TRANSFERRING")
    ln.ka.send_delta("w", ln.a, src_page_indices=[2, 3], chunk_offset=2, peer_address=ln.peer)
    for t in threads:
        t.join(5)
        assert not t.is_alive()
    for role, q in seen.items():
        states = list(q.queue)
        assert states[0] == "PENDING" and "TRANSFERRING" in states and states[-1] == "DONE", (role, states)
        order = [states.index(s) for s in ("PENDING", "TRANSFERRING", "DONE")]
        assert order == sorted(order), (role, states)


def test_poll_is_batched_and_per_session(pair, make_pool, make_client) -> None:
    """One Poll returns several transfers (all of the client's with no ids); other clients see none."""
    ln = link(pair, make_pool, make_client)
    for i in range(3):
        ln.kb.expect_delta(f"p{i}", ln.b, prefix_pages=0, dst_page_indices=[10 + i])
        ln.ka.send_delta(f"p{i}", ln.a, src_page_indices=[i], peer_address=ln.peer)
    for i in range(3):
        one(ln.kb, f"p{i}")
    got = ln.kb.poll(["p0", "p2", "absent"])
    assert sorted(s.transfer_id for s in got) == ["p0", "p2"]
    assert sorted(s.transfer_id for s in ln.kb.poll()) == ["p0", "p1", "p2"]
    assert all(s.state == "DONE" and s.role == "RECEIVER" for s in ln.kb.poll())
    assert make_client(pair[1]).poll() == []


def test_closing_owning_client_aborts_its_transfers(pair, make_pool, make_client) -> None:
    """Receiver engine's client closes mid-transfer: the sender ends ABORTED; its buffer set is gone."""
    ln = link(pair, make_pool, make_client)
    ln.kb.expect_delta("gone", ln.b, prefix_pages=0, dst_page_indices=[1, 2, 3], deadline_ms=10_000)
    ln.ka.send_delta("gone", ln.a, src_page_indices=[4], peer_address=ln.peer, last_chunk=False)
    eventually(lambda: ln.ka.poll(["gone"])[0].pages_sent == 1, 3, "first chunk moved")
    ln.kb.close()
    s = one(ln.ka, "gone", timeout=5)
    assert s.state == "ABORTED" and "went away" in s.error, s
    node = pair[1].app.node
    eventually(
        lambda: ln.b not in [b.buffer_set_id for b in node.buffers.all()], 3, "receiver's buffer set released"
    )
    eventually(lambda: staging_idle(pair[0]) and staging_idle(pair[1]), 3, "staging slots released")


@pytest.mark.parametrize("side", ["receiver", "sender"])
def test_unregister_buffers_aborts_transfers_using_them(pair, make_pool, make_client, side) -> None:
    """UnregisterBuffers mid-transfer aborts it on both sides and reports how many it aborted."""
    ln = link(pair, make_pool, make_client)
    ln.kb.expect_delta("unreg", ln.b, prefix_pages=0, dst_page_indices=[1, 2, 3], deadline_ms=10_000)
    ln.ka.send_delta("unreg", ln.a, src_page_indices=[4], peer_address=ln.peer, last_chunk=False)
    eventually(lambda: ln.kb.poll(["unreg"])[0].pages_sent == 1, 3, "first chunk moved")
    me, bs, other = (ln.kb, ln.b, ln.ka) if side == "receiver" else (ln.ka, ln.a, ln.kb)
    before = snapshot(ln.pb)
    resp = me.unregister_buffers(bs)
    assert resp.transfers_aborted == 1
    mine = wait_all(me, "unreg", timeout=3)[0]
    theirs = one(other, "unreg", timeout=5)
    assert mine.state == "ABORTED" and "unregistered" in mine.error, mine
    assert theirs.state == "ABORTED" and "unregistered" in theirs.error, theirs
    assert_unchanged(ln.pb, before)
    svc = pair[1] if side == "receiver" else pair[0]
    assert bs not in [b.buffer_set_id for b in svc.app.node.buffers.all()]
