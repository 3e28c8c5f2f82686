"""End-to-end integrity checksums of packed bytes (``transfer_integrity``; docs/design/security.md).

The sender hashes each packed staging batch (or, on the direct and fused routes, the chunk's
pages packed for the receiver rank); the receiver hashes the same bytes before it unpacks them
(or its pages before DONE) and fails the transfer on a mismatch. Two algorithms, named in
``CommitChunkRequest.checksum_kind`` so either side can compute the other's:

* ``xxh3``: XXH3-64 (seed 0) over the bytes. Bytes in host memory: no copy.
* ``wsum64``: a GPU reduction for bytes in VRAM, so a batch is never copied to the host to be
  hashed. The bytes are read as little-endian 32-bit words ``w[i]`` (zero-padded) and

      wsum64 = ( Σ_i  w[i] · m(i)  +  Σ_i  (w[i] XOR m(i)) · 2^32 )  mod 2^64
      m(i)   = (i · 0x9E3779B1 + 0x7F4A7C15) mod 2^32, forced odd

  Position-weighted, so swapped, zeroed, stale or flipped words change it. It detects
  corruption and unwritten data, not a forger who controls the bytes (it is not a MAC; an
  authenticated peer that may write may also hash what it wrote).

Both run on any device: ``wsum64`` is Triton on CUDA (``_checksum_triton``) and a torch
expression on the host (the reference); ``xxh3`` copies VRAM bytes to the host.

``checksum`` answers at once (it waits for the device). ``launch`` is the data path's form: on
CUDA it only enqueues the Triton passes on the current stream, behind the pack (sender) or ahead
of a gated unpack (receiver), and the answer is read from a pinned slot once an event recorded
after it has completed, the one the caller already waits for::

    stream:  pack ─▶ wsum64 ─▶ finish ─▶ copy slot to host ─▶ [event]        sender
    stream:  wsum64 ─▶ finish(expect) ─▶ unpack gated on slot[1] ─▶ [event]  receiver
    host:    after the event: Pending.value() / Pending.matches()
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
import xxhash

__all__ = ["KINDS", "Backend", "Pending", "checksum", "default_kind", "launch", "on_device"]

KINDS = ("xxh3", "wsum64")
_CHUNK_WORDS = 1 << 24  # bounds the temporaries of wsum64 (a few hundred MiB at most)
_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF

Backend = Literal["auto", "triton", "torch"]


@dataclasses.dataclass(frozen=True)
class Pending:
    """A launched checksum. Read it only once the launching stream has passed the launch (the
    caller waited for an event recorded after it): ``host`` is then final."""

    host: torch.Tensor  # int64 [2] in host memory (pinned on CUDA): the value's bits, 1 if it matched
    gate: torch.Tensor  # int64 [1] on the bytes' device: 1 if it matched (unpack's ``gate``), else 0

    def value(self) -> int:
        """The checksum (an unsigned 64-bit int)."""
        return int(self.host[0]) & _MASK64

    def matches(self) -> bool:
        """Whether it equals the value ``launch`` was given as ``expect`` (False without one)."""
        return bool(self.host[1])


def default_kind(data: torch.Tensor) -> str:
    """The algorithm the sender uses for bytes on ``data``'s device."""
    return "wsum64" if data.device.type == "cuda" else "xxh3"


def on_device(device: torch.device, kind: str, backend: Backend = "auto") -> bool:
    """Whether ``launch`` of bytes on ``device`` only enqueues work (Triton ``wsum64``) rather than
    hashing at once. ``backend="triton"``: the Triton passes even on host tensors, which needs
    ``TRITON_INTERPRET=1`` (tests)."""
    return kind == "wsum64" and (backend == "triton" or (backend == "auto" and device.type == "cuda"))


def checksum(data: torch.Tensor, kind: str) -> int:
    """The ``kind`` checksum (an unsigned 64-bit int) of the uint8 tensor ``data``."""
    _check(data, kind)
    if kind == "xxh3":
        host = data if data.device.type == "cpu" else data.cpu()
        view = memoryview(host.contiguous().numpy())  # type: ignore[arg-type]
        return int(xxhash.xxh3_64_intdigest(view))
    return _wsum64(data)


def launch(data: torch.Tensor, kind: str, expect: int | None = None, backend: Backend = "auto") -> Pending:
    """Start the ``kind`` checksum of the uint8 tensor ``data`` on the current stream; with
    ``expect``, also the device-side verdict ``gate`` (1: equal). When ``on_device`` (``wsum64``
    on CUDA) it returns at once and the result is read after the caller's event; otherwise it
    hashes now on the host (an ``xxh3`` of VRAM bytes copies them and waits: call it off the loop).
    """
    _check(data, kind)
    if not on_device(data.device, kind, backend):
        value = checksum(data, kind)
        ok = int(expect is not None and value == expect)
        host = torch.tensor([value - ((value >> 63) << 64), ok], dtype=torch.int64)
        gate = (
            host[1:]
            if data.device.type == "cpu"
            else torch.full((1,), ok, dtype=torch.int64, device=data.device)
        )
        return Pending(host, gate)
    from ._checksum_triton import wsum64_into

    slot = torch.empty(2, dtype=torch.int64, device=data.device)
    wsum64_into(_words(data), slot, expect)
    if data.device.type == "cpu":  # the Triton interpreter (tests): already final
        return Pending(slot, slot[1:])
    # NOTE: copy_ records the stream on the pinned block, so torch's host allocator cannot hand
    # it out again before the copy ran, even if the caller drops it early (a cancelled transfer).
    host = torch.empty(2, dtype=torch.int64, pin_memory=True)
    host.copy_(slot, non_blocking=True)
    return Pending(host, slot[1:])


def _check(data: torch.Tensor, kind: str) -> None:
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError("checksum: data must be a 1-D uint8 tensor")
    if kind not in KINDS:
        raise ValueError(f"checksum_kind: {kind!r} is not one of {KINDS}")


def _words(data: torch.Tensor) -> torch.Tensor:
    pad = (-data.numel()) % 4
    if pad:
        data = torch.cat([data, torch.zeros(pad, dtype=torch.uint8, device=data.device)])
    return data.contiguous().view(torch.int32)


def _wsum64(data: torch.Tensor, backend: Backend = "auto") -> int:
    words = _words(data)
    if backend == "triton" or (backend == "auto" and data.device.type == "cuda"):
        from ._checksum_triton import wsum64

        return wsum64(words)
    total = torch.zeros((), dtype=torch.int64, device=data.device)
    for start in range(0, words.numel(), _CHUNK_WORDS):
        w = words[start : start + _CHUNK_WORDS].to(torch.int64) & _MASK32
        i = torch.arange(start, start + w.numel(), dtype=torch.int64, device=data.device)
        m = ((i * 0x9E3779B1 + 0x7F4A7C15) & _MASK32) | 1
        # NOTE: int64 sums wrap modulo 2^64 (two's complement), which is the definition above.
        total += (w * m).sum() + ((w ^ m) << 32).sum()
    return int(total.item()) & _MASK64
