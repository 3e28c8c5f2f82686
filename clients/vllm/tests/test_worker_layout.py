"""vLLM's CPU KV-cache layout as kvservice sees it, and the shared-memory allocation hook."""

from __future__ import annotations

import pytest
import torch
from kvservice_vllm.worker import KVHeads, _SharedZeros, kv_layout


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


def test_cpu_layout_is_hnd_kv_per_head() -> None:
    """The CPU backend's [blocks, heads, block, K|V] is the hnd_kv page layout, heads and all."""
    buf, views = _cpu_views()
    layout, k, v = kv_layout(views, 32, KVHeads(total=4, local=2, head_dim=64, tp_size=2, tp_rank=1))
    assert (layout.num_layers, layout.page_size, layout.num_pages) == (2, 32, 8)
    assert (layout.kind, layout.page_layout, layout.local_kv_heads, layout.total_kv_heads) == (
        "mha",
        "hnd_kv",
        2,
        4,
    )
    assert (layout.tp_size, layout.tp_rank, layout.head_dim_k, layout.head_dim_v) == (2, 1, 64, 64)
    assert layout.region_bytes_k == 8 * 2 * 32 * 128 * 4 and layout.dtype == "float32" and v == []
    assert [f.data_ptr() for f in k] == [t.data_ptr() for t in views.values()]


def test_unknown_heads_fall_back_to_opaque_blocks() -> None:
    buf, views = _cpu_views()
    layout, k, v = kv_layout(views, 32)
    assert (layout.kind, layout.page_size, layout.num_pages) == ("mla", 32, 8)
    assert layout.page_bytes_k == 2 * 32 * 128 * 4 and k[1].numel() == 8 * 2 * 32 * 128 and v == []


@pytest.mark.parametrize("hnd", [False, True])
def test_kv_planes_are_nhd_or_hnd(hnd: bool) -> None:
    """[2, blocks, block, heads, dim] K/V planes (CUDA backends), either stride order."""
    heads = KVHeads(total=2, local=2, head_dim=64)
    if hnd:
        t = torch.zeros(2, 8, 2, 32, 64).permute(0, 1, 3, 2, 4)  # physically [2, blocks, heads, block, dim]
    else:
        t = torch.zeros(2, 8, 32, 2, 64)
    layout, k, v = kv_layout({"l0": t, "l1": t.clone()}, 32, heads)
    assert layout.page_layout == ("hnd" if hnd else "nhd") and len(k) == len(v) == 2
    assert k[0].data_ptr() == t.data_ptr() and v[0].data_ptr() == t[1].data_ptr()
    assert k[0].numel() == v[0].numel() == 8 * 32 * 2 * 64


def _vllm032_cache(order: str, blocks: int = 8, heads: int = 2, block: int = 32, dim: int = 64):
    """vLLM 0.32's GPU view of one layer: [blocks, heads, block, K|V] over memory in ``order``."""
    if order == "LBNHC":
        return torch.zeros(blocks, block, heads, 2 * dim).permute(0, 2, 1, 3)
    return torch.zeros(blocks, heads, block, 2 * dim)  # LBHNC


@pytest.mark.parametrize(("order", "want"), [("LBNHC", "nhc"), ("LBHNC", "hnc")])
def test_vllm032_gpu_caches_are_mapped_per_head(order: str, want: str) -> None:
    """[blocks, heads, block, K|V] read by the GPU backends (K and V in each row) in either
    layer-compact order is per head, with this rank's heads, one region a layer."""
    views = {"l0": _vllm032_cache(order), "l1": _vllm032_cache(order)}
    heads = KVHeads(total=4, local=2, head_dim=64, tp_size=2, tp_rank=1)
    layout, k, v = kv_layout(views, 32, heads, cpu_attention=False)
    assert (layout.kind, layout.page_layout, layout.num_pages, layout.tp_rank) == ("mha", want, 8, 1)
    assert layout.region_bytes_k == 8 * 32 * 2 * 128 * 4 and v == []
    assert [f.data_ptr() for f in k] == [t.data_ptr() for t in views.values()]


def test_the_same_shape_on_cpu_attention_is_hnd_kv() -> None:
    """The CPU backend reads the very same dense tensor as a head's K rows then V rows."""
    layout, _, _ = kv_layout({"l0": _vllm032_cache("LBHNC")}, 32, KVHeads(2, 2, 64))
    assert layout.page_layout == "hnd_kv"
    with pytest.raises(ValueError, match="slice by head"):  # CPU attention reads no LBNHC order
        kv_layout({"l0": _vllm032_cache("LBNHC")}, 32, KVHeads(4, 2, 64, tp_size=2))


