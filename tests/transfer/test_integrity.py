"""End-to-end integrity (transfer/integrity.py): the sender's checksum rides behind its
pack; the receiver's verdict gates its unpack, so a corrupted batch changes no page and fails the
transfer naming the batch, and a clean one lands byte-exact. ``backend="triton"`` is the GPU's
path (the checksum launched, the unpack kernel reading the verdict on the device), run here by
the Triton interpreter; "auto" on host pools is CPU mode (xxh3, then the unpack only if equal)."""

from __future__ import annotations

import functools
import os
import types
from typing import Any

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    # NOTE: before the first import of the Triton kernels (as in tests/kernels/conftest.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvservice import kernels  # noqa: E402
from kvservice.errors import FailedPrecondition  # noqa: E402
from kvservice.kernels import KVRegions, checksum, reference  # noqa: E402
from kvservice.transfer import inbound as inbound_mod  # noqa: E402
from kvservice.transfer.integrity import landed_check, pack_hashed, unpack_verified  # noqa: E402
from kvservice.transfer.routes import packed as packed_mod  # noqa: E402
from tests.support.peers import DST, SRC, secure_node
from tests.support.pools import assert_pages_equal, assert_unchanged, snapshot
from tests.support.transfers import one

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = [
    "auto",
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(
            DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1", reason="no GPU, no interpreter"
        ),
    ),
]
PAGES, HEADS, HEAD_DIM, LAYERS, NUM_PAGES = 4, 2, 8, 2, 12
SRC_PAGES, DST_PAGES = np.array([3, 1, 4, 10]), np.array([9, 2, 6, 7])
PLAN = types.SimpleNamespace(integrity=True)
TARGET = types.SimpleNamespace(pack=lambda regions, src, out=None: kernels.pack(regions, src, out))


def _pool(seed: int) -> KVRegions:
    g = torch.Generator().manual_seed(seed)

    def region() -> torch.Tensor:
        raw = torch.randint(
            0, 256, (NUM_PAGES * PAGES * HEADS * HEAD_DIM * 2,), dtype=torch.uint8, generator=g
        )
        return raw.view(torch.float16).view(NUM_PAGES * PAGES, HEADS, HEAD_DIM).to(DEVICE)

    k, v = [region() for _ in range(LAYERS)], [region() for _ in range(LAYERS)]
    _settled()
    return KVRegions.create(k, v, page_size=PAGES, num_heads=HEADS, head_dim_k=HEAD_DIM)


