"""Hypothesis: random publish/evict/match/lease sequences agree with a dict model."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvservice_client.hashing import page_hashes

from kvservice.errors import KVServiceError
from kvservice.index import PrefixIndex
from tests.support.index import Clock

NUM_PAGES = 12
# Prompts over a 3-token alphabet share prefixes often; page size 1 keeps trees deep.
prompts = st.lists(st.integers(0, 2), min_size=1, max_size=6)
ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("publish"),
            prompts,
            st.lists(st.integers(0, NUM_PAGES - 1), max_size=6),
            st.integers(-2, 2),
        ),
        st.tuples(st.just("evict"), st.lists(st.integers(-1, NUM_PAGES), max_size=3)),
        st.tuples(st.just("match"), prompts),
        st.tuples(st.just("lease"), prompts),
        st.tuples(st.just("release"), st.integers(0, 3)),
    ),
    max_size=25,
)


class Model:
    """hash -> (page, parent hash, priority); the spec of PrefixIndex in a few lines."""

    def __init__(self) -> None:
        self.e: dict[int, tuple[int, int, int]] = {}

    def drop(self, h: int) -> int:
        kids = [k for k, v in self.e.items() if v[1] == h]
        del self.e[h]
        return 1 + sum(self.drop(k) for k in kids if k in self.e)

    def matched(self, hs: list[int]) -> list[int]:
        out, parent = [], 0
        for h in hs:
            if h not in self.e or self.e[h][1] != parent:
                break
            out.append(self.e[h][0])
            parent = h
        return out


def apply_publish(m: Model, hs: list[int], pages: list[int], prio: int) -> int:
    by_page = {v[0]: k for k, v in m.e.items()}
    for h, p in zip(hs, pages, strict=False):
        old = by_page.get(p)
        if old is not None and old != h and old in m.e:
            m.drop(old)
    inserted, parent = 0, 0
    for h, p in zip(hs, pages, strict=False):
        if h in m.e:
            m.e[h] = (m.e[h][0], m.e[h][1], max(m.e[h][2], prio))
        else:
            m.e[h] = (p, parent, prio)
            inserted += 1
        parent = h
    return inserted


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_random_operations_match_model(seq: list[tuple]) -> None:
    """After every operation the index equals the model and check_integrity passes."""
    ix, m, leases = PrefixIndex(clock_ms=Clock()), Model(), []
    ix.add_buffer_set("a", engine_id="e", page_size=1, num_pages=NUM_PAGES)
    for op in seq:
        if op[0] == "publish":
            hs = page_hashes(op[1], 1)
            pages = np.array(op[2][: len(hs)], dtype=np.int64)
            dup_page = len(set(op[2][: len(hs)])) != len(pages)
            by_page = {v[0]: k for k, v in m.e.items()}
            named = {int(h) for h in hs[: len(pages)]}
            clash = any(
                by_page.get(p) not in (None, int(h)) and by_page[p] in named
                for h, p in zip(hs, pages.tolist(), strict=False)
            )
            try:
                got = ix.publish("a", hs, pages, op[3])
            except KVServiceError:
                assert dup_page or clash or len(op[2]) > len(hs)
            else:
                assert got == apply_publish(m, [int(h) for h in hs[: len(pages)]], pages.tolist(), op[3])
        elif op[0] == "evict":
            pages = op[1]
            try:
                got = ix.evict("a", np.array(pages, dtype=np.int64))
            except KVServiceError:
                assert len(set(pages)) != len(pages) or any(p < 0 or p >= NUM_PAGES for p in pages)
            else:
                by_page = {v[0]: k for k, v in m.e.items()}
                assert got == sum(m.drop(by_page[p]) for p in pages if p in by_page and by_page[p] in m.e)
        elif op[0] in ("match", "lease"):
            hs = page_hashes(op[1], 1)
            (res,) = ix.match(hs, page_size=1)
            assert res.page_indices.tolist() == m.matched([int(h) for h in hs])
            if op[0] == "lease":
                leases.append(ix.lease([res], 1000, "s").lease_id)
        elif leases:
            ix.release_lease(leases.pop(op[1] % len(leases)), "s")
        ix.check_integrity()
        assert ix.stats().entries == len(m.e)
        prios: dict[int, int] = {}
        for _, _, q in m.e.values():
            prios[q] = prios.get(q, 0) + 1
        assert ix.stats().entries_by_priority == prios
