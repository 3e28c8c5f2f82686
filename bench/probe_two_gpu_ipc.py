"""Probe (2 GPUs): may a kernel on GPU0 write an engine pool another process exported on GPU1?

    python3 bench/probe_two_gpu_ipc.py a|c1|c2|d|e     (one case per process: a fault is sticky)

a   fused kernel on cuda:0 writes a cuda:1 tensor of this process (peer access on)
c1  ... a cuda:1 allocation of a child process, opened here in cuda:1's context, peer access after
c2  ... the same, peer access before the open
d   that imported pool written by pack on cuda:0 -> cuMemcpyAsync -> unpack on cuda:1 (across.py)
e   the handle opened in cuda:0's context (lazy peer flag), fused kernel on cuda:0

Results on 2xH200: docs/gpu-verification/h200x2_ipc_peer_probe.log, docs/design-notes.md §19.
"""

import multiprocessing as mp
import sys
import traceback

import numpy as np
import torch

L, H, D, P, PS = 4, 8, 128, 64, 16  # layers, heads, dim, pages, page size


def regions(dev, fill=None, tensors=None):
    from kvservice.kernels import KVRegions

    if tensors is None:
        tensors = [
            torch.randint(0, 255, (P * PS * H * D * 2,), dtype=torch.uint8, device=dev) for _ in range(2 * L)
        ]
    return KVRegions.create(
        tensors[:L], tensors[L:], page_size=PS, num_heads=H, head_dim_k=D, itemsize=2
    ), tensors


def copy_on(src, dst, sp, dp):
    from kvservice.kernels.fused import copy_pages

    s = torch.cuda.Stream(device=0)
    with torch.cuda.device(0), torch.cuda.stream(s):
        n = copy_pages(src, dst, sp, dp)
    s.synchronize()
    return n


def check(st, dt, sp, dp):
    for a, b in zip(st, dt, strict=True):
        av = a.view(P, -1).cpu()
        bv = b.view(P, -1).cpu()
        assert torch.equal(av[sp], bv[dp]), "bytes differ"


def case_a():
    from kvservice_client import cuda_ipc

    print("peer 0->1:", cuda_ipc.enable_peer_access(0, 1), flush=True)
    src, st = regions("cuda:0")
    dst, dt = regions("cuda:1")
    sp = np.array([1, 5, 9, 33])
    dp = np.array([2, 6, 40, 63])
    print("A bytes", copy_on(src, dst, sp, dp))
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    check(st, dt, sp, dp)
    print("A ok")


def child(conn):
    from kvservice_client import cuda_ipc

    t = torch.zeros(2 * L * P * PS * H * D * 2, dtype=torch.uint8, device="cuda:1")
    e = cuda_ipc.tensor_export(t)
    conn.send((e.handle, e.offset, e.allocation_size))
    conn.recv()
    conn.send(t.cpu().numpy().tobytes()[:16])
    conn.recv()


def case_c(order):
    from kvservice_client import cuda_ipc

    from kvservice.buffers.memory import _CudaArray

    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=child, args=(b,))
    p.start()
    h, off, size = a.recv()
    if order == "peer_first":
        print("peer 0->1:", cuda_ipc.enable_peer_access(0, 1), flush=True)
    base, ordinal = cuda_ipc.open_handle(h, 1)
    print("opened on", ordinal, flush=True)
    if order == "open_first":
        print("peer 0->1:", cuda_ipc.enable_peer_access(0, 1), flush=True)
    full = torch.as_tensor(_CudaArray(base + off, 2 * L * P * PS * H * D * 2), device="cuda:1")
    per = P * PS * H * D * 2
    dt = [full[i * per : (i + 1) * per] for i in range(2 * L)]
    src, st = regions("cuda:0")
    dst, _ = regions("cuda:1", tensors=dt)
    sp = np.array([1, 5, 9, 33])
    dp = np.array([2, 6, 40, 63])
    print("C bytes", copy_on(src, dst, sp, dp), flush=True)
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    check(st, dt, sp, dp)
    print("C ok", order, flush=True)
    del dst, dt, full
    torch.cuda.synchronize(1)
    cuda_ipc.close_handle(base)
    print("C closed", flush=True)
    a.send(1)
    a.recv()
    a.send(1)
    p.join(10)


def case_d():
    """IPC-imported dst on cuda:1, copy_across from cuda:0 (the fix)."""
    from kvservice_client import cuda_ipc

    from kvservice.buffers.memory import _CudaArray
    from kvservice.kernels.across import copy_across

    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=child, args=(b,))
    p.start()
    h, off, size = a.recv()
    base, ordinal = cuda_ipc.open_handle(h, 1)
    print("peer", cuda_ipc.enable_peer_access(0, 1), flush=True)
    per = P * PS * H * D * 2
    full = torch.as_tensor(_CudaArray(base + off, 2 * L * per), device="cuda:1")
    dt = [full[i * per : (i + 1) * per] for i in range(2 * L)]
    src, st = regions("cuda:0")
    dst, _ = regions("cuda:1", tensors=dt)
    sp = np.array([1, 5, 9, 33, 40, 41])
    dp = np.array([2, 6, 40, 63, 0, 7])
    ps, ls, out = torch.cuda.Stream(device=0), torch.cuda.Stream(device=0), torch.cuda.Stream(device=1)
    with torch.cuda.device(1), torch.cuda.stream(out):
        n = copy_across(src, dst, sp, dp, pack_stream=ps, link_stream=ls, chunk_bytes=1 << 20)
    out.synchronize()
    torch.cuda.synchronize(0)
    check(st, dt, sp, dp)
    print("D ok", n, flush=True)
    del dst, dt, full
    cuda_ipc.close_handle(base)
    print("D closed", flush=True)
    a.send(1)
    a.recv()
    a.send(1)
    p.join(10)


def case_e():
    """The handle of a cuda:1 allocation opened with cuda:0's context current (lazy peer access):
    can the fused kernel on cuda:0 write it? (a future fused two-GPU route)"""
    from kvservice_client import cuda_ipc

    from kvservice.buffers.memory import _CudaArray

    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=child, args=(b,))
    p.start()
    h, off, size = a.recv()
    print("peer", cuda_ipc.enable_peer_access(0, 1), flush=True)
    base, ordinal = cuda_ipc.open_handle(h, 0)
    print("opened in ctx of", ordinal, flush=True)
    try:
        b2, o2 = cuda_ipc.open_handle(h, 1)
        print("second open in ctx1 ok", o2, b2 == base, flush=True)
    except Exception as exc:
        print("second open in ctx1 refused:", exc, flush=True)
        b2 = None
    per = P * PS * H * D * 2
    full = torch.as_tensor(_CudaArray(base + off, 2 * L * per), device="cuda:1")
    dt = [full[i * per : (i + 1) * per] for i in range(2 * L)]
    src, st = regions("cuda:0")
    dst, _ = regions("cuda:1", tensors=dt)
    sp = np.array([1, 5, 9, 33])
    dp = np.array([2, 6, 40, 63])
    print("E bytes", copy_on(src, dst, sp, dp), flush=True)
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    check(st, dt, sp, dp)
    print("E ok (fused kernel on cuda:0 wrote the imported cuda:1 pool)", flush=True)
    a.send(1)
    a.recv()
    a.send(1)
    p.join(10)


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