@pytest.mark.parametrize("hnd", [False, True])
def test_flashinfer_blocks_are_kv_nhd_or_kv_hnd(hnd: bool) -> None:
    """FlashInfer's [blocks, 2, block, heads, dim] (K and V side by side in each block)."""
    if hnd:
        t = torch.zeros(8, 2, 2, 32, 64).permute(0, 1, 3, 2, 4)
    else:
        t = torch.zeros(8, 2, 32, 2, 64)
    layout, k, v = kv_layout({"l0": t}, 32, KVHeads(total=2, local=2, head_dim=64), cpu_attention=False)
    assert layout.page_layout == ("kv_hnd" if hnd else "kv_nhd") and v == []
    assert k[0].data_ptr() == t.data_ptr() and k[0].numel() == t.numel()


@pytest.mark.parametrize("shape", [(8, 32, 576), (8, 1, 32, 576)])
def test_mla_caches_are_latent_rows(shape: tuple[int, ...]) -> None:
    """An MLA cache ([blocks, block, 576], or vLLM 0.32's [blocks, 1, block, 576]): one latent row
    a token, the layout SGLang's MLA pool has."""
    layout, k, v = kv_layout({"l0": torch.zeros(*shape, dtype=torch.bfloat16)}, 32)
    assert (layout.kind, layout.head_dim_k, layout.num_pages, layout.dtype) == ("mla", 576, 8, "bfloat16")
    assert v == [] and k[0].numel() == 8 * 32 * 576


def test_block_outermost_layouts_are_refused_with_tp() -> None:
    """vLLM's BLNHC: a layer's blocks lie between the other layers' (not one run a layer)."""
    both = torch.zeros(8, 2, 32, 2, 128)  # [blocks, layers, block, heads, K|V]
    layer0 = both[:, 0].permute(0, 2, 1, 3)  # [blocks, heads, block, K|V]
    with pytest.raises(ValueError, match="slice by head, which TP 2 needs"):
        kv_layout({"l0": layer0}, 32, KVHeads(4, 2, 64, tp_size=2), cpu_attention=False)
    with pytest.raises(ValueError, match="not one contiguous run"):
        kv_layout({"l0": layer0}, 32)


def test_block_outermost_planes_are_refused_with_tp() -> None:
    planes = {"l0": torch.zeros(2, 8, 32, 2, 64).permute(1, 0, 2, 3, 4)}  # [blocks, K|V, ...]
    with pytest.raises(ValueError, match="not one contiguous run"):
        kv_layout(planes, 32)
    with pytest.raises(ValueError, match="slice by head, which TP 2 needs"):
        kv_layout(planes, 32, KVHeads(total=4, local=2, head_dim=64, tp_size=2))


def test_the_hook_replaces_only_the_kv_backing_buffer() -> None:
    owner = _Owner()
    with _SharedZeros(owner):  # type: ignore[arg-type]
        kv = torch.zeros(1 << 20, dtype=torch.int8, device=torch.device("cpu"))
        small = torch.zeros(16, dtype=torch.int8, device="cpu")
        other = torch.zeros(1 << 20, dtype=torch.float32)
    assert owner.sizes == [1 << 20] and int(kv[0]) == 7
    assert int(small.sum()) == 0 and other.dtype == torch.float32


def test_fp8_caches_register_under_kvservice_dtype_names() -> None:
    """torch's float8_e4m3fn is kvservice's float8_e4m3 (else the service sees no dtype at all)."""
    t = torch.zeros(8, 32, 2, 128, dtype=torch.float8_e4m3fn).permute(0, 2, 1, 3)
    layout, _, _ = kv_layout({"l0": t}, 32, KVHeads(2, 2, 64), cpu_attention=False)
    assert layout.dtype == "float8_e4m3" and layout.to_proto().dtype != 0
    with pytest.raises(ValueError, match=r"kv_caches: dtype torch.float64"):
        kv_layout({"l0": torch.zeros(8, 2, 32, 128, dtype=torch.float64)}, 32, KVHeads(2, 2, 64))


def test_an_mla_cache_on_a_tp_rank_is_a_replica_of_that_rank() -> None:
    t = torch.zeros(8, 32, 96, dtype=torch.bfloat16)
    layout, k, v = kv_layout({"l0": t, "l1": t.clone()}, 32, None, mla_tp=(4, 3))
    assert layout.kind == "mla" and (layout.tp_size, layout.tp_rank) == (4, 3) and len(k) == 2 and v == []
    with pytest.raises(ValueError, match="mla_tp"):
        kv_layout({"l0": t}, 32, None, mla_tp=(2, 2))
