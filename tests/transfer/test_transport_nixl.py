"""NIXL transport between two processes (spawned), and NIXL error translation."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import grpc
import numpy as np
import pytest

from kvservice.errors import TransportError
from kvservice.transfer import nixl_transport
from kvservice.transfer.descriptors import prepped_indices, prepped_rows
from kvservice.transfer.nixl_transport import (
    NIXL_ERRORS,
    NIXL_IMPORT_ERROR,
    NixlTransport,
    nixl_error_classes,
    translate_nixl_error,
)

needs_nixl = pytest.mark.skipif(
    NIXL_IMPORT_ERROR is not None, reason=f"nixl not importable: {NIXL_IMPORT_ERROR}"
)

LAYERS, PAGES, PAGE_BYTES = 4, 64, 1024  # K regions 0..3, V regions 4..7


def _receiver(to_parent: Any, from_parent: Any) -> None:
    """Child: register a zeroed KV pool, hand out metadata, wait for the notif, send the pool back."""
    t = NixlTransport("receiver")
    pool = np.zeros((2 * LAYERS, PAGES * PAGE_BYTES), dtype=np.uint8)
    t.register(pool.ctypes.data, pool.nbytes, "DRAM", 0)
    to_parent.put((t.metadata(), pool.ctypes.data))
    t.add_peer("sender", from_parent.get(timeout=30))
    notifs: dict[str, list[bytes]] = {}
    end = time.monotonic() + 20
    while not notifs and time.monotonic() < end:
        notifs = t.notifications()
        time.sleep(0.001)
    to_parent.put((notifs, pool.tobytes()))
    t.close()


@needs_nixl
async def test_two_process_scattered_pages_byte_exact() -> None:
    """Scattered pages of all K/V regions land byte-exact in another process, then the notif."""
    ctx = mp.get_context("spawn")
    up, down = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_receiver, args=(up, down), daemon=True)
    child.start()
    t = NixlTransport("sender")
    try:
        pool = np.random.default_rng(0).integers(0, 256, (2 * LAYERS, PAGES * PAGE_BYTES), dtype=np.uint8)
        t.register(pool.ctypes.data, pool.nbytes, "DRAM", 0)
        meta, remote_base = up.get(timeout=30)
        assert t.add_peer("receiver", meta) == "receiver"
        down.put(t.metadata())
        stride = PAGES * PAGE_BYTES
        regions = np.arange(2 * LAYERS, dtype=np.int64) * stride
        local = t.prep_local(prepped_rows(pool.ctypes.data + regions, PAGE_BYTES, PAGES))
        remote = t.prep_remote("receiver", prepped_rows(remote_base + regions, PAGE_BYTES, PAGES))
        src = np.array([0, 1, 2, 17, 40, 41, 63])
        dst = np.array([5, 6, 7, 3, 62, 63, 0])
        plan = prepped_indices(2 * LAYERS, src, dst, PAGES, PAGES, PAGE_BYTES)
        handle = t.write(local, plan.local_idx, remote, plan.remote_idx, notif=b"T-42:last")
        await t.wait(handle, time.monotonic() + 20)
        notifs, got = up.get(timeout=30)
        child.join(timeout=30)
    finally:
        t.close()
        if child.is_alive():
            child.kill()
    assert notifs == {"sender": [b"T-42:last"]}
    expect = np.zeros_like(pool)
    for s, d in zip(src, dst, strict=True):
        expect[:, d * PAGE_BYTES : (d + 1) * PAGE_BYTES] = pool[:, s * PAGE_BYTES : (s + 1) * PAGE_BYTES]
    np.testing.assert_array_equal(np.frombuffer(got, dtype=np.uint8).reshape(pool.shape), expect)


@needs_nixl
def test_every_nixl_error_class_is_mapped() -> None:
    """Each exception class nixl._bindings defines has an entry in NIXL_ERRORS."""
    classes = nixl_error_classes()
    assert classes, "nixl._bindings exposes no error classes"
    assert set(classes) <= set(NIXL_ERRORS), set(classes) - set(NIXL_ERRORS)


def test_translated_errors_are_unavailable() -> None:
    """Translated NIXL errors are TransportError (UNAVAILABLE) naming the operation and class."""
    err = translate_nixl_error("write", RuntimeError("boom"))
    assert isinstance(err, TransportError) and err.code == grpc.StatusCode.UNAVAILABLE
    assert "write" in err.message and "RuntimeError" in err.message


@needs_nixl
def test_real_nixl_failure_is_translated() -> None:
    """A NIXL call failing inside the library surfaces as TransportError, not a nixl class."""
    t = NixlTransport("lonely")
    try:
        with pytest.raises(TransportError, match="nixl"):
            t.add_peer("x", b"not metadata")
    finally:
        t.close()


@needs_nixl
@pytest.mark.parametrize("delay_us", [0, 250])
def test_progress_delay_reaches_the_agent_config(delay_us: int, caplog: pytest.LogCaptureFixture) -> None:
    """nixl's wrapper writes pthrDelay = 0; the agent is built with our delay instead (and with
    nixl's own 0 when asked for 0), and nixl's module is left as it was."""
    from nixl import _api

    real = _api.nixlBind
    built: list[int] = []
    base = real.nixlAgent

    class Spy:  # records the config the wrapper hands to the C++ agent
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def nixlAgent(self, name: str, config: Any) -> Any:  # noqa: N802
            built.append(config.pthrDelay)
            return base(name, config)

    _api.nixlBind = Spy()
    try:
        t = NixlTransport(f"delay-{delay_us}", progress_delay_us=delay_us)
        t.close()
    finally:
        _api.nixlBind = real
    assert built == [delay_us]
    assert "not applied" not in caplog.text


@needs_nixl
def test_progress_delay_swap_is_undone_and_counts_configs() -> None:
    from nixl import _api

    real = _api.nixlBind
    bind = nixl_transport._Bindings(300, real)
    cfg = bind.nixlAgentConfig()
    cfg.pthrDelay = 0  # what the wrapper writes
    assert (cfg.pthrDelay, bind.made) == (300, 1)
    NixlTransport("delay-restore").close()
    assert _api.nixlBind is real
