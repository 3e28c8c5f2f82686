"""Page-size conversions checked token by token: a sender's pages and a receiver's pages of
another page size hold the same sequence's token rows (token-major pages: ``nhd``, ``nhc``, MLA)."""

from __future__ import annotations

import numpy as np
import pytest

__all__ = ["UNIT_CASES", "check_landed", "token_rows"]


def token_rows(regions: list[np.ndarray], pages: list[int], page_size: int) -> list[np.ndarray]:
    """Per region (``[num_pages, page_bytes]``), the token rows of ``pages`` in order:
    ``[len(pages) * page_size, row bytes]``."""
    return [r[pages].reshape(len(pages) * page_size, -1) for r in regions]


def check_landed(
    sender: list[np.ndarray],
    receiver: list[np.ndarray],
    before: list[np.ndarray],
    pages: tuple[int, int],
    src: list[int],
    start: int,
    prefix: int,
    dst: list[int],
) -> None:
    """Every receiver token of the delta that the sender sent (its pages ``src`` from transfer
    page ``start``; the receiver's ``dst`` past its ``prefix``; ``pages``: both page sizes) holds
    the sender's token of the same sequence position; every other byte of the receiver's
    regions is as it was (``before``)."""
    ps, pd = pages
    lo, hi = max(start * ps, prefix * pd), min((start + len(src)) * ps, (prefix + len(dst)) * pd)
    assert hi > lo
    for s, d in zip(token_rows(sender, src, ps), token_rows(receiver, dst, pd), strict=True):
        np.testing.assert_array_equal(
            d[lo - prefix * pd : hi - prefix * pd], s[lo - start * ps : hi - start * ps]
        )
    # nothing else changed: the rest of the named pages (an unsent tail) and every other page
    written = np.zeros(receiver[0].shape[0] * pd, dtype=bool)
    at = (prefix + np.arange(len(dst)))[:, None] * pd + np.arange(pd)[None, :]  # sequence positions
    rows = np.asarray(dst)[:, None] * pd + np.arange(pd)[None, :]  # their receiver token rows
    written[rows[(at >= lo) & (at < hi)]] = True
    for old, now in zip(before, receiver, strict=True):
        tok_old = old.reshape(old.shape[0] * pd, -1)
        tok_now = now.reshape(now.shape[0] * pd, -1)
        np.testing.assert_array_equal(tok_now[~written], tok_old[~written])


# Page-size conversions both lanes take, one service and across services: (sender page, receiver
# page, page layout, sender pages, chunk cuts, start, receiver prefix, receiver pages)
UNIT_CASES = [
    pytest.param((16, 4, "nhd", 3, [], 0, 2, 10), id="16-to-4"),
    pytest.param((4, 16, "nhd", 12, [5], 0, 0, 3), id="4-to-16-2-chunks"),
    pytest.param((1, 4, "nhd", 24, [7, 8, 19], 0, 1, 5), id="sglang-page-1-to-4-4-chunks"),
    pytest.param((4, 1, "nhd", 6, [2], 0, 3, 21), id="4-to-sglang-page-1"),
    pytest.param((6, 4, "nhd", 4, [1, 3], 0, 1, 5), id="6-to-4-gcd-2"),
    pytest.param((16, 4, "nhd", 3, [], 0, 1, 10), id="16-to-4-sender-last-page-part-filled"),
    pytest.param((4, 16, "nhd", 11, [4], 0, 0, 3), id="4-to-16-receiver-last-page-part-filled"),
    pytest.param((16, 4, "nhd", 2, [], 1, 4, 8), id="16-to-4-first-chunk-inside-the-prefix"),
    pytest.param((16, 1, "nhc", 2, [1], 0, 5, 27), id="nhc-16-to-1"),
]
