"""Probe (2 GPUs): may a kernel on GPU0 write an engine pool another process exported on GPU1?

    python3 bench/probe_two_gpu_ipc.py a|c1|c2|d|e     (one case per process: a fault is sticky)

a   fused kernel on cuda:0 writes a cuda:1 tensor of this process (peer access on)
c1  ... a cuda:1 allocation of a child process, opened here in cuda:1's context, peer access after
c2  ... the same, peer access before the open
d   that imported pool written by pack on cuda:0 -> cuMemcpyAsync -> unpack on cuda:1 (across.py)
e   the handle opened in cuda:0's context (lazy peer flag), fused kernel on cuda:0

Results on 2xH200: docs/gpu-verification/h200x2_ipc_peer_probe.log, docs/decisions/0017.
"""

import multiprocessing as mp
import sys
import traceback

import numpy as np
import torch

L, H, D, P, PS = 4, 8, 128, 64, 16  # layers, heads, dim, pages, page size


REGION = P * PS * H * D * 2  # bytes of one region (bf16)
SP, DP = np.array([1, 5, 9, 33, 40, 41]), np.array([2, 6, 40, 63, 0, 7])  # source -> destination pages


def regions(dev, tensors=None):
    from kvservice.kernels import KVRegions

    if tensors is None:
        tensors = [torch.randint(0, 255, (REGION,), dtype=torch.uint8, device=dev) for _ in range(2 * L)]
    return KVRegions.create(
        tensors[:L], tensors[L:], page_size=PS, num_heads=H, head_dim_k=D, itemsize=2
    ), tensors


def copy_on(src, dst):
    """The fused kernel on cuda:0, synchronised."""
    from kvservice.kernels.fused import copy_pages

    s = torch.cuda.Stream(device=0)
    with torch.cuda.device(0), torch.cuda.stream(s):
        n = copy_pages(src, dst, SP, DP)
    s.synchronize()
    torch.cuda.synchronize(1)
    return n


def check(st, dt):
    for a, b in zip(st, dt, strict=True):
        assert torch.equal(a.view(P, -1).cpu()[SP], b.view(P, -1).cpu()[DP]), "bytes differ"


def child(conn):
    """Another process: exports a zeroed cuda:1 allocation, holds it until told to go."""
    from kvservice_client import cuda_ipc

    t = torch.zeros(2 * L * REGION, dtype=torch.uint8, device="cuda:1")
    e = cuda_ipc.tensor_export(t)
    conn.send((e.handle, e.offset))
    conn.recv()


def imported(steps):
    """Open a child's export with ``steps(handle) -> base``; returns
    the opened base, the destination regions over it and their tensors, and the child's end."""
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=child, args=(b,))
    p.start()
    h, off = a.recv()
    base = steps(h)
    from kvservice.buffers.memory import _CudaArray

    full = torch.as_tensor(_CudaArray(base + off, 2 * L * REGION), device="cuda:1")
    dt = [full[i * REGION : (i + 1) * REGION] for i in range(2 * L)]
    dst, _ = regions("cuda:1", tensors=dt)

    def end():
        a.send(1)
        p.join(10)

    return base, dst, dt, end


def case_a():
    from kvservice_client import cuda_ipc

    print("peer 0->1:", cuda_ipc.enable_peer_access(0, 1), flush=True)
    src, st = regions("cuda:0")
    dst, dt = regions("cuda:1")
    print("A bytes", copy_on(src, dst))
    check(st, dt)
    print("A ok")


def case_c(order):
    from kvservice_client import cuda_ipc

    def steps(h):
        if order == "peer_first":
            print("peer 0->1:", cuda_ipc.enable_peer_access(0, 1), flush=True)
        base, ordinal = cuda_ipc.open_handle(h, 1)
        print("opened on", ordinal, flush=True)
        if order == "open_first":
            print("peer 0->1:", cuda_ipc.enable_peer_access(0, 1), flush=True)
        return base

    base, dst, dt, end = imported(steps)
    src, st = regions("cuda:0")
    print("C bytes", copy_on(src, dst), flush=True)
    check(st, dt)
    print("C ok", order, flush=True)
    del dst, dt
    cuda_ipc.close_handle(base)
    print("C closed", flush=True)
    end()


def case_d():
    """IPC-imported dst on cuda:1, copy_across from cuda:0 (the fix)."""
    from kvservice_client import cuda_ipc

    from kvservice.kernels.across import copy_across

    def steps(h):
        base, _ = cuda_ipc.open_handle(h, 1)
        print("peer", cuda_ipc.enable_peer_access(0, 1), flush=True)
        return base

    base, dst, dt, end = imported(steps)
    src, st = regions("cuda:0")
    ps, ls, out = torch.cuda.Stream(device=0), torch.cuda.Stream(device=0), torch.cuda.Stream(device=1)
    with torch.cuda.device(1), torch.cuda.stream(out):
        n = copy_across(src, dst, SP, DP, pack_stream=ps, link_stream=ls, chunk_bytes=1 << 20)
    out.synchronize()
    torch.cuda.synchronize(0)
    check(st, dt)
    print("D ok", n, flush=True)
    del dst, dt
    cuda_ipc.close_handle(base)
    print("D closed", flush=True)
    end()


def case_e():
    """The handle of a cuda:1 allocation opened with cuda:0's context current (lazy peer access):
    can the fused kernel on cuda:0 write it? (a future fused two-GPU route)"""
    from kvservice_client import cuda_ipc

    def steps(h):
        print("peer", cuda_ipc.enable_peer_access(0, 1), flush=True)
        base, ordinal = cuda_ipc.open_handle(h, 0)
        print("opened in ctx of", ordinal, flush=True)
        try:
            b2, o2 = cuda_ipc.open_handle(h, 1)
            print("second open in ctx1 ok", o2, b2 == base, flush=True)
        except Exception as exc:
            print("second open in ctx1 refused:", exc, flush=True)
        return base

    _, dst, dt, end = imported(steps)
    src, st = regions("cuda:0")
    print("E bytes", copy_on(src, dst), flush=True)
    check(st, dt)
    print("E ok (fused kernel on cuda:0 wrote the imported cuda:1 pool)", flush=True)
    end()


if __name__ == "__main__":
    cases = {
        "a": case_a,
        "c1": lambda: case_c("open_first"),
        "c2": lambda: case_c("peer_first"),
        "d": case_d,
        "e": case_e,
    }
    try:
        cases[sys.argv[1]]()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
