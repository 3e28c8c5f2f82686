"""vLLM's CPU KV-cache layout as kvservice sees it, and the shared-memory allocation hook."""

from __future__ import annotations

import pytest
import torch
from kvservice_vllm.worker import _SharedZeros, kv_layout


class _Owner:
    def __init__(self) -> None:
        self.sizes: list[int] = []

    def _shared_buffer(self, nbytes: int) -> torch.Tensor:
        self.sizes.append(nbytes)
        return torch.full((nbytes,), 7, dtype=torch.int8)


def _cpu_views(layers: int = 2, blocks: int = 8, heads: int = 2, block: int = 32, dim: int = 64):
    """What vLLM 0.32's CPU backend registers: one int8 buffer, per layer [B, H, N, K|V] views."""
    per_layer = blocks * heads * block * 2 * dim
    buf = torch.zeros(layers * per_layer * 4, dtype=torch.int8)
    f = buf.view(torch.float32)
    return buf, {
        f"l{i}": f[i * per_layer : (i + 1) * per_layer].view(blocks, heads, block, 2 * dim)
        for i in range(layers)
    }


def test_cpu_layout_is_one_page_a_block_per_layer() -> None:
    buf, views = _cpu_views()
    layout, flats = kv_layout(views, 32)
    assert (layout.num_layers, layout.page_size, layout.num_pages) == (2, 32, 8)
    assert layout.page_bytes_k == 2 * 32 * 128 * 4 and layout.dtype == "float32"
    assert [f.data_ptr() for f in flats] == [v.data_ptr() for v in views.values()]
    assert flats[1].numel() == 8 * 2 * 32 * 128


def test_kv_planes_are_refused_with_the_reason() -> None:
    planes = {"l0": torch.zeros(2, 8, 32, 2, 64)}  # [K|V, blocks, ...]: a block is two runs
    planes["l0"] = planes["l0"].permute(1, 0, 2, 3, 4)
    with pytest.raises(ValueError, match="not one contiguous run"):
        kv_layout(planes, 32)


def test_the_hook_replaces_only_the_kv_backing_buffer() -> None:
    owner = _Owner()
    with _SharedZeros(owner):  # type: ignore[arg-type]
        kv = torch.zeros(1 << 20, dtype=torch.int8, device=torch.device("cpu"))
        small = torch.zeros(16, dtype=torch.int8, device="cpu")
        other = torch.zeros(1 << 20, dtype=torch.float32)
    assert owner.sizes == [1 << 20] and int(kv[0]) == 7
    assert int(small.sum()) == 0 and other.dtype == torch.float32
