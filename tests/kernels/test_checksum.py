"""Integrity checksums (kernels/checksum.py): deterministic, sensitive to any changed, swapped
or missing byte, and the same on every device."""

from __future__ import annotations

import pytest
import torch
import xxhash

from kvservice.kernels.checksum import _wsum64, checksum, default_kind, launch, on_device

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("kind", ["xxh3", "wsum64"])
@pytest.mark.parametrize("n", [0, 1, 3, 4, 4097, 1 << 16])
def test_a_changed_swapped_or_zeroed_byte_changes_the_checksum(kind: str, n: int) -> None:
    """Every single-byte flip, a swap of two words and zeroing change the value; equal bytes agree."""
    g = torch.Generator().manual_seed(n)
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    h = checksum(data, kind)
    assert h == checksum(data.clone(), kind) and 0 <= h < 2**64
    if n == 0:
        return
    for pos in {0, n // 2, n - 1}:
        bad = data.clone()
        bad[pos] ^= 0x10
        assert checksum(bad, kind) != h
    if n >= 8 and not torch.equal(data[:4], data[4:8]):
        swapped = data.clone()
        swapped[:4], swapped[4:8] = data[4:8], data[:4]
        assert checksum(swapped, kind) != h
    if bool(data.any()):
        assert checksum(torch.zeros_like(data), kind) != h


def test_xxh3_is_the_reference_xxh3() -> None:
    """'xxh3' is XXH3-64 of the raw bytes (what a C or Go receiver would compute)."""
    data = torch.arange(1000, dtype=torch.int32).view(torch.uint8)
    assert checksum(data, "xxh3") == xxhash.xxh3_64_intdigest(data.numpy().tobytes())
    assert default_kind(data) == "xxh3"


@pytest.mark.gpu
def test_wsum64_on_the_gpu_equals_the_cpu_value() -> None:
    """The GPU reduction gives the CPU's value (a receiver may hash on either side)."""
    data = torch.randint(0, 256, ((1 << 26) + 3,), dtype=torch.uint8)
    cuda = data.cuda()
    assert default_kind(cuda) == "wsum64"
    assert checksum(cuda, "wsum64") == checksum(data, "wsum64")
    assert checksum(cuda, "xxh3") == checksum(data, "xxh3")


@pytest.mark.parametrize("n", [0, 4, 4097, (1 << 16) + 4, 3 * (1 << 16) + 12])
def test_the_triton_wsum64_equals_the_torch_reference(n: int) -> None:
    """The one-pass Triton reduction (CUDA, or the interpreter here) gives the torch expression's value."""
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    assert _wsum64(data.to(DEVICE), backend="triton") == _wsum64(data, backend="torch")


@pytest.mark.parametrize(
    "kind,backend", [("xxh3", "auto"), ("wsum64", "auto"), ("wsum64", "torch"), ("wsum64", "triton")]
)
@pytest.mark.parametrize("n", [0, 5, 4097, 3 * (1 << 16) + 12])
def test_launch_gives_the_value_and_a_device_verdict(kind: str, backend: str, n: int) -> None:
    """launch (the data path's form): once its stream has passed it, value() is checksum's value;
    with an expected value, matches() and the gate (what a gated unpack reads) say 1 only if equal,
    for a value with its top bit set too."""
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    data = data.to(DEVICE)
    want = checksum(data.cpu(), kind)
    for expect in (None, want, want ^ 1, want ^ (1 << 63)):
        pending = launch(data, kind, expect, backend=backend)  # type: ignore[arg-type]
        if DEVICE == "cuda":
            torch.cuda.synchronize()  # stands for the caller's event
        assert pending.value() == want
        assert pending.matches() == (expect == want) == bool(pending.gate.item())
        assert pending.gate.device == data.device and pending.gate.dtype == torch.int64
    assert on_device(data.device, kind, backend) == (
        kind == "wsum64" and (backend == "triton" or DEVICE == "cuda" and backend == "auto")
    )  # type: ignore[arg-type]
