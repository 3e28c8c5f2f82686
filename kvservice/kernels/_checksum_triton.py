"""``wsum64`` (see ``checksum``) as one Triton pass over the bytes: each program reduces
``BLOCK * ITERS`` words to one wrapped 64-bit partial sum; the partials are summed by torch.

The torch expression in ``checksum`` builds eight int64 temporaries per word and reads the bytes
about ten times; this reads them once (64 MiB: ~1.5 ms -> tens of µs on an H100).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["wsum64"]

_BLOCK = 2048  # words per step of a program
_ITERS = 8  # steps per program: 64 KiB of bytes per program


@triton.jit
def _wsum64_kernel(
    words_ptr,  # *int32: the bytes as little-endian 32-bit words
    partial_ptr,  # *int64 [programs]: each program's wrapped sum (the bits of a uint64)
    n_words,  # words to read
    BLOCK: tl.constexpr,
    ITERS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.uint64)
    mul = tl.full([BLOCK], 0x9E3779B1, tl.uint64)
    add = tl.full([BLOCK], 0x7F4A7C15, tl.uint64)
    low = tl.full([BLOCK], 0xFFFFFFFF, tl.uint64)
    for it in range(ITERS):
        idx = (pid * ITERS + it) * BLOCK + tl.arange(0, BLOCK)
        mask = idx < n_words
        w = tl.load(words_ptr + idx, mask=mask, other=0).to(tl.uint32, bitcast=True).to(tl.uint64)
        m = ((idx.to(tl.uint64) * mul + add) & low) | 1
        acc += tl.where(mask, w * m + ((w ^ m) << 32), 0)
    tl.store(partial_ptr + tl.program_id(0), tl.sum(acc, axis=0).to(tl.int64, bitcast=True))


def wsum64(words: torch.Tensor) -> int:
    """``wsum64`` of the contiguous int32 tensor ``words`` (an unsigned 64-bit int); waits for it."""
    n = words.numel()
    if n == 0:
        return 0
    per = _BLOCK * _ITERS
    partial = torch.empty(triton.cdiv(n, per), dtype=torch.int64, device=words.device)
    _wsum64_kernel[(partial.numel(),)](words, partial, n, BLOCK=_BLOCK, ITERS=_ITERS)
    # NOTE: the int64 sum wraps modulo 2^64 (two's complement), which is the definition.
    return int(partial.sum().item()) & 0xFFFFFFFFFFFFFFFF
