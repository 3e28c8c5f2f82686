"""Cross-engine transfers through the service: pools of different page sizes and page layouts.

An SGLang-shaped pool (NHD, separate K and V, page 1 or 64) and a vLLM-shaped pool (the CPU
attention backend's ``[blocks, heads, block_size, K | V]``, block 16 or 32; HND planes; or
FlashInfer's ``[blocks, 2, block_size, heads, dim]``, NHD or HND, K and V side by side; or vLLM
0.32's GPU ``[blocks, heads, block_size, K|V]`` in LBNHC / LBHNC order) hold
the same model's KV. The receiver already has a prefix of the sequence; the sender sends all its
pages; afterwards every token of the delta is in the receiver's pages, head for head, byte for
byte, and no byte outside the named pages changed. On every route (two services, same host
fused, same service) and path (AUTO, PACKED), with mixed TP.

The check reads each pool back as canonical per-token rows through its own byte order, written
here independently of the kernels.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from kvservice_client import Layout, ShmKVPool

from tests.support.pools import assert_unchanged, fill_random, rank_heads, snapshot
from tests.support.transfers import fused_pair, wait_all

L, H, D = 2, 4, 16  # layers, KV heads, head dim (float16: 32-byte head rows)
T = 100  # tokens in the sequence
PREFIX_TOKENS = 32  # the receiver's prefix-cache hit (whole receiver pages)


def layout(page_layout: str, page: int, pages: int, tp: int = 1, rank: int = 0) -> Layout:
    return Layout.mha(
        num_layers=L,
        page_size=page,
        num_pages=pages,
        total_kv_heads=H,
        head_dim=D,
        dtype="float16",
        tp_size=tp,
        tp_rank=rank,
        page_layout=page_layout,  # type: ignore[arg-type]
    )


def tokens_view(pool: ShmKVPool) -> np.ndarray:
    """``[L, 2 (K, V), num_pages * page, local heads, head bytes]``: a copy in token order."""
    lay = pool.layout
    n, p, h, hb = lay.num_pages, lay.page_size, lay.local_kv_heads, lay.head_dim_k * lay.itemsize
    out = np.empty((L, 2, n * p, h, hb), dtype=np.uint8)
    for layer in range(L):
        if lay.page_layout == "hnd_kv":
            blk = pool.k(layer).reshape(n, h, 2 * p, hb)
            parts = [blk[:, :, :p], blk[:, :, p:]]
        elif lay.page_layout in ("kv_nhd", "kv_hnd"):  # [blocks, 2, ...]: K half, V half
            blk = pool.k(layer).reshape(n, 2, -1)
            parts = [blk[:, 0], blk[:, 1]]
        elif lay.page_layout in ("nhc", "hnc"):  # [blocks, (tokens, heads), K|V]: a row's halves
            blk = pool.k(layer).reshape(n, p * h, 2, hb)
            parts = [blk[:, :, 0], blk[:, :, 1]]
        else:
            parts = [pool.k(layer), pool.v(layer)]
        for kv, x in enumerate(parts):
            if lay.page_layout in ("nhd", "kv_nhd", "nhc"):
                x = x.reshape(n, p, h, hb)
            else:
                x = x.reshape(n, h, p, hb).transpose(0, 2, 1, 3)
            out[layer, kv] = x.reshape(n * p, h, hb)
    return out


def seq_tokens(view: np.ndarray, pages: np.ndarray, page: int) -> np.ndarray:
    """The sequence's tokens held in ``pages`` (in order): ``[L, 2, len * page, heads, hb]``."""
    idx = (pages[:, None] * page + np.arange(page)[None, :]).reshape(-1)
    return view[:, :, idx]


