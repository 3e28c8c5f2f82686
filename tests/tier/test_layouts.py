"""Tier pages are whole pages whatever the pool's layout: MLA (latent only), V inside the K region
(hnd_kv) and planar K/V (kv_nhd) round-trip byte-exact between two engines of the layout; and a
cancelled copy still owns its slots until it ends."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from kvservice_client import Client, Layout, ShmKVPool, page_hashes

from kvservice.tier.calls import _copy_to_end
from tests.support.pools import fill_random, regions_of

LAYOUTS = {
    "mla": Layout.mla(num_layers=3, page_size=4, num_pages=12, latent_dim=24, dtype="bfloat16"),
    "hnd_kv": Layout.mha(
        num_layers=2,
        page_size=4,
        num_pages=12,
        total_kv_heads=2,
        head_dim=8,
        dtype="float16",
        page_layout="hnd_kv",
    ),
    "kv_nhd": Layout.mha(
        num_layers=2,
        page_size=4,
        num_pages=12,
        total_kv_heads=2,
        head_dim=8,
        dtype="float16",
        page_layout="kv_nhd",
    ),
}
HASHES = page_hashes(np.arange(20), 4)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_pages_round_trip_in_every_layout(server, name: str) -> None:
    """Offloaded from one engine, loaded into another of the same layout: identical pages."""
    lay = LAYOUTS[name]
    with ShmKVPool.create(lay) as pa, ShmKVPool.create(lay) as pb_, Client(server.address) as kv:
        fill_random(pa, 1)
        fill_random(pb_, 2)
        sa = kv.register_buffers(lay, pa.k_regions, pa.v_regions).buffer_set_id
        sb = kv.register_buffers(lay, pb_.k_regions, pb_.v_regions).buffer_set_id
        hs = [int(h) for h in HASHES[:3]]
        kv.offload_pages(sa, [9, 2, 5], hs)
        kv.load_pages(sb, [0, 11, 4], hs)
        for ra, rb in zip(regions_of(pa), regions_of(pb_), strict=True):
            assert (rb[[0, 11, 4]] == ra[[9, 2, 5]]).all()
    server.node.tier.tier.check_integrity()


def test_a_cancelled_copy_is_waited_for() -> None:
    """Cancelling the caller does not return before the copy's thread is done with its slots."""
    done = threading.Event()

    def slow_copy() -> None:
        time.sleep(0.2)
        done.set()

    async def main() -> None:
        task = asyncio.ensure_future(_copy_to_end(slow_copy))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert done.is_set()

    asyncio.run(main())
