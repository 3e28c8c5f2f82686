"""Raw-NIXL baselines: what an engine does without kvservice (SGLang/vLLM style), in separate
processes that allocate and register their own memory and write with prepped descriptor lists.

A *receiver* process allocates ``nbytes`` (numpy DRAM or a CUDA tensor), registers it and waits.
A *sender* process does the same, adds the receivers it writes to, preps one local and one
remote list per job and times ``iters`` rounds of "post every job's WRITE, wait for all".
Several senders start each round together (a barrier) and a round takes the slowest sender's
time — as parallel engine ranks would.

Jobs name memory by offsets from the allocation's start; strided (N, 5) rows
``(offset, len, dev, stride, count)`` are turned into addresses inside the process::

    job = Job(rx=0, local_rows, remote_rows, local_idx, remote_idx)
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from _harness import ROOT


@dataclass(frozen=True)
class Job:
    rx: int  # index of the receiver process
    local_rows: np.ndarray  # (N, 5) int64, offsets from the sender's allocation
    remote_rows: np.ndarray  # (M, 5) int64, offsets from the receiver's allocation
    local_idx: np.ndarray  # (D,) int32
    remote_idx: np.ndarray  # (D,) int32


def _alloc(device: str | int, nbytes: int, fill: bool) -> tuple[Any, int, str, int]:
    if device == "cpu":
        buf = (
            np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
            if fill
            else np.zeros(nbytes, np.uint8)
        )
        return buf, buf.ctypes.data, "DRAM", 0
    import torch

    torch.cuda.set_device(device)
    buf = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
    buf.fill_(7 if fill else 0)
    torch.cuda.synchronize(device)
    return buf, buf.data_ptr(), "VRAM", int(device)


def _abs(rows: np.ndarray, base: int, dev: int) -> np.ndarray:
    r = np.array(rows, dtype=np.int64, copy=True)
    r[:, 0] += base
    r[:, 2] = dev
    return r


def _place(netns: str | None) -> None:
    """Child start (already in its namespace with ``--netns``): UCX on TCP, before NIXL loads."""
    sys.path[:0] = [str(ROOT)]
    if netns:
        from _netns import UCX_TCP_ENV

        os.environ.update(UCX_TCP_ENV)


@contextlib.contextmanager
def _spawned_in(ctx: Any, netns: str | None, directory: str) -> Iterator[None]:
    """Processes started inside the block run in ``netns`` (``ip netns exec``)."""
    if not netns:
        yield
        return
    from _netns import python_in

    ctx.set_executable(python_in(netns, directory))
    try:
        yield
    finally:
        ctx.set_executable(sys.executable)


def _receiver(name: str, device: str | int, nbytes: int, up: Any, down: Any, netns: str | None) -> None:
    _place(netns)
    from kvservice.transfer.nixl_transport import NixlTransport

    buf, base, kind, dev = _alloc(device, nbytes, False)
    t = NixlTransport(name)
    t.register(base, nbytes, kind, dev)  # type: ignore[arg-type]
    up.put((name, t.metadata(), base, dev))
    down.get()
    t.close()
    del buf


def _sender(
    name: str,
    device: str | int,
    nbytes: int,
    peers: list[Any],
    cases: dict[str, list[Job]],
    iters: int,
    barrier: Any,
    out: Any,
    netns: str | None,
) -> None:
    _place(netns)
    from kvservice.transfer.nixl_transport import NixlTransport

    try:
        buf, base, kind, dev = _alloc(device, nbytes, True)
        t = NixlTransport(name)
        t.register(base, nbytes, kind, dev)  # type: ignore[arg-type]
        for pname, meta, _, _ in peers:
            t.add_peer(pname, meta)

        def prep(jobs: list[Job]) -> list[Any]:
            prepped = []
            for j in jobs:
                pname, _, rbase, rdev = peers[j.rx]
                ll = t.prep_local(_abs(j.local_rows, base, dev), kind)  # type: ignore[arg-type]
                rl = t.prep_remote(pname, _abs(j.remote_rows, rbase, rdev), kind)  # type: ignore[arg-type]
                prepped.append((ll, rl, j.local_idx.astype(np.int32), j.remote_idx.astype(np.int32)))
            return prepped

        def round_(prepped: list[Any], limit: int | None = None) -> float:
            t0 = time.perf_counter()
            hs = [t.write(ll, li[:limit], rl, ri[:limit]) for ll, rl, li, ri in prepped]
            for h in hs:
                while (s := t.status(h)) == "PROC":
                    pass
                if s != "DONE":
                    raise RuntimeError(f"raw NIXL write ended {s}")
                t.release(h)
            return time.perf_counter() - t0

        times: dict[str, list[float]] = {}
        for case, jobs in cases.items():
            prepped = prep(jobs)
            round_(prepped, limit=256)  # connection set-up and first touch, off the clock
            times[case] = []
            for _ in range(iters):
                barrier.wait(timeout=600)
                times[case].append(round_(prepped))
        out.put((name, times, None))
        t.close()
        del buf
    except BaseException as exc:  # report, so the parent does not hang
        out.put((name, {}, f"{type(exc).__name__}: {exc}"))
        try:
            barrier.abort()
        except Exception:
            pass


def _result(out: Any, procs: list[Any], timeout_s: float) -> Any:
    """The next sender's report; raises as soon as a baseline process died without one."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            return out.get(timeout=0.5)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(
                    "raw NIXL baseline process died: "
                    + ", ".join(f"{p.name} exit {p.exitcode}" for p in dead)
                ) from None
            if time.monotonic() > end:
                raise RuntimeError(f"raw NIXL baseline: no result within {timeout_s} s") from None