def _settled() -> None:
    """Let the test's own default-stream writes land before the service streams read them."""
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _flip(view: torch.Tensor) -> None:
    view[view.numel() // 3] ^= 0x21
    _settled()


def _bytes(regions: KVRegions) -> list[torch.Tensor]:
    return [t.reshape(-1).view(torch.uint8).cpu().clone() for t in regions.regions]


async def _staged(backend: str) -> tuple[KVRegions, torch.Tensor, Any]:
    src = _pool(1)
    view = torch.empty(kernels.packed_nbytes(src, SRC_PAGES.size, HEADS), dtype=torch.uint8, device=DEVICE)
    check = await pack_hashed(PLAN, TARGET, src, SRC_PAGES, view, backend=backend)  # type: ignore[arg-type]
    return src, view, check


@pytest.mark.parametrize("backend", BACKENDS)
async def test_the_sender_check_is_the_checksum_of_the_packed_bytes(backend: str) -> None:
    """pack_hashed packs and hashes in one step: its check is the packed bytes' checksum, in the
    kind of the path (wsum64 on the device path, xxh3 for host bytes); without integrity, None."""
    src, view, check = await _staged(backend)
    assert torch.equal(view.cpu(), reference.pack(src, SRC_PAGES).cpu())
    kind = "wsum64" if backend == "triton" or DEVICE == "cuda" else "xxh3"
    assert check == (checksum.checksum(view, kind), kind)
    plain = torch.zeros_like(view)
    _settled()
    off = types.SimpleNamespace(integrity=False)
    assert await pack_hashed(off, TARGET, src, SRC_PAGES, plain, backend=backend) is None  # type: ignore[arg-type]
    assert torch.equal(plain, view)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_corrupted_batch_changes_no_page_and_a_clean_one_lands_byte_exact(backend: str) -> None:
    """One flipped byte in the staged batch: unpack_verified raises FAILED_PRECONDITION naming the
    batch and every destination byte is as before (the gated unpack ran and wrote nothing). The
    clean batch then lands exactly as the reference unpack."""
    src, view, check = await _staged(backend)
    dst, want = _pool(2), _pool(2)
    before = _bytes(dst)
    _flip(view)
    with pytest.raises(FailedPrecondition, match=r"checksum: the packed batch at position 7 does not match"):
        await unpack_verified(dst, view, DST_PAGES, check, "packed batch at position 7", backend=backend)  # type: ignore[arg-type]
    assert all(torch.equal(a, b) for a, b in zip(before, _bytes(dst), strict=True))
    _flip(view)
    await unpack_verified(dst, view, DST_PAGES, check, "packed batch at position 7", backend=backend)  # type: ignore[arg-type]
    reference.unpack(want, view, DST_PAGES)
    assert all(torch.equal(a, b) for a, b in zip(_bytes(want), _bytes(dst), strict=True))


async def test_a_batch_without_a_check_is_refused_untouched() -> None:
    """A commit that carries no checksum to a receiver that requires one: refused, nothing unpacked."""
    _, view, _ = await _staged("auto")
    dst = _pool(2)
    before = _bytes(dst)
    with pytest.raises(FailedPrecondition, match="carries none"):
        await unpack_verified(dst, view, DST_PAGES, None, "packed batch at position 0")
    assert all(torch.equal(a, b) for a, b in zip(before, _bytes(dst), strict=True))


async def test_landed_pages_pass_only_when_they_hold_the_senders_bytes() -> None:
    """landed_check (direct and fused commits): the receiver's pages packed as the sender packed
    its own hash to the sender's check; a page that was not written fails, naming the chunk."""
    src, view, check = await _staged("auto")
    dst = _pool(2)
    kernels.unpack(dst, view, DST_PAGES)
    _settled()
    await landed_check(dst, DST_PAGES, check, "direct chunk at position 0")
    stale = _pool(3)
    with pytest.raises(FailedPrecondition, match="direct chunk at position 0 does not match"):
        await landed_check(stale, DST_PAGES, check, "direct chunk at position 0")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="host pools: the interpreter only")
def test_a_corrupted_batch_fails_the_transfer_on_the_device_path(
    make_server, make_pool, monkeypatch, tmp_path
) -> None:
    """Through two services with the device path (Triton wsum64 behind the pack, the receiver's
    unpack gated on its verdict): a byte flipped after the sender's hash FAILS the transfer on both
    sides naming the batch, no page changed; the next transfer is DONE and byte-exact."""
    token = tmp_path / "peer-token"
    token.write_text("cluster-secret\n")
    a = secure_node(make_server, make_pool, 1, peer_token_file=str(token))
    b = secure_node(make_server, make_pool, 2, peer_token_file=str(token))
    try:
        peer = b.server.app.peer_address
        before = snapshot(b.pool)
        real_pack = functools.partial(pack_hashed, backend="triton")
        monkeypatch.setattr(
            inbound_mod, "unpack_verified", functools.partial(unpack_verified, backend="triton")
        )

        async def corrupting(plan: Any, target: Any, regions: Any, src: Any, view: Any) -> Any:
            check = await real_pack(plan, target, regions, src, view)
            assert check[1] == "wsum64"
            view[view.numel() // 2] ^= 0x5A
            return check

        monkeypatch.setattr(packed_mod, "pack_hashed", corrupting)
        b.client.expect_delta("t-bad", b.bs, prefix_pages=0, dst_page_indices=DST, deadline_ms=20_000)
        a.client.send_delta("t-bad", a.bs, src_page_indices=SRC, peer_address=peer, path="packed")
        st = one(b.client, "t-bad")
        assert st.state == "FAILED" and "checksum: the packed batch at position 0" in st.error, st
        assert one(a.client, "t-bad").state == "FAILED"
        assert_unchanged(b.pool, before)
        monkeypatch.setattr(packed_mod, "pack_hashed", real_pack)
        b.client.expect_delta("t-good", b.bs, prefix_pages=0, dst_page_indices=DST)
        a.client.send_delta("t-good", a.bs, src_page_indices=SRC, peer_address=peer, path="packed")
        assert (one(a.client, "t-good").state, one(b.client, "t-good").state) == ("DONE", "DONE")
        assert_pages_equal(b.pool, DST, a.pool, SRC)
    finally:
        a.client.close()
        b.client.close()
