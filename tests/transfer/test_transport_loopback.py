"""Loopback-only behaviour: in-flight handles, deadlines and settling (NIXL has no way to hold a
transfer in PROC on demand, so these run on the double)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvservice.errors import DeadlineExceeded, TransportError
from kvservice.transfer.loopback import LoopbackTransport


def _pair(name: str, polls: int) -> tuple[LoopbackTransport, LoopbackTransport, np.ndarray, np.ndarray]:
    a, b = LoopbackTransport(f"{name}-a", polls_to_complete=polls), LoopbackTransport(f"{name}-b")
    src, dst = np.full(4096, 7, dtype=np.uint8), np.zeros(4096, dtype=np.uint8)
    a.register(src.ctypes.data, src.nbytes, "DRAM", 0)
    b.register(dst.ctypes.data, dst.nbytes, "DRAM", 0)
    a.add_peer(b.agent_name, b.metadata())
    return a, b, src, dst


async def test_bytes_land_only_when_done() -> None:
    """A handle held in PROC has written nothing; the bytes land when it turns DONE."""
    a, b, src, dst = _pair("land", polls=3)
    h = a.write_descs(
        b.agent_name, np.array([[src.ctypes.data, 4096, 0]]), np.array([[dst.ctypes.data, 4096, 0]])
    )
    assert a.status(h) == "PROC" and not dst.any()
    await a.wait(h, time.monotonic() + 5)
    assert (dst == 7).all()
    a.close()
    b.close()


async def test_deadline_settles_before_raising() -> None:
    """At the deadline wait settles the handle (peer removed → ERR) and no byte lands after."""
    a, b, src, dst = _pair("deadline", polls=10**9)
    h = a.write_descs(
        b.agent_name, np.array([[src.ctypes.data, 4096, 0]]), np.array([[dst.ctypes.data, 4096, 0]])
    )
    with pytest.raises(DeadlineExceeded):
        await a.wait(h, time.monotonic() + 0.01, settle_s=0.01)
    assert not dst.any()
    a.close()
    b.close()


async def test_error_state_raises_transport_error() -> None:
    """A handle that ends in ERR makes wait raise TransportError."""
    a, b, src, dst = _pair("err", polls=10**9)
    h = a.write_descs(
        b.agent_name, np.array([[src.ctypes.data, 4096, 0]]), np.array([[dst.ctypes.data, 4096, 0]])
    )
    a.remove_peer(b.agent_name)
    with pytest.raises(TransportError):
        await a.wait(h, time.monotonic() + 5)
    a.close()
    b.close()


def test_metadata_is_a_snapshot() -> None:
    """Memory registered after metadata() was taken is not writable by the peer."""
    a, b, src, dst = _pair("snap", polls=0)
    late = np.zeros(4096, dtype=np.uint8)
    b.register(late.ctypes.data, late.nbytes, "DRAM", 0)
    with pytest.raises(TransportError):
        a.prep_remote(b.agent_name, np.array([[late.ctypes.data, 4096, 0]]))
    a.add_peer(b.agent_name, b.metadata())
    a.prep_remote(b.agent_name, np.array([[late.ctypes.data, 4096, 0]]))
    a.close()
    b.close()
