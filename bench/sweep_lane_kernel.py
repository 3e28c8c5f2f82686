"""The native lane's copy kernel and variants of it against a device copy of the same bytes (GPU).

The lane launches the Triton kernel of kvservice/kernels/lane_copy.py, compiled ahead of time to
cubins (kvservice/kernels/aot.py; ``lane_*`` rows); here the same cubins, Triton variants of other
launch shapes and CUDA experiments (persistent blocks, Hopper's bulk copy) load through CuPy and copy
the same-node 2 GiB row's pages (32 layers x K/V, 1,024 scattered 32 KiB pages of pools of 2,048) with
the lane's argument layout: a table of regions (src, dst, strides, bytes) and (src page, dst page)
pairs. Each variant is checked byte for byte and timed with CUDA events against ``copy_`` of 2 GiB,
interleaved over rounds::

    python3 bench/sweep_lane_kernel.py --out /tmp/kvservice-bench  # sweep_lane_kernel_<gpu>.json
    python3 bench/sweep_lane_kernel.py --src-gpu 0 --dst-gpu 1  # across two GPUs (peer access)

Rows ``lane_slice_*``: the lane kernel's head-slice path (mixed TP 4 -> 2 and 2 -> 1, H = 8:
each sender page's 16 tokens x 2 (4) heads into 512 (1,024)-byte runs of the receiver's tokens)
with the block the lane picks (the small one where a block moves at most 8 KiB), against a device
copy of the same bytes (``copy_slice_*``); ``tslice_*``: the same kernel with other blocks (threads,
words a thread).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import cupy as cp
import numpy as np

# Variants: name -> (source, how to size the launch). "grid3": the lane's (pairs, regions,
# chunks) grid; "persistent": blocks = SMs x per_sm, each looping over (pair, region, chunk) items.
# Hopper's bulk copy engine (TMA, sm_90): one thread per block moves a chunk global -> shared ->
# global with cp.async.bulk, completion on an mbarrier; CHUNK bytes of shared memory per block.
_TMA = r"""
struct Region { unsigned long long src, dst, src_stride, dst_stride, nbytes; };
extern "C" __global__ void __launch_bounds__(32) lane_copy_tma(
    const Region* __restrict__ regions, const int* __restrict__ pairs, unsigned chunk) {
  extern __shared__ __align__(128) char buf[];
  __shared__ __align__(8) unsigned long long mbar;
  if (threadIdx.x != 0) return;
  const Region R = regions[blockIdx.y];
  const unsigned long long start = (unsigned long long)blockIdx.z * chunk;
  if (start >= R.nbytes) return;
  unsigned long long n = R.nbytes - start;
  if (n > chunk) n = chunk;
  const int sp = pairs[2 * blockIdx.x], dp = pairs[2 * blockIdx.x + 1];
  const char* s = (const char*)(R.src + (unsigned long long)sp * R.src_stride + start);
  char* d = (char*)(R.dst + (unsigned long long)dp * R.dst_stride + start);
  const unsigned mb = (unsigned)__cvta_generic_to_shared(&mbar);
  const unsigned sb = (unsigned)__cvta_generic_to_shared(buf);
  const unsigned nb = (unsigned)n;
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(mb) : "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(mb), "r"(nb) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(sb), "l"(s), "r"(nb), "r"(mb) : "memory");
  unsigned ok = 0;
  while (!ok)
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; "
                 "selp.u32 %0, 1, 0, p; }" : "=r"(ok) : "r"(mb) : "memory");
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
               :: "l"(d), "r"(sb), "r"(nb) : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}
