"""End to end across processes: ``python -m kvservice`` services (NIXL over UCX on DRAM, the CPU
default) and engine processes that own their shm KV pools and talk to their local service.

    test process ── pipe ──▶ engine A ─UDS─▶ service A ═NIXL═▶ service B ◀─UDS─ engine B
                                                  (C, D: victims killed with SIGKILL)
    engine E ─UDS─▶ service E ══ maps F's pools, copies page to page ══▶ engine F's pool

A-D run with same_host_route=off (the cross-node path, as between two hosts); E and F with the
default, so E's transfers to F take the same-host fused route.

The test maps each engine's pool read-only-in-spirit to check bytes and canaries.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from kvservice_client import Layout

from kvservice.transfer.peer_channel import IDLE_RETURN_S
from tests.support.engines import EngineProc
from tests.support.poll import eventually
from tests.support.pools import assert_pages_equal, assert_unchanged, snapshot
from tests.support.services import ServiceProc, admin_stats

LAYOUT = Layout.mha(num_layers=2, page_size=4, num_pages=64, total_kv_heads=2, head_dim=16, dtype="bfloat16")
AUX = {"meta": (64, 32)}


@pytest.fixture(scope="module")
def nodes() -> Iterator[dict[str, Any]]:
    """Services A, B (survivors), C, D (victims) and their engines, all started in parallel."""
    svcs = {n: ServiceProc(n, "--same-host-route", "off") for n in "ABCD"}
    svcs |= {n: ServiceProc(n) for n in "EF"}
    engines: dict[str, EngineProc] = {}
    try:
        for s in svcs.values():
            s.wait_ready()
        plan = {"A": "A", "B": "B", "Ak": "A", "Bk": "B", "C": "C", "D": "D", "E": "E", "F": "F"}
        for i, (name, svc) in enumerate(plan.items()):
            engines[name] = EngineProc(svcs[svc].address, LAYOUT, AUX, seed=i + 1)
        for e in engines.values():
            e.ready()
        yield {"svc": svcs, "eng": engines}
    finally:
        for e in engines.values():
            e.stop()
        for s in svcs.values():
            s.stop()


def wait_eng(eng: EngineProc, tid: str, timeout: float = 10.0) -> Any:
    """The one record of ``tid`` on ``eng``, once terminal."""
    last: list[Any] = []

    def terminal() -> Any:
        sts = eng.call("poll", [tid])
        last[:] = sts or []
        return sts if sts and all(s.terminal for s in sts) else None

    sts = eventually(terminal, timeout, lambda: f"{tid} terminal (last: {last})", interval=0.02)
    assert len(sts) == 1, sts
    return sts[0]


def stats(svc: ServiceProc) -> Any:
    return admin_stats(svc.address)


def test_multi_turn_session_over_nixl(nodes) -> None:
    """Turns over NIXL (direct, packed, auto, then a full hit with aux): only the delta moves."""
    a, b = nodes["eng"]["A"], nodes["eng"]["B"]
    peer = nodes["svc"]["B"].address
    page = LAYOUT.page_bytes_all_layers
    src_seq: list[int] = []
    dst_seq: list[int] = []
    rng = np.random.default_rng(3)
    src_free, dst_free = list(rng.permutation(64)), list(rng.permutation(64))
    for turn, (n, path) in enumerate([(5, "direct"), (11, "packed"), (20, "auto")]):
        src_seq += [int(src_free.pop()) for _ in range(n - len(src_seq))]
        new = [int(dst_free.pop()) for _ in range(n - len(dst_seq))]
        prefix = len(dst_seq)
        before = snapshot(b.pool)
        tid = f"nixl-{turn}"
        b.call("expect_delta", tid, b.bs, prefix_pages=prefix, dst_page_indices=new, deadline_ms=20_000)
        half = n // 2  # two chunks
        a.call(
            "send_delta",
            tid,
            a.bs,
            src_page_indices=src_seq[:half],
            peer_address=peer,
            last_chunk=False,
            path=path,
        )
        a.call(
            "send_delta",
            tid,
            a.bs,
            src_page_indices=src_seq[half:],
            chunk_offset=half,
            peer_address=peer,
            path=path,
        )
        r, s = wait_eng(b, tid), wait_eng(a, tid)
        for st in (r, s):
            assert st.state == "DONE", st
            assert (st.pages_sent, st.pages_skipped, st.bytes_sent) == (
                n - prefix,
                prefix,
                (n - prefix) * page,
            ), st
        assert_pages_equal(b.pool, new, a.pool, src_seq[prefix:])
        assert_unchanged(b.pool, before, except_pages=new)
        dst_seq += new
    # next turn: the decode side already holds everything; only aux rows move
    before = snapshot(b.pool)
    b.call("expect_delta", "nixl-hit", b.bs, prefix_pages=20, dst_page_indices=[], aux={"meta": [3]})
    a.call("send_delta", "nixl-hit", a.bs, src_page_indices=src_seq, peer_address=peer, aux={"meta": [30]})
    r = wait_eng(b, "nixl-hit")
    assert (r.state, r.pages_sent, r.pages_skipped) == ("DONE", 0, 20), r
    assert wait_eng(a, "nixl-hit").state == "DONE"
    assert np.array_equal(b.pool.aux("meta")[3], a.pool.aux("meta")[30])
    assert_unchanged(b.pool, before[:-1] + [b.pool.aux("meta").copy()])
    assert_pages_equal(b.pool, dst_seq, a.pool, src_seq)


def test_receiver_service_killed_mid_transfer(nodes) -> None:
    """SIGKILL the receiver's service mid-transfer: the sender ends FAILED with a reason by its deadline;
    its staging is free and the sender engine's unregistration leaves no buffer set behind."""
    a, c = nodes["eng"]["Ak"], nodes["eng"]["C"]
    svc_a, svc_c = nodes["svc"]["A"], nodes["svc"]["C"]
    c.call(
        "expect_delta",
        "kill-rx",
        c.bs,
        prefix_pages=0,
        dst_page_indices=list(range(10, 30)),
        deadline_ms=20_000,
    )
    t0 = time.monotonic()
    a.call(
        "send_delta",
        "kill-rx",
        a.bs,
        src_page_indices=list(range(10)),
        peer_address=svc_c.address,
        last_chunk=False,
        path="packed",
        deadline_ms=3000,
    )
    eventually(lambda: a.call("poll", ["kill-rx"])[0].pages_sent == 10, 10, "first chunk moved")
    svc_c.kill()
    a.call(
        "send_delta",
        "kill-rx",
        a.bs,
        src_page_indices=list(range(10, 20)),
        chunk_offset=10,
        peer_address=svc_c.address,
        path="packed",
    )
    s = wait_eng(a, "kill-rx", timeout=6)
    assert s.state == "FAILED" and s.error_code in ("UNAVAILABLE", "DEADLINE_EXCEEDED") and s.error, s
    assert time.monotonic() - t0 < 3.0 + 1.0
    st = stats(svc_a)
    assert all(p.slots_in_use == 0 for p in st.staging), st.staging
    a.call("unregister_buffers", a.bs)
    assert a.bs not in [x.buffer_set_id for x in stats(svc_a).buffer_sets]


