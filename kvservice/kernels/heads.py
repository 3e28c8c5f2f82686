"""Mixed-TP head routing: which heads of which sender rank go to which receiver rank, and where.

With ``H`` total KV heads and TP size ``tp``, rank ``r`` holds (SGLang's split)::

    tp <= H:  local = H/tp heads,  global heads r*local + [0, local)
    tp >  H:  local = 1 head,      global head  r*H // tp     (tp/H replicas of each head)

Examples (H = 8)::

    p=2 -> d=4 (p < d)               p=4 -> d=2 (p > d)
    sender 0: heads 0..3             receiver 0: heads 0..3
      [0,2) -> recv 0 at 0             sender 0 [0,2) -> at 0
      [2,4) -> recv 1 at 0             sender 1 [0,2) -> at 2
    sender 1: heads 4..7             receiver 1: heads 4..7
      [0,2) -> recv 2 at 0             sender 2 [0,2) -> at 0
      [2,4) -> recv 3 at 0             sender 3 [0,2) -> at 2

Replicated heads (``tp > H``): every receiver head gets exactly one source. With
``replica="spread"`` receiver ``r`` takes replica ``r % replicas`` (senders share the work);
with ``"first"`` the lowest-ranked replica sends and the others send nothing (SGLang, MLA).
MLA is ``total_heads=1``. Pure numpy, no loop per head or page; routes within one sender
and consecutive receivers have equal, adjacent source slices, so they can be packed with one
``pack(..., num_slices=len(routes))`` call.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import numpy as np

from ..errors import InvalidArgument

__all__ = ["HeadRoute", "local_heads", "plan_heads", "rank_heads"]


@dataclasses.dataclass(frozen=True)
class HeadRoute:
    """Sender ``src_rank``'s local heads ``[src_head_start, +num_heads)`` go to receiver
    ``dst_rank``'s local heads ``[dst_head_start, +num_heads)``."""

    src_rank: int
    dst_rank: int
    src_head_start: int
    dst_head_start: int
    num_heads: int


def _check_tp(total_heads: int, tp: int, field: str) -> None:
    if total_heads < 1:
        raise InvalidArgument("total_heads", f"must be >= 1, got {total_heads}")
    if tp < 1:
        raise InvalidArgument(field, f"must be >= 1, got {tp}")
    if (tp <= total_heads and total_heads % tp) or (tp > total_heads and tp % total_heads):
        raise InvalidArgument(field, f"{total_heads} heads do not split evenly over TP {tp}")


def local_heads(total_heads: int, tp: int) -> int:
    """Heads each rank holds."""
    _check_tp(total_heads, tp, "tp")
    return max(1, total_heads // tp)


def rank_heads(total_heads: int, tp: int) -> np.ndarray:
    """int64 ``[tp, local]``: the global head held at each rank's local head index."""
    n = local_heads(total_heads, tp)
    ranks = np.arange(tp, dtype=np.int64)[:, None]
    if tp <= total_heads:
        return ranks * n + np.arange(n, dtype=np.int64)[None, :]
    return ranks * total_heads // tp


@functools.lru_cache(maxsize=4096)  # NOTE: a pure function of a few ints, asked once per transfer
def plan_heads(
    total_heads: int,
    src_tp: int,
    dst_tp: int,
    *,
    replica: Literal["spread", "first"] = "spread",
) -> tuple[HeadRoute, ...]:
    """Every route from sender to receiver ranks, sorted by (src_rank, dst_rank, dst_head_start).

    Each receiver head appears in exactly one route. Raises InvalidArgument for TP sizes
    that do not split ``total_heads``.
    """
    _check_tp(total_heads, src_tp, "src_tp")
    _check_tp(total_heads, dst_tp, "dst_tp")
    dst_global = rank_heads(total_heads, dst_tp)  # [d, ld]
    d, ld = dst_global.shape
    dst_rank = np.repeat(np.arange(d, dtype=np.int64), ld)
    dst_local = np.tile(np.arange(ld, dtype=np.int64), d)
    h = dst_global.reshape(-1)
    if src_tp <= total_heads:
        ls = total_heads // src_tp
        src, src_local = h // ls, h % ls
    else:
        replicas = src_tp // total_heads
        pick = dst_rank % replicas if replica == "spread" else np.zeros_like(dst_rank)
        src, src_local = h * replicas + pick, np.zeros_like(h)
    # A run continues while the receiver and sender stay and both local heads advance by one.
    cont = (np.diff(src) == 0) & (np.diff(dst_rank) == 0) & (np.diff(src_local) == 1)
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    lengths = np.diff(np.append(starts, h.size))
    order = np.lexsort((dst_local[starts], dst_rank[starts], src[starts]))
    return tuple(
        HeadRoute(
            int(src[starts[j]]),
            int(dst_rank[starts[j]]),
            int(src_local[starts[j]]),
            int(dst_local[starts[j]]),
            int(lengths[j]),
        )
        for j in order
    )
