"""The tier's host memory: pinned (page-locked, registered with CUDA) when CUDA is present, so
host-to-device copies run at the DMA rate; plain anonymous memory in CPU mode (touched lazily by
the kernel, so a large arena costs nothing until it is filled)."""

from __future__ import annotations

import torch

__all__ = ["host_pages"]


def host_pages(capacity: int, page_bytes: int) -> torch.Tensor:
    """A ``[capacity, page_bytes]`` uint8 CPU tensor, pinned when CUDA is available."""
    pin = torch.cuda.is_available()
    return torch.empty((capacity, page_bytes), dtype=torch.uint8, pin_memory=pin)
