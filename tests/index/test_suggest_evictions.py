"""SuggestEvictions' order on random trees: leaves first, never a leased page or its ancestors."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvservice.index import PrefixIndex

PAGES = 64


@st.composite
def forests(draw: st.DrawFn) -> tuple[list[tuple[list[int], int]], list[int], list[int]]:
    """Chains (as hash lists sharing prefixes) with priorities, pages to lease, pages to mark."""
    chains: list[tuple[list[int], int]] = []
    used = 0
    for _ in range(draw(st.integers(1, 8))):
        if chains and draw(st.booleans()):
            base, _ = chains[draw(st.integers(0, len(chains) - 1))]
            keep = base[: draw(st.integers(0, len(base)))]
        else:
            keep = []
        n = draw(st.integers(1, 6))
        if used + n > PAGES:
            break
        chains.append((keep + list(range(1000 + used, 1000 + used + n)), draw(st.integers(-3, 3))))
        used += n
    leased = draw(st.lists(st.integers(0, max(used - 1, 0)), max_size=3))
    marked = draw(st.lists(st.integers(0, max(used - 1, 0)), max_size=10))
    return chains, leased, marked


@settings(max_examples=150, deadline=None)
@given(forests())
def test_order_evicts_leaves_first_and_skips_leases(forest) -> None:  # noqa: ANN001
    chains, leased, marked = forest
    ix = PrefixIndex()
    ix.add_buffer_set("b", engine_id="e", page_size=1, num_pages=PAGES)
    page_of: dict[int, int] = {}
    for hashes, prio in chains:
        for h in hashes:
            page_of.setdefault(h, len(page_of))
        ix.publish("b", np.array(hashes, np.uint64), np.array([page_of[h] for h in hashes]), prio)
    parent = {}
    for hashes, _ in chains:
        for a, b in zip(hashes, hashes[1:], strict=False):
            parent[page_of[b]] = page_of[a]
    pinned = set()
    for p in leased:
        chain = [p]
        while chain[-1] in parent:
            chain.append(parent[chain[-1]])
        h = [next(k for k, v in page_of.items() if v == q) for q in reversed(chain)]
        ix.lease(ix.match(np.array(h, np.uint64), page_size=1), 60_000, "o")
        pinned.update(chain)
    ix.mark_duplicates("b", np.array(sorted(set(marked)), dtype=np.int64))
    pages, prios, dup = ix.suggest_evictions("b", PAGES, -100)
    assert pages.size == len(set(pages.tolist())) == len(page_of) - len(pinned)
    assert not set(pages.tolist()) & pinned
    assert all((q == -100) if d else (q >= -3) for q, d in zip(prios.tolist(), dup.tolist(), strict=True))
    for p in pages.tolist():  # evicting in the order given removes exactly the page named
        assert ix.evict("b", np.array([p])) == 1
    ix.check_integrity()