"""

# The bulk copy engine pipelined: one thread a block, persistent (blocks = SMs x per_sm), a ring of
# STAGES shared buffers of ``chunk`` bytes: the loads of the next STAGES - 1 items are in flight
# while an item's store drains its buffer (cp.async.bulk.wait_group.read before a buffer's reuse).
_TMA_PIPE = r"""
struct Region {
  unsigned long long src, dst, src_stride, dst_stride, nbytes, run, src_run, dst_run, pairs;
};
__device__ __forceinline__ void item_ptrs(const Region* regions, const int* pairs, unsigned long long it,
    unsigned nregions, unsigned nchunks, unsigned chunk, const char** s, char** d, unsigned* n) {
  const unsigned c = (unsigned)(it % nchunks);
  const unsigned r = (unsigned)((it / nchunks) % nregions);
  const unsigned p = (unsigned)(it / ((unsigned long long)nchunks * nregions));
  const Region R = regions[r];
  const unsigned long long start = (unsigned long long)c * chunk;
  unsigned long long m = start < R.nbytes ? R.nbytes - start : 0;
  if (m > chunk) m = chunk;
  const int* pr = pairs + 2 * (R.pairs + p);
  *s = (const char*)(R.src + (unsigned long long)pr[0] * R.src_stride + start);
  *d = (char*)(R.dst + (unsigned long long)pr[1] * R.dst_stride + start);
  *n = (unsigned)m;
}
extern "C" __global__ void __launch_bounds__(32) lane_copy_tma_pipe(
    const Region* __restrict__ regions, const int* __restrict__ pairs, unsigned chunk,
    unsigned npairs, unsigned nregions, unsigned nchunks) {
  extern __shared__ __align__(128) char buf[];
  __shared__ __align__(8) unsigned long long full[STAGES];
  if (threadIdx.x != 0) return;
  const unsigned long long items = (unsigned long long)npairs * nregions * nchunks;
  const unsigned long long first = blockIdx.x, step = gridDim.x;
  const unsigned long long count = first < items ? (items - first + step - 1) / step : 0;
  for (int i = 0; i < STAGES; ++i) {
    const unsigned mb = (unsigned)__cvta_generic_to_shared(&full[i]);
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(mb) : "memory");
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  const char* ls[STAGES];
  char* ld[STAGES];
  unsigned ln[STAGES];
  auto load = [&](unsigned long long k) {
    const int b = (int)(k % STAGES);
    item_ptrs(regions, pairs, first + k * step, nregions, nchunks, chunk, &ls[b], &ld[b], &ln[b]);
    const unsigned mb = (unsigned)__cvta_generic_to_shared(&full[b]);
    const unsigned sb = (unsigned)__cvta_generic_to_shared(buf + (size_t)b * chunk);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(mb), "r"(ln[b]) : "memory");
    if (ln[b])
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   :: "r"(sb), "l"(ls[b]), "r"(ln[b]), "r"(mb) : "memory");
  };
  for (unsigned long long k = 0; k + 1 < STAGES && k < count; ++k) load(k);
  for (unsigned long long k = 0; k < count; ++k) {
    const int b = (int)(k % STAGES);
    const unsigned mb = (unsigned)__cvta_generic_to_shared(&full[b]);
    const unsigned par = (unsigned)((k / STAGES) & 1);
    unsigned ok = 0;
    while (!ok)
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
                   "selp.u32 %0, 1, 0, p; }" : "=r"(ok) : "r"(mb), "r"(par) : "memory");
    const unsigned sb = (unsigned)__cvta_generic_to_shared(buf + (size_t)b * chunk);
    if (ln[b])
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                   :: "l"(ld[b]), "r"(sb), "r"(ln[b]) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    if (k + STAGES - 1 < count) {  // its buffer was item k - 1's: that store has read it
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
      load(k + STAGES - 1);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
"""

_PERSISTENT = r"""
struct Region { unsigned long long src, dst, src_stride, dst_stride, nbytes; };
extern "C" __global__ void __launch_bounds__(THREADS) lane_copy_p(
    const Region* __restrict__ regions, const int* __restrict__ pairs, int vec16, unsigned chunk,
    unsigned npairs, unsigned nregions, unsigned nchunks) {
  const unsigned long long items = (unsigned long long)npairs * nregions * nchunks;
  for (unsigned long long it = blockIdx.x; it < items; it += gridDim.x) {
    const unsigned c = (unsigned)(it % nchunks);
    const unsigned r = (unsigned)((it / nchunks) % nregions);
    const unsigned p = (unsigned)(it / ((unsigned long long)nchunks * nregions));
    const Region R = regions[r];
    const unsigned long long start = (unsigned long long)c * chunk;
    if (start >= R.nbytes) continue;
    unsigned long long n = R.nbytes - start;
    if (n > chunk) n = chunk;
    const int sp = pairs[2 * p], dp = pairs[2 * p + 1];
    const uint4* s4 = (const uint4*)(R.src + (unsigned long long)sp * R.src_stride + start);
    uint4* d4 = (uint4*)(R.dst + (unsigned long long)dp * R.dst_stride + start);
    const unsigned n4 = (unsigned)(n >> 4);
    unsigned i = threadIdx.x;
    for (; i + (UNROLL - 1) * THREADS < n4; i += UNROLL * THREADS) {
      uint4 v[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) v[u] = LOAD(s4 + i + u * THREADS);
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) STORE(d4 + i + u * THREADS, v[u]);
    }
    for (; i < n4; i += THREADS) STORE(d4 + i, LOAD(s4 + i));
  }
}
"""


def _lane_default() -> tuple[int, int, int, int]:
    """The lane's block sizes (wide, narrow, small: aot.THREADS) and the service's default chunk."""
    from kvservice.config import Config
    from kvservice.kernels.aot import THREADS

    small, narrow, wide = THREADS
    return wide, narrow, small, Config().tuning.lane_cuda_chunk_kb * 1024  # type: ignore[union-attr]


def _triton_kernel(cc: int, threads: int, words: int | None = None):  # type: ignore[no-untyped-def]
    """The lane's Triton kernel (16-byte words) for ``threads`` a block, loaded through CuPy as the
    lane loads it (a cubin, its scratch parameters passed as null): (kernel, extra parameters)."""
    import tempfile

    from kvservice.kernels import aot

    im = aot.compile_image(cc, 1, threads, *(() if words is None else (words,)))
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(im.cubin)
    return cp.RawModule(path=f.name).get_function(im.name), im.params - 5


def _persistent(threads: int, unroll: int, load: str, store: str) -> str:
    loads = {"plain": "(*(P))", "ldg": "__ldg(P)", "ldcs": "__ldcs(P)"}
    stores = {"plain": "(*(P) = (V))", "stcs": "__stcs(P, V)", "stcg": "__stcg(P, V)"}
    head = (
        f"#define THREADS {threads}\n#define UNROLL {unroll}\n"
        f"#define LOAD(P) {loads[load]}\n#define STORE(P, V) {stores[store]}\n"
    )
    return head + _PERSISTENT


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--pages", type=int, default=1024)
    ap.add_argument("--pool-pages", type=int, default=2048)
    ap.add_argument("--src-gpu", type=int, default=0)
    ap.add_argument("--dst-gpu", type=int, default=0)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="/tmp/kvservice-bench")
    args = ap.parse_args()
    page = 16 * 8 * 128 * 2  # bytes of one page of one region (16 tokens, 8 heads, 128 dims, bf16)
    nreg = 2 * args.layers
    with cp.cuda.Device(args.src_gpu):
        src = [cp.random.randint(0, 256, args.pool_pages * page, dtype=cp.uint8) for _ in range(nreg)]
    with cp.cuda.Device(args.dst_gpu):
        dst = [cp.zeros(args.pool_pages * page, dtype=cp.uint8) for _ in range(nreg)]
    if args.src_gpu != args.dst_gpu:
        with cp.cuda.Device(args.src_gpu):
            cp.cuda.runtime.deviceEnablePeerAccess(args.dst_gpu)
    rng = np.random.default_rng(0)
    sp = rng.choice(args.pool_pages, args.pages, replace=False).astype(np.int32)
    dp = rng.choice(args.pool_pages, args.pages, replace=False).astype(np.int32)
    nbytes = args.pages * page * nreg
    launch_dev = args.src_gpu
    with cp.cuda.Device(launch_dev):
        geo = [[s.data.ptr, d.data.ptr, page, page, page] for s, d in zip(src, dst, strict=True)]
        table5 = cp.asarray(np.array(geo, np.uint64))  # the persistent variants' Region
        # the lane's Region: + run (one run: the whole page), src_run, dst_run, pairs offset
        table = cp.asarray(np.array([g + [page, 0, 0, 0] for g in geo], np.uint64))
        pairs = cp.asarray(np.stack([sp, dp], axis=1).reshape(-1))
        flat_s = cp.empty(nbytes, dtype=cp.uint8)
    with cp.cuda.Device(args.dst_gpu):
        flat_d = cp.empty(nbytes, dtype=cp.uint8)  # a peer copy when the GPUs differ
    with cp.cuda.Device(launch_dev):
        sms = cp.cuda.runtime.getDeviceProperties(launch_dev)["multiProcessorCount"]
        name = cp.cuda.runtime.getDeviceProperties(launch_dev)["name"].decode()

    def timed(fn) -> float:  # type: ignore[no-untyped-def]
        with cp.cuda.Device(launch_dev):
            fn()
            cp.cuda.Device(launch_dev).synchronize()
            ts = []
            for _ in range(args.iters):
                a, b = cp.cuda.Event(), cp.cuda.Event()
                a.record()
                fn()
                b.record()
                b.synchronize()
                ts.append(cp.cuda.get_elapsed_time(a, b))
            return statistics.median(ts)

    variants = {}
    with cp.cuda.Device(launch_dev):
        opts = ("-default-device",)
        cc = int(cp.cuda.Device(launch_dev).compute_capability)  # "90" on an H100/H200
        # the lane's three variants as Lane::launch picks them: this row's whole 32 KiB pages take
        # the wide block, head slices the small or the narrow one
        wt, lt, st, lc = _lane_default()
        wide, lane, small = _triton_kernel(cc, wt), _triton_kernel(cc, lt), _triton_kernel(cc, st)

        def lane_run(k, threads: int, chunk: int, nbytes: int = page, tab=table, prs=pairs):  # type: ignore[no-untyped-def]
            """A launch of a lane kernel as Lane::launch makes it: grid (pairs, regions, chunks of
            ``nbytes``), one target (its regions, then the pages), the scratch pointers null."""
            fn, extra = k
            grid = (args.pages, nreg, (nbytes + chunk - 1) // chunk)
            tail = (np.int32(chunk), np.int32(nreg), np.int32(args.pages), *([np.uint64(0)] * extra))
            return lambda: fn(grid, (threads,), (tab, prs, *tail))

        variants["lane_default"] = lane_run(wide, wt, lc)
        # the lane kernel's launch shapes: threads a block, words in flight a thread, chunk bytes
        for threads, unroll, chunk in (
            (256, 4, 16384),
            (256, 4, 32768),
            (256, 8, 32768),
            (512, 4, 32768),
            (1024, 2, 32768),
            (512, 2, 16384),
        ):
            k_ = _triton_kernel(cc, threads, unroll)
            variants[f"lane_grid3_t{threads}_u{unroll}_chunk{chunk // 1024}k"] = lane_run(k_, threads, chunk)
        # diagnosis (not checked byte for byte): the same kernel on contiguous pages (pairs i -> i)
        # and on the row's pages sorted by source page: what the scatter itself costs
        order = np.argsort(sp)
        idx = np.arange(args.pages)
        for tag, a_, b_ in (("contig", idx, idx), ("sorted", sp[order], dp[order])):
            dpairs = cp.asarray(np.stack([a_, b_], axis=1).astype(np.int32).reshape(-1))
            variants[f"diag_lane_{tag}"] = lane_run(wide, wt, lc, prs=dpairs)
        try:  # sm_90 only
            tma = cp.RawKernel(_TMA, "lane_copy_tma", options=opts)
            for chunk in (8192, 16384, 32768):
                zc = (page + chunk - 1) // chunk

                def trun(k=tma, c=chunk, z=zc) -> None:  # type: ignore[no-untyped-def]
                    k((args.pages, nreg, z), (32,), (table5, pairs, np.uint32(c)), shared_mem=c)

                trun()
                variants[f"tma_bulk_chunk{chunk // 1024}k"] = trun
        except Exception as exc:  # noqa: BLE001  (a compile or launch error: reported, not fatal)
            print(f"TMA variant skipped: {exc}", file=sys.stderr)
        for stages, chunk, per_sm in (
            (3, 32768, 2),
            (4, 16384, 3),
            (6, 16384, 2),
            (2, 32768, 3),
            (8, 8192, 3),
        ):
            try:
                src_ = f"#define STAGES {stages}\n" + _TMA_PIPE
                kp = cp.RawKernel(src_, "lane_copy_tma_pipe", options=(*opts, "-std=c++17"))
                nch = (page + chunk - 1) // chunk
                smem = stages * chunk
                kp.max_dynamic_shared_size_bytes = smem

                def prun(k=kp, b=sms * per_sm, c=chunk, z=nch, m=smem) -> None:  # type: ignore[no-untyped-def]
                    dims = (np.uint32(args.pages), np.uint32(nreg), np.uint32(z))
                    k((b,), (32,), (table, pairs, np.uint32(c), *dims), shared_mem=m)

                prun()
                variants[f"tma_pipe_s{stages}_c{chunk // 1024}k_x{per_sm}"] = prun
            except Exception as exc:  # noqa: BLE001
                print(f"TMA pipe variant s{stages} skipped: {exc}", file=sys.stderr)
        for threads, unroll, load, store, per_sm, chunk in (
            (256, 4, "plain", "plain", 8, 16384),
            (256, 8, "plain", "plain", 8, 32768),
            (512, 4, "plain", "plain", 4, 32768),
            (256, 4, "ldcs", "stcs", 8, 16384),
            (256, 8, "ldg", "stcs", 8, 32768),
            (256, 8, "ldcs", "stcg", 8, 32768),
            (128, 8, "plain", "plain", 16, 16384),
        ):
            k = cp.RawKernel(_persistent(threads, unroll, load, store), "lane_copy_p", options=opts)
            nch = (page + chunk - 1) // chunk

            def run(k=k, t=threads, b=sms * per_sm, c=chunk, z=nch) -> None:  # type: ignore[no-untyped-def]
                dims = (np.uint32(args.pages), np.uint32(nreg), np.uint32(z))
                k((b,), (t,), (table5, pairs, np.int32(1), np.uint32(c), *dims))

            variants[f"persistent_t{threads}_u{unroll}_{load}_{store}_x{per_sm}_c{chunk // 1024}k"] = run

        # head slices: sender TP p (H/p heads a page) into receiver TP p/2 (2H/p heads), its first half
        from kvservice.kernels.aot import SMALL_BYTES

        for p_ in (4, 2):
            sl = page // p_  # a sender page of one region
            run, dst_run = sl // 16, 2 * sl // 16  # one token's heads: sender, receiver
            sgeo = [
                [s.data.ptr, d.data.ptr, sl, 2 * sl, sl, run, run, dst_run, 0]
                for s, d in zip(src, dst, strict=True)
            ]
            stab = cp.asarray(np.array(sgeo, np.uint64))
            snb = args.pages * sl * nreg

            def scopy(n=snb) -> None:  # type: ignore[no-untyped-def]
                flat_d.data.copy_from_device_async(flat_s.data, n)

            tag = f"{p_}to{p_ // 2}"
            variants[f"copy_slice_{tag}"] = scopy
            # the lane's pick (copy.cpp Copier::launch): the small block where a block moves <= 8 KiB
            pick, pt = (small, st) if min(lc, sl) <= SMALL_BYTES else (lane, lt)
            variants[f"lane_slice_{tag}"] = lane_run(pick, pt, lc, nbytes=sl, tab=stab)
            # other block shapes of the same kernel (threads, words a thread)
            for threads, words in ((256, 4), (256, 2), (128, 2), (64, 4)):
                k_ = _triton_kernel(cc, threads, words)
                variants[f"tslice_{tag}_t{threads}_u{words}"] = lane_run(k_, threads, lc, nbytes=sl, tab=stab)

    def check() -> bool:
        for s, d in zip(src[:2], dst[:2], strict=True):
            sv = cp.asnumpy(s).reshape(-1, page)[sp]
            dv = cp.asnumpy(d).reshape(-1, page)[dp]
            if not np.array_equal(sv, dv):
                return False
        return True

    results: dict[str, list[float]] = {"copy": []}
    ok: dict[str, bool] = {}
    for _ in range(args.rounds):
        results["copy"].append(timed(lambda: flat_d.data.copy_from_device_async(flat_s.data, nbytes)))
        for vname, fn in variants.items():
            unchecked = vname.startswith(("lane_slice", "copy_slice", "tslice_", "diag_"))
            if vname not in ok and not unchecked:  # byte for byte, once
                for d in dst:
                    d.fill(0)
                fn()
                with cp.cuda.Device(launch_dev):
                    cp.cuda.Device(launch_dev).synchronize()
                ok[vname] = check()
            results.setdefault(vname, []).append(timed(fn))
    copy = statistics.median(results["copy"])
    rows = {
        v: {
            "p50_ms": statistics.median(t),
            "rounds_ms": t,
            "share_of_copy": copy / statistics.median(t),
            "exact": ok.get(v, True),
        }
        for v, t in results.items()
    }
    for p_ in (4, 2):  # a slice against the device copy of its own bytes
        tag = f"{p_}to{p_ // 2}"
        c = f"copy_slice_{tag}"
        for k in rows:
            if k != c and f"slice_{tag}" in k:
                rows[k]["share_of_copy"] = rows[c]["p50_ms"] / rows[k]["p50_ms"]
                # not checked here: tests/transfer/lane/test_lane_mixed_tp.py (CPU), GPU tests
                rows[k]["exact"] = None
        rows[c]["share_of_copy"] = 1.0
    for v, r in rows.items():
        print(f"{v:48s} {r['p50_ms']:.3f} ms  {r['share_of_copy']:.1%}  exact={r['exact']}")
    res = {
        "benchmark": "sweep_lane_kernel",
        "gpu": name,
        "command": " ".join(["python3", *sys.argv]),
        "src_gpu": args.src_gpu,
        "dst_gpu": args.dst_gpu,
        "bytes": nbytes,
        "rows": rows,
    }
    tag = "h200" if "H200" in name else "h100" if "H100" in name else "gpu"
    if args.src_gpu != args.dst_gpu:
        tag += f"_gpu{args.src_gpu}to{args.dst_gpu}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"sweep_lane_kernel_{tag}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