def test_sender_service_killed_mid_transfer(nodes) -> None:
    """SIGKILL the sender's service mid-transfer: the receiver notices when the sender's peer channel
    ends and fails the transfer UNAVAILABLE with the reason — seconds before its 20 s deadline —; no
    staging slot stays reserved, no later byte lands, and unregistration leaves nothing behind."""
    d, b = nodes["eng"]["D"], nodes["eng"]["Bk"]
    svc_b, svc_d = nodes["svc"]["B"], nodes["svc"]["D"]
    b.call(
        "expect_delta", "kill-tx", b.bs, prefix_pages=0, dst_page_indices=list(range(30)), deadline_ms=20_000
    )
    d.call(
        "send_delta",
        "kill-tx",
        d.bs,
        src_page_indices=list(range(10)),
        peer_address=svc_b.address,
        last_chunk=False,
        path="packed",
    )
    eventually(lambda: b.call("poll", ["kill-tx"])[0].pages_sent == 10, 10, "first chunk landed")
    t0 = time.monotonic()
    svc_d.kill()
    after_kill = snapshot(b.pool)
    r = wait_eng(b, "kill-tx", timeout=10)
    assert (r.state, r.error_code) == ("FAILED", "UNAVAILABLE") and "channel" in r.error, r
    assert time.monotonic() - t0 < 5.0  # the channel's end, not the deadline
    assert_unchanged(b.pool, after_kill)
    # NOTE: another service's channel to B (an earlier test's sender) may hold credit slots for up
    # to IDLE_RETURN_S after its last use, or be granted the slots D's channel freed; both give
    # them back idle. What must not happen is a slot that stays reserved.
    eventually(
        lambda: all(p.slots_in_use == 0 for p in stats(svc_b).staging),
        3 * IDLE_RETURN_S + 2,
        "B's staging slots all free again",
    )
    b.call("unregister_buffers", b.bs)
    assert b.bs not in [x.buffer_set_id for x in stats(svc_b).buffer_sets]


