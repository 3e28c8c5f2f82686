"""End-to-end integrity checksums of packed bytes (issue 33, ``transfer_integrity``).

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

Both run on any device: ``wsum64`` is one Triton pass on CUDA (``_checksum_triton``) and a torch
expression on the host (the reference); ``xxh3`` copies VRAM bytes to the host.
"""

from __future__ import annotations

import torch
import xxhash

__all__ = ["KINDS", "checksum", "default_kind"]

KINDS = ("xxh3", "wsum64")
_CHUNK_WORDS = 1 << 24  # bounds the temporaries of wsum64 (a few hundred MiB at most)
_MASK32 = 0xFFFFFFFF


def default_kind(data: torch.Tensor) -> str:
    """The algorithm the sender uses for bytes on ``data``'s device."""
    return "wsum64" if data.device.type == "cuda" else "xxh3"


def checksum(data: torch.Tensor, kind: str) -> int:
    """The ``kind`` checksum (an unsigned 64-bit int) of the uint8 tensor ``data``."""
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError("checksum: data must be a 1-D uint8 tensor")
    if kind == "xxh3":
        host = data if data.device.type == "cpu" else data.cpu()
        return int(xxhash.xxh3_64_intdigest(memoryview(host.contiguous().numpy())))
    if kind == "wsum64":
        return _wsum64(data)
    raise ValueError(f"checksum_kind: {kind!r} is not one of {KINDS}")


def _wsum64(data: torch.Tensor, backend: str = "auto") -> int:
    pad = (-data.numel()) % 4
    if pad:
        data = torch.cat([data, torch.zeros(pad, dtype=torch.uint8, device=data.device)])
    words = data.contiguous().view(torch.int32)
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
    return int(total.item()) & 0xFFFFFFFFFFFFFFFF