SHAPES = {
    # sender (layout, page), receiver (layout, page)
    "sglang1-to-vllmcpu16": (("nhd", 1), ("hnd_kv", 16)),
    "sglang64-to-vllmcpu32": (("nhd", 64), ("hnd_kv", 32)),
    "vllmcpu16-to-sglang1": (("hnd_kv", 16), ("nhd", 1)),
    "vllm-hnd16-to-sglang64": (("hnd", 16), ("nhd", 64)),
    "flashinfer-nhd16-to-sglang1": (("kv_nhd", 16), ("nhd", 1)),
    "flashinfer-hnd16-to-sglang64": (("kv_hnd", 16), ("nhd", 64)),
    "sglang1-to-flashinfer-nhd16": (("nhd", 1), ("kv_nhd", 16)),
    "sglang64-to-flashinfer-hnd32": (("nhd", 64), ("kv_hnd", 32)),
    "vllm032-nhc16-to-sglang1": (("nhc", 16), ("nhd", 1)),
    "sglang64-to-vllm032-hnc16": (("nhd", 64), ("hnc", 16)),
}
SAME = {
    "vllmcpu32-to-vllmcpu32": (("hnd_kv", 32), ("hnd_kv", 32)),
    "hnd16-to-hnd16": (("hnd", 16), ("hnd", 16)),
    "flashinfer-hnd16-to-flashinfer-hnd16": (("kv_hnd", 16), ("kv_hnd", 16)),
    "vllm032-nhc16-to-vllm032-nhc16": (("nhc", 16), ("nhc", 16)),
}


def run_convert(
    pair, make_pool, make_client, shape: str, path: str, tid: str, src_tp: int = 1, dst_tp: int = 1
):  # type: ignore[no-untyped-def]
    (sl, ps), (dl, pr) = {**SHAPES, **SAME}[shape]
    sa, sb = pair
    prefix = math.ceil(PREFIX_TOKENS / pr)  # receiver pages it already holds
    n_src, n_dst = math.ceil(T / ps), math.ceil(T / pr)
    rng = np.random.default_rng(5)
    src_pages = rng.permutation(n_src + 7)[:n_src].astype(np.int64)
    dst_all = rng.permutation(n_dst + 9)[:n_dst].astype(np.int64)  # the receiver's whole sequence
    senders, receivers = [], []
    for rank in range(src_tp):
        pool = make_pool(layout(sl, ps, n_src + 7, src_tp, rank))
        fill_random(pool, 10 + rank)
        kv = make_client(sa)
        bs = kv.register_buffers(pool.layout, pool.k_regions, pool.v_regions).buffer_set_id
        senders.append((kv, pool, bs))
    for rank in range(dst_tp):
        pool = make_pool(layout(dl, pr, n_dst + 9, dst_tp, rank))
        fill_random(pool, 20 + rank)
        kv = make_client(sb)
        bs = kv.register_buffers(pool.layout, pool.k_regions, pool.v_regions).buffer_set_id
        receivers.append((kv, pool, bs))
    before = [snapshot(pool) for _, pool, _ in receivers]
    for kv, _, bs in receivers:
        kv.expect_delta(tid, bs, prefix_pages=prefix, dst_page_indices=dst_all[prefix:])
    half = n_src // 2
    for kv, _, bs in senders:  # two chunks, the first ending mid-sequence
        kv.send_delta(
            tid,
            bs,
            src_page_indices=src_pages[:half],
            peer_address=sb.app.peer_address,
            last_chunk=False,
            path=path,
        )
        kv.send_delta(
            tid,
            bs,
            src_page_indices=src_pages[half:],
            chunk_offset=half,
            peer_address=sb.app.peer_address,
            path=path,
        )
    sts = [wait_all(kv, tid)[0] for kv, _, _ in receivers + senders]
    assert [s.state for s in sts] == ["DONE"] * len(sts), sts
    if fused_pair(pair) and path == "auto":  # both pools mapped by the sender: one fused copy
        assert {s.path for s in sts} == {"FUSED"} and not any(s.route_note for s in sts), sts
    elif not fused_pair(pair) and (sl, ps) != (dl, pr):
        assert {s.path for s in sts} == {"PACKED"}, sts  # DIRECT cannot convert
    elif not fused_pair(pair) and path == "direct":
        assert {s.path for s in sts} == {"DIRECT"}, sts
    for st in sts[: len(receivers)]:  # the receiver counts its own pages, whatever the sender's size
        assert st.pages_sent == n_dst - prefix and st.pages_skipped <= prefix, st
    # Every head of the delta's tokens, from whichever sender rank holds it.
    want = np.concatenate(
        [seq_tokens(tokens_view(pool), src_pages, ps) for _, pool, _ in senders], axis=3
    )  # [L, 2, n_src*ps, heads of all sender ranks in rank order, hb]
    owner = np.concatenate([rank_heads(H, src_tp, r) for r in range(src_tp)])
    for (_, pool, _), snap in zip(receivers, before, strict=True):
        lay = pool.layout
        heads = rank_heads(H, dst_tp, lay.tp_rank)
        cols = [int(np.flatnonzero(owner == h)[0]) for h in heads]
        got = seq_tokens(tokens_view(pool), dst_all, pr)
        delta = slice(prefix * pr, T)
        assert np.array_equal(got[:, :, delta], want[:, :, delta][:, :, :, cols]), (
            f"rank {lay.tp_rank}: tokens differ"
        )
        assert_unchanged(pool, snap, except_pages=dst_all[prefix:])
    return sts


