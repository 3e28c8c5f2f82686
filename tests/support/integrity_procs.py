"""End-to-end integrity between two kvservice processes over NIXL, for any engine pool:
a byte flipped in a packed staging batch after the sender's checksum (tests/support/faulty_service.py)
FAILS the transfer naming the checksum and changes no destination page; with the fault gone, the
retry is DONE and byte-exact. Run on shm pools by test_integrity_procs.py and on VRAM pools by
tests/gpu/test_gpu_integrity.py; a side is anything with the methods of :class:`ShmSide`."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any, Protocol

from kvservice_client import Layout

from tests.support.engines import EngineProc
from tests.support.pools import regions_of

__all__ = ["ShmSide", "Side", "corrupted_then_clean"]


class Side(Protocol):
    def expect(self, tid: str, dst: list[int]) -> None: ...
    def send(self, tid: str, src: list[int], peer: str) -> None: ...
    def wait(self, tid: str) -> tuple[str, str]: ...
    def digests(self, pages: list[int]) -> list[str]: ...
    def close(self) -> None: ...


class ShmSide:
    """An engine process with a shm pool (tests.support.engines.EngineProc), filled with random bytes."""

    def __init__(self, address: str, layout: Layout, seed: int) -> None:
        self.eng = EngineProc(address, layout, seed=seed).ready()

    def expect(self, tid: str, dst: list[int]) -> None:
        self.eng.call(
            "expect_delta", tid, self.eng.bs, prefix_pages=0, dst_page_indices=dst, deadline_ms=20_000
        )

    def send(self, tid: str, src: list[int], peer: str) -> None:
        self.eng.call("send_delta", tid, self.eng.bs, src_page_indices=src, peer_address=peer, path="packed")

    def wait(self, tid: str) -> tuple[str, str]:
        end = time.monotonic() + 60
        while True:
            sts = self.eng.call("poll", [tid])
            if sts and all(s.terminal for s in sts):
                return sts[0].state, sts[0].error
            assert time.monotonic() < end, f"{tid} not terminal: {sts}"
            time.sleep(0.02)

    def digests(self, pages: list[int]) -> list[str]:
        """sha256 of the named pages' bytes (in the order named), per region."""
        assert self.eng.pool is not None
        return [hashlib.sha256(r[pages].tobytes()).hexdigest() for r in regions_of(self.eng.pool)]

    def close(self) -> None:
        self.eng.stop()


def corrupted_then_clean(
    src: Any, dst: Any, peer: str, trigger: Path, src_pages: list[int], dst_pages: list[int], num_pages: int
) -> None:
    """The trigger on: the packed transfer FAILS on both sides, the receiver's error names the
    checksum, and every destination page is as before. The trigger off: the same transfer again
    is DONE on both sides, the named pages hold the sender's bytes exactly and no other changed."""
    every = list(range(num_pages))
    rest = sorted(set(every) - set(dst_pages))
    before, before_rest = dst.digests(every), dst.digests(rest)
    trigger.write_text("")
    dst.expect("t-bad", dst_pages)
    src.send("t-bad", src_pages, peer)
    (state_d, error_d), (state_s, error_s) = dst.wait("t-bad"), src.wait("t-bad")
    assert trigger.read_text(), "no packed batch was corrupted"
    assert state_d == "FAILED" and "checksum" in error_d, (state_d, error_d)
    assert state_s == "FAILED", (state_s, error_s)
    assert dst.digests(every) == before, "a destination page changed"
    os.unlink(trigger)
    dst.expect("t-good", dst_pages)
    src.send("t-good", src_pages, peer)
    assert (dst.wait("t-good")[0], src.wait("t-good")[0]) == ("DONE", "DONE")
    assert dst.digests(dst_pages) == src.digests(src_pages)
    assert dst.digests(rest) == before_rest, "a page not named changed"
