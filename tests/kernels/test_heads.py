"""Mixed-TP head routing, alone and end to end through pack -> unpack."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvservice import kernels
from kvservice.errors import InvalidArgument
from kvservice.kernels import Backend, HeadRoute, KVRegions, plan_heads
from kvservice.kernels.heads import local_heads, rank_heads

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPLITS = [
    (8, 1, 2),
    (8, 1, 4),
    (8, 2, 4),
    (8, 4, 2),
    (8, 8, 2),
    (2, 2, 1),
    (2, 4, 2),
    (2, 1, 4),
    (2, 4, 8),
    (1, 2, 4),
]


@pytest.mark.parametrize("h,p,d", SPLITS)
@pytest.mark.parametrize("replica", ["spread", "first"])
def test_every_receiver_head_has_exactly_one_correct_source(h: int, p: int, d: int, replica: str) -> None:
    """Each receiver head is covered once, by a sender that holds that global head."""
    src_g, dst_g = rank_heads(h, p), rank_heads(h, d)
    covered = np.zeros(dst_g.shape, dtype=int)
    for r in plan_heads(h, p, d, replica=replica):  # type: ignore[arg-type]
        sl = slice(r.dst_head_start, r.dst_head_start + r.num_heads)
        covered[r.dst_rank, sl] += 1
        assert np.array_equal(
            src_g[r.src_rank, r.src_head_start : r.src_head_start + r.num_heads], dst_g[r.dst_rank, sl]
        )
    assert (covered == 1).all()


def test_p_less_than_d_sends_adjacent_slices() -> None:
    """TP 2 -> 4 over 8 heads: each sender sends two 2-head slices, one per receiver."""
    assert plan_heads(8, 2, 4) == (
        HeadRoute(0, 0, 0, 0, 2),
        HeadRoute(0, 1, 2, 0, 2),
        HeadRoute(1, 2, 0, 0, 2),
        HeadRoute(1, 3, 2, 0, 2),
    )


def test_first_replica_leaves_other_replicas_idle() -> None:
    """With replica='first' only the lowest rank of each replica group sends (MLA: rank 0)."""
    assert {r.src_rank for r in plan_heads(1, 4, 2, replica="first")} == {0}
    assert {r.src_rank for r in plan_heads(2, 4, 2, replica="first")} == {0, 2}


@pytest.mark.parametrize("h,tp", [(8, 3), (3, 4), (0, 1), (4, 0)])
def test_uneven_tp_is_rejected(h: int, tp: int) -> None:
    """TP sizes that do not split the heads raise InvalidArgument."""
    with pytest.raises(InvalidArgument):
        local_heads(h, tp)


def _rank_pool(full: list[torch.Tensor], heads: np.ndarray, page_size: int) -> KVRegions:
    ks = [t[:, heads].contiguous() for t in full]
    return KVRegions.create(ks, None, page_size=page_size, num_heads=len(heads), head_dim_k=full[0].shape[-1])


@pytest.mark.parametrize("h,p,d", SPLITS)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_mixed_tp_transfer_end_to_end(h: int, p: int, d: int, backend: Backend) -> None:
    """Senders pack their routes (grouped into num_slices when adjacent); receivers end equal to the model."""
    page_size, pages, layers, hd = 2, 5, 2, 4
    gen = torch.Generator().manual_seed(h * 100 + p * 10 + d)
    full = [torch.randn(pages * page_size, h, hd, generator=gen).to(DEVICE) for _ in range(layers)]
    senders = [_rank_pool(full, row, page_size) for row in rank_heads(h, p)]
    receivers = [_rank_pool([torch.zeros_like(t) for t in full], row, page_size) for row in rank_heads(h, d)]
    src_pages, dst_pages = np.array([4, 0, 3]), np.array([1, 2, 0])
    routes = plan_heads(h, p, d)
    i = 0
    while i < len(routes):  # group a sender's adjacent equal slices into one destination-major pack
        j, r = i + 1, routes[i]
        while (
            j < len(routes)
            and routes[j].src_rank == r.src_rank
            and routes[j].num_heads == r.num_heads
            and routes[j].src_head_start == r.src_head_start + (j - i) * r.num_heads
        ):
            j += 1
        buf = kernels.pack(
            senders[r.src_rank],
            src_pages,
            head_start=r.src_head_start,
            num_heads=r.num_heads,
            num_slices=j - i,
            backend=backend,
        )
        for s, part in enumerate(buf.view(j - i, -1)):
            q = routes[i + s]
            kernels.unpack(
                receivers[q.dst_rank],
                part,
                dst_pages,
                head_start=q.dst_head_start,
                num_heads=q.num_heads,
                backend=backend,
            )
        i = j
    for rank, row in enumerate(rank_heads(h, d)):
        for layer in range(layers):
            got = receivers[rank].k[layer].view(pages, page_size, len(row), hd)
            want = full[layer].view(pages, page_size, h, hd)[:, :, row]
            assert torch.equal(got[dst_pages], want[src_pages])
            assert not got[np.setdiff1d(np.arange(pages), dst_pages)].any()