@pytest.mark.parametrize("path", ["auto", "packed"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_cross_engine_delta_lands_token_for_token(
    pair, make_pool, make_client, shape: str, path: str
) -> None:  # type: ignore[no-untyped-def]
    run_convert(pair, make_pool, make_client, shape, path, f"x-{shape}-{path}")


@pytest.mark.parametrize("path", ["auto", "packed", "direct"])
@pytest.mark.parametrize("shape", sorted(SAME))
def test_head_major_pools_of_one_layout_move_as_pages(
    pair, make_pool, make_client, shape: str, path: str
) -> None:  # type: ignore[no-untyped-def]
    """Same page layout and size on both sides: nothing converts, pages move whole (DIRECT too)."""
    run_convert(pair, make_pool, make_client, shape, path, f"s-{shape}-{path}")


@pytest.mark.parametrize(
    "shape",
    [
        "sglang1-to-vllmcpu16",
        "flashinfer-hnd16-to-sglang64",
        "sglang1-to-flashinfer-nhd16",
        "vllm032-nhc16-to-sglang1",
        "sglang64-to-vllm032-hnc16",
    ],
)
@pytest.mark.parametrize("src_tp,dst_tp", [(2, 1), (1, 2), (4, 2)])
def test_cross_engine_mixed_tp(pair, make_pool, make_client, src_tp: int, dst_tp: int, shape: str) -> None:  # type: ignore[no-untyped-def]
    run_convert(pair, make_pool, make_client, shape, "auto", f"xtp-{shape}-{src_tp}-{dst_tp}", src_tp, dst_tp)


def test_direct_is_refused_across_layouts(pair, make_pool, make_client) -> None:  # type: ignore[no-untyped-def]
    sa, sb = pair
    src = make_pool(layout("nhd", 1, 120))
    dst = make_pool(layout("hnd_kv", 16, 10))
    ka, kb = make_client(sa), make_client(sb)
    a = ka.register_buffers(src.layout, src.k_regions, src.v_regions).buffer_set_id
    b = kb.register_buffers(dst.layout, dst.k_regions, dst.v_regions).buffer_set_id
    kb.expect_delta("xd", b, prefix_pages=0, dst_page_indices=[3])
    ka.send_delta("xd", a, src_page_indices=list(range(16)), peer_address=sb.app.peer_address, path="direct")
    st = wait_all(ka, "xd")[0]
    if sa is sb or sa.app.node.config.transfer.same_host_route == "auto":
        assert st.state == "DONE"  # both pools mapped: DIRECT is not a route there (FUSED)
        return
    assert st.state == "FAILED" and "page size or page layout" in st.error, st


def test_sender_overrunning_the_receiver_fails_clearly(pair, make_pool, make_client) -> None:  # type: ignore[no-untyped-def]
    """Units past the receiver's room are only dropped inside the sender's final page; a whole
    extra sender page is an error naming both page sizes."""
    sa, sb = pair
    src = make_pool(layout("nhd", 64, 4))
    dst = make_pool(layout("hnd_kv", 16, 8))
    ka, kb = make_client(sa), make_client(sb)
    a = ka.register_buffers(src.layout, src.k_regions, src.v_regions).buffer_set_id
    b = kb.register_buffers(dst.layout, dst.k_regions, dst.v_regions).buffer_set_id
    kb.expect_delta("xo", b, prefix_pages=0, dst_page_indices=[0, 1, 2, 3])  # 64 tokens of room
    ka.send_delta("xo", a, src_page_indices=[0, 1], peer_address=sb.app.peer_address)  # 128 tokens
    st = wait_all(ka, "xo")[0]
    assert st.state == "FAILED" and "receiver declared 0 prefix + 4 destination pages" in st.error, st
    assert wait_all(kb, "xo")[0].state in ("FAILED", "ABORTED")


def test_incompatible_rows_are_refused(pair, make_pool, make_client) -> None:  # type: ignore[no-untyped-def]
    sa, sb = pair
    src = make_pool(layout("nhd", 1, 32))
    other = Layout.mha(
        num_layers=L, page_size=16, num_pages=4, total_kv_heads=H, head_dim=32, dtype="float16"
    )
    dst = make_pool(other)
    ka, kb = make_client(sa), make_client(sb)
    a = ka.register_buffers(src.layout, src.k_regions, src.v_regions).buffer_set_id
    b = kb.register_buffers(dst.layout, dst.k_regions, dst.v_regions).buffer_set_id
    kb.expect_delta("xi", b, prefix_pages=0, dst_page_indices=[0])
    ka.send_delta("xi", a, src_page_indices=list(range(16)), peer_address=sb.app.peer_address)
    st = wait_all(ka, "xi")[0]
    assert st.state == "FAILED" and "head_dim_k" in st.error, st


@pytest.mark.parametrize("page_layout", ["hnd_kv", "kv_nhd", "kv_hnd", "nhc", "hnc"])
def test_one_region_layouts_are_validated(make_client, server, page_layout: str) -> None:  # type: ignore[no-untyped-def]
    """K and V in one region a layer: V regions are refused, naming the field and the layout."""
    kv = make_client(server)
    lay = layout(page_layout, 16, 4)
    with ShmKVPool.create(lay) as pool:
        with pytest.raises(Exception, match=f"v_regions.*{page_layout}"):
            kv.register_buffers(lay, pool.k_regions, pool.k_regions)
        mla = Layout.mla(num_layers=L, page_size=16, num_pages=4, latent_dim=64, dtype="float16")
        bad = Layout(**{**mla.__dict__, "page_layout": "hnd"})
        with pytest.raises(Exception, match="page_layout"):
            kv.register_buffers(bad, pool.k_regions[:L], [])


@pytest.mark.parametrize(
    "shape,path,src_tp",
    [
        ("sglang1-to-vllmcpu16", "auto", 2),
        ("vllmcpu16-to-sglang1", "auto", 2),
        ("vllmcpu32-to-vllmcpu32", "direct", 1),
    ],
)
def test_cross_engine_over_nixl(
    make_server, make_pool, make_client, shape: str, path: str, src_tp: int
) -> None:  # type: ignore[no-untyped-def]
    """The cross-node path on the real transport: NIXL (UCX) between two services, DRAM pools."""
    pytest.importorskip("nixl")
    pair = tuple(make_server(transport="nixl", same_host_route="off") for _ in range(2))
    sts = run_convert(pair, make_pool, make_client, shape, path, f"xn-{shape}", src_tp=src_tp)
    assert all(s.bytes_sent > 0 for s in sts)


def test_a_first_chunk_past_zero_must_start_inside_the_receivers_prefix(pair, make_pool, make_client) -> None:  # type: ignore[no-untyped-def]
    """A sender may start at the receiver's prefix (SGLang's decode_prefix_len); starting past it
    leaves delta pages unsent, and the receiver says so."""
    sa, sb = pair
    src = make_pool(layout("nhd", 16, 16))
    dst = make_pool(layout("nhd", 16, 16))
    fill_random(src, 1)
    ka, kb = make_client(sa), make_client(sb)
    a = ka.register_buffers(src.layout, src.k_regions, src.v_regions).buffer_set_id
    b = kb.register_buffers(dst.layout, dst.k_regions, dst.v_regions).buffer_set_id
    kb.expect_delta("p0", b, prefix_pages=2, dst_page_indices=[7, 8])
    ka.send_delta("p0", a, src_page_indices=[4, 5], chunk_offset=2, peer_address=sb.app.peer_address)
    assert [wait_all(k, "p0")[0].state for k in (ka, kb)] == ["DONE", "DONE"]
    assert np.array_equal(dst.k(0)[[7, 8]], src.k(0)[[4, 5]])
    kb.expect_delta("p1", b, prefix_pages=1, dst_page_indices=[7, 8, 9])
    ka.send_delta("p1", a, src_page_indices=[4, 5], chunk_offset=2, peer_address=sb.app.peer_address)
    st = wait_all(kb, "p1")[0]
    assert st.state == "FAILED" and "1 of 3 delta pages unsent" in st.error, st