def test_same_host_services_take_the_fused_route(nodes) -> None:
    """Two service processes on this host: E maps F's engine pool and copies page to page (FUSED),
    aux rows included; an abort mid-transfer stops every write (canaries); E -> B (route off on B)
    goes through NIXL and says why."""
    e, f, b = nodes["eng"]["E"], nodes["eng"]["F"], nodes["eng"]["B"]
    peer_f = nodes["svc"]["F"].address
    before = snapshot(f.pool)
    f.call("expect_delta", "sh-1", f.bs, prefix_pages=2, dst_page_indices=[40, 41, 42], aux={"meta": [5]})
    e.call(
        "send_delta", "sh-1", e.bs, src_page_indices=[1, 2, 3, 4, 5], peer_address=peer_f, aux={"meta": [9]}
    )
    r, s = wait_eng(f, "sh-1", timeout=60), wait_eng(e, "sh-1")  # the first copy may wait for the JIT
    assert (r.state, s.state, r.path, s.path, s.route_note) == ("DONE", "DONE", "FUSED", "FUSED", ""), (r, s)
    assert (s.pages_sent, s.pages_skipped) == (3, 2), s
    assert_pages_equal(f.pool, [40, 41, 42], e.pool, [3, 4, 5])
    assert np.array_equal(f.pool.aux("meta")[5], e.pool.aux("meta")[9])
    assert_unchanged(f.pool, before[:-1] + [f.pool.aux("meta").copy()], except_pages=[40, 41, 42])
    # abort mid-transfer: chunks keep coming, the receiver aborts, nothing lands after the ack
    f.call(
        "expect_delta", "sh-ab", f.bs, prefix_pages=0, dst_page_indices=list(range(64)), deadline_ms=20_000
    )
    for off in range(0, 48, 8):
        e.call(
            "send_delta",
            "sh-ab",
            e.bs,
            src_page_indices=list(range(off, off + 8)),
            chunk_offset=off,
            peer_address=peer_f,
            last_chunk=False,
        )
    f.call("abort", "sh-ab", reason="decode gave up")
    at_ack = snapshot(f.pool)
    s = wait_eng(e, "sh-ab")
    assert s.state == "ABORTED" and "decode gave up" in s.error, s
    time.sleep(0.2)
    assert_unchanged(f.pool, at_ack)
    # a receiver whose service has the route off: NIXL carries the pages, the note says why
    b.call("expect_delta", "sh-off", b.bs, prefix_pages=0, dst_page_indices=[50, 51])
    e.call("send_delta", "sh-off", e.bs, src_page_indices=[6, 7], peer_address=nodes["svc"]["B"].address)
    s = wait_eng(e, "sh-off")
    assert s.state == "DONE" and s.path != "FUSED" and "same_host_route is 'off'" in s.route_note, s
    assert_pages_equal(b.pool, [50, 51], e.pool, [6, 7])
