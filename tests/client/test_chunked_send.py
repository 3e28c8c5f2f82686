"""BackgroundClient.chunked: a transfer's chunks handed over from an engine thread (one call at a time),
the receiver gets every page, and ``done`` ends with the transfer's terminal status."""

from __future__ import annotations

from kvservice_client import BackgroundClient, Layout, ShmKVPool

from tests.support.poll import eventually

LAYOUT = Layout.mha(num_layers=2, page_size=4, num_pages=16, total_kv_heads=2, head_dim=8, dtype="float16")


def _run(server, declare_first: bool) -> None:
    with (
        ShmKVPool.create(LAYOUT) as src,
        ShmKVPool.create(LAYOUT) as dst,
        BackgroundClient(server.address, client_name="chunked") as bg,
    ):
        for p in range(8):
            src.k(0)[p] = p + 1
            src.v(1)[p] = 100 + p
        a = bg.call(bg.kv.register_buffers(LAYOUT, src.k_regions, src.v_regions, engine_id="p"))
        b = bg.call(bg.kv.register_buffers(LAYOUT, dst.k_regions, dst.v_regions, engine_id="d"))

        def declare():
            return bg.transfer(
                "cs-1",
                lambda kv: kv.expect_delta(
                    "cs-1", b.buffer_set_id, prefix_pages=0, dst_page_indices=range(8, 16)
                ),
                10_000,
            )

        if declare_first:  # declared before the first chunk (the lane takes them)
            recv = declare()
            eventually(lambda: bg.call(bg.kv.poll(["cs-1"])), 30, "the declaration", interval=0.005)
        send = bg.chunked("cs-1", 10_000)
        peer = server.app.peer_address
        for i in range(4):
            pages = [2 * i, 2 * i + 1]
            send.send(
                lambda kv, off=2 * i, pg=pages, last=i == 3: kv.send_delta(
                    "cs-1", a.buffer_set_id, src_page_indices=pg, peer_address=peer, chunk_offset=off,
                    last_chunk=last, deadline_ms=10_000,
                ),
                i == 3,
            )  # fmt: skip
        if not declare_first:
            recv = declare()
        assert send.done.result(20).state == "DONE"
        assert recv.result(20).state == "DONE"
        for p in range(8):
            assert (dst.k(0)[8 + p] == p + 1).all() and (dst.v(1)[8 + p] == 100 + p).all(), p
        assert (dst.k(0)[:8] == 0).all()


def test_chunks_queued_before_the_receiver_declares_all_land(server) -> None:
    """Four chunks queued at once before the receiver declares: the first waits for the plan, the
    rest follow; every page lands, done is DONE."""
    _run(server, declare_first=False)


def test_chunks_queued_back_to_back_after_the_receiver_declared_all_land(server) -> None:
    """The same with the receiver declared first (the chunks take the lane, which needs them in
    order)."""
    _run(server, declare_first=True)