def run_raw(
    receivers: list[tuple[str | int, int]],
    senders: list[tuple[str | int, int, dict[str, list[Job]]]],
    iters: int,
    timeout_s: float = 600.0,
    net: Any = None,
) -> dict[str, list[float]]:
    """Run the baseline; return per case the per-round seconds (slowest sender of each round).

    ``receivers``: (device, nbytes); ``senders``: (device, nbytes, {case: jobs}); every sender
    names the same cases (a sender with nothing to do in a case passes an empty list).
    ``net`` (a ``_netns.NetPair``): senders run in its first namespace, receivers in its second,
    UCX over TCP, as the services of a ``--netns`` run do.
    """
    ns_tx, ns_rx = net.names if net is not None else (None, None)
    ctx = mp.get_context("spawn")
    up, down, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    barrier = ctx.Barrier(len(senders))
    procs = []
    tmp = tempfile.TemporaryDirectory(prefix="kvbench-raw-")
    try:
        for i, (dev, nb) in enumerate(receivers):
            rx_args = (f"raw-rx{i}", dev, nb, up, down, ns_rx)
            procs.append(ctx.Process(target=_receiver, args=rx_args, daemon=True))
            with _spawned_in(ctx, ns_rx, tmp.name):
                procs[-1].start()
        got = {}
        for _ in receivers:
            name, meta, base, dev = up.get(timeout=timeout_s)
            got[name] = (name, meta, base, dev)
        peers = [got[f"raw-rx{i}"] for i in range(len(receivers))]
        for i, (dev, nb, jobs) in enumerate(senders):
            tx_args = (f"raw-tx{i}", dev, nb, peers, jobs, iters, barrier, out, ns_tx)
            p = ctx.Process(target=_sender, args=tx_args, daemon=True)
            with _spawned_in(ctx, ns_tx, tmp.name):
                p.start()
            procs.append(p)
        results = [_result(out, procs, timeout_s) for _ in senders]
        errors = [e for _, _, e in results if e]
        if errors:
            raise RuntimeError("raw NIXL baseline failed: " + "; ".join(errors))
        cases = list(senders[0][2])
        return {c: [float(x) for x in np.array([ts[c] for _, ts, _ in results]).max(axis=0)] for c in cases}
    finally:
        for _ in receivers:
            down.put(None)
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        tmp.cleanup()


def page_rows(num_regions: int, region_bytes: int, page_bytes: int, num_pages: int) -> np.ndarray:
    """Strided rows, one per region of a pool laid out ``[region][page]``: element r*num_pages+p."""
    off = np.arange(num_regions, dtype=np.int64) * region_bytes
    one = np.ones_like(off)
    return np.stack([off, one * page_bytes, 0 * one, one * page_bytes, one * num_pages], axis=1)


def region_page_idx(num_regions: int, num_pages: int, pages: np.ndarray) -> np.ndarray:
    r = np.arange(num_regions, dtype=np.int64)[:, None]
    return (r * num_pages + np.asarray(pages, dtype=np.int64)[None, :]).reshape(-1).astype(np.int32)
