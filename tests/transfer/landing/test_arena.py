"""Landing arena and pool: bounded by the budget, views inside it, conservation after every step."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from kvservice_client import Layout

from kvservice.buffers import AuxBuffer, BufferSet, MappedRegion
from kvservice.transfer.landing import LandingPool
from kvservice.transfer.landing._arena import ALIGN, Arena
from kvservice.transfer.landing.declare import region_sizes
from kvservice.transfer.landing.pool import Landing, Part

LAYOUT = Layout.mha(num_layers=2, page_size=4, num_pages=16, total_kv_heads=2, head_dim=8, dtype="float16")


def engine_bs() -> BufferSet:
    """A host buffer set over plain tensors (the landing pool reads only its layout and regions)."""
    regions = []
    for _ in range(LAYOUT.num_layers * 2):
        t = torch.zeros(LAYOUT.region_bytes_k, dtype=torch.uint8)
        regions.append(MappedRegion(t.data_ptr(), t.numel(), "DRAM", 0, t, "test"))
    return BufferSet("bs-x", "s", "e", LAYOUT, tuple(regions[:2]), tuple(regions[2:]), ())


def aux_bs() -> BufferSet:
    """``engine_bs`` with an aux region "meta" of 16 rows of 64 bytes."""
    t = torch.zeros(16 * 64, dtype=torch.uint8)
    meta = AuxBuffer("meta", MappedRegion(t.data_ptr(), t.numel(), "DRAM", 0, t, "test"), 64, 16)
    return dataclasses.replace(engine_bs(), aux=(meta,))


def test_take_gives_disjoint_aligned_views_and_give_returns_them() -> None:
    """Regions of a landing are aligned views of the arena; freeing restores every byte."""
    arena = Arena(64 * 1024, torch.device("cpu"))
    off, views = arena.take([100, 300])
    assert off == 0 and [v.numel() for v in views] == [100, 300]
    assert views[1].data_ptr() - views[0].data_ptr() == ALIGN
    off2, _ = arena.take([1000])
    assert off2 == 3 * ALIGN and arena.used_bytes == 3 * ALIGN + 1024  # 100 -> 256, 300 -> 512
    arena.check_integrity()
    arena.give(off)
    arena.give(off2)
    assert arena.used_bytes == 0 and arena.peak_bytes == 3 * ALIGN + 1024
    arena.check_integrity()


def test_take_refuses_what_does_not_fit() -> None:
    """A landing larger than the free bytes gets None; the arena never exceeds its capacity."""
    arena = Arena(4 * ALIGN, torch.device("cpu"))
    assert arena.take([3 * ALIGN]) is not None
    assert arena.take([2 * ALIGN]) is None
    assert arena.used_bytes == 3 * ALIGN <= arena.capacity
    arena.check_integrity()


def held(arena: Arena, nbytes: int) -> Landing:
    """A landing holding one range of ``nbytes`` in ``arena`` (only its parts matter here)."""
    got = arena.take([nbytes])
    assert got is not None
    return Landing(arena, (Part(arena, got[0], nbytes),), engine_bs(), None)  # type: ignore[arg-type]


def test_victims_needed_counts_the_fewest_victims_and_changes_nothing() -> None:
    """How many landings (in order) must go before a new one fits, fragmentation included."""
    arena = Arena(6 * ALIGN, torch.device("cpu"))
    a, b, c = held(arena, 2 * ALIGN), held(arena, 2 * ALIGN), held(arena, 2 * ALIGN)
    assert LandingPool.victims_needed([(arena, [ALIGN])], []) == -1
    assert LandingPool.victims_needed([(arena, [2 * ALIGN])], [b, a]) == 1
    assert LandingPool.victims_needed([(arena, [4 * ALIGN])], [a, c, b]) == 3  # a and c are not adjacent
    assert LandingPool.victims_needed([(arena, [7 * ALIGN])], [a, b, c]) == -1
    assert arena.used_bytes == 6 * ALIGN
    arena.check_integrity()


def test_victims_needed_wants_every_arena_to_fit() -> None:
    """A landing needing two arenas (a VRAM one's pages, the host rows) fits only when both do."""
    kv, host = Arena(4 * ALIGN, torch.device("cpu")), Arena(2 * ALIGN, torch.device("cpu"))
    a = held(kv, 2 * ALIGN)
    b = held(kv, 2 * ALIGN)
    b.parts += (Part(host, host.take([2 * ALIGN])[0], 2 * ALIGN),)  # type: ignore[index]
    needs = [(kv, [2 * ALIGN]), (host, [ALIGN])]
    assert LandingPool.victims_needed(needs, [a, b]) == 2  # a frees pages, only b frees rows
    assert LandingPool.victims_needed(needs, [b, a]) == 1
    assert (kv.used_bytes, host.used_bytes) == (4 * ALIGN, 2 * ALIGN)


def test_take_is_all_or_nothing_across_arenas() -> None:
    """When the second range does not fit, the first is given back: nothing is held."""
    bs = aux_bs()
    pool = LandingPool(1 << 20)
    kv, tiny = Arena(1 << 20, torch.device("cpu")), Arena(ALIGN, torch.device("cpu"))
    rows = {"meta": np.arange(8)}
    assert pool.take(bs, 2, rows, [(kv, region_sizes(bs, 2)), (tiny, [8 * 64])]) is None
    assert kv.used_bytes == 0 and tiny.used_bytes == 0 and pool.landings == {}


def test_pool_lands_aux_rows_beside_the_pages_of_a_host_landing() -> None:
    """A host landing with aux rows is one range: pages, then one aux region per declared name."""
    bs = aux_bs()
    pool = LandingPool(1 << 20)
    rows = {"meta": np.arange(2)}
    needs = pool.needs(bs, 3, rows)
    assert len(needs) == 1 and needs[0][1] == region_sizes(bs, 3) + [2 * 64]
    land = pool.take(bs, 3, rows, needs)
    assert land is not None and len(land.parts) == 1
    (aux,) = land.bs.aux
    assert (aux.name, aux.row_bytes, aux.num_rows, aux.region.size) == ("meta", 64, 2, 128)
    base = pool.arena_for(bs).buffer.data_ptr()
    assert base <= aux.region.address < base + (1 << 20)
    assert aux.region.address >= max(r.address + r.size for r in land.bs.regions)
    assert land.nbytes == Arena.footprint(region_sizes(bs, 3) + [128])
    pool.give(land)
    assert pool.used_bytes() == 0


def test_the_host_arena_is_registered_once_when_made() -> None:
    """The host arena (where aux rows land) is handed to the transport at its making, once."""
    seen: list[tuple[int, int, str, int]] = []
    pool = LandingPool(1 << 16, register=lambda *a: seen.append(a))
    bs = engine_bs()
    pool.needs(bs, 1, {})
    pool.needs(bs, 2, {})
    arena = pool.arena_for(bs)
    assert seen == [(arena.buffer.data_ptr(), arena.capacity, "DRAM", 0)]


def test_pool_views_follow_the_engine_layout() -> None:
    """A landing view has the engine's layout with n pages, one region per engine region."""
    bs = engine_bs()
    pool = LandingPool(1 << 20)
    land = pool.take(bs, 3, {}, pool.needs(bs, 3, {}))
    assert land is not None
    assert land.bs.buffer_set_id == bs.buffer_set_id and land.bs.layout.num_pages == 3
    assert [r.size for r in land.bs.regions] == region_sizes(bs, 3) == [3 * LAYOUT.page_bytes_k] * 4
    assert land.regions.num_pages == 3
    base = pool.arena_for(bs).buffer.data_ptr()
    assert all(base <= r.address < base + (1 << 20) for r in land.bs.regions)
    (st,) = pool.stats({})
    assert (st.location, st.landings, st.used_bytes) == (
        "host" if not torch.cuda.is_available() else "pinned",
        1,
        land.nbytes,
    )
    pool.give(land)
    pool.give(land)  # idempotent
    (st,) = pool.stats({})
    assert st.used_bytes == 0 and st.landings == 0


@pytest.mark.parametrize("seed", range(3))
def test_random_take_give_conserves_bytes(seed: int) -> None:
    """Random landings and frees: used + free == capacity, and used never exceeds it."""
    rng = np.random.default_rng(seed)
    arena = Arena(64 * ALIGN, torch.device("cpu"))
    live: list[tuple[int, int]] = []
    for _ in range(300):
        if live and rng.random() < 0.45:
            off, size = live.pop(int(rng.integers(len(live))))
            assert arena.give(off) == size
        else:
            sizes = [int(s) for s in rng.integers(1, 4 * ALIGN, int(rng.integers(1, 4)))]
            got = arena.take(sizes)
            if got is not None:
                live.append((got[0], Arena.footprint(sizes)))
        assert arena.used_bytes == sum(s for _, s in live) <= arena.capacity
        arena.check_integrity()
