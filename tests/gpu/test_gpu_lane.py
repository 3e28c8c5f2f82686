"""GPU: the native lane on one service (kvservice.transfer.lane): engines in their own processes with
CUDA IPC pools; the copy is the lane's Triton kernel (AOT cubins), launched without Python."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from tests.support.gpu import LAYOUT, Engine, kvservice_procs, wait_lanes

pytestmark = pytest.mark.gpu


@pytest.fixture
def service(tmp_path: Path):
    # a copy kernel that cannot load leaves GPU pools off the lane, which every test here fails on
    # (route_note "lane")
    procs, socks = kvservice_procs(tmp_path, ("a",))
    wait_lanes(socks[:1])
    yield socks[0]
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(20)


def _engines(address: str, layout: dict | None = None) -> tuple[Engine, Engine]:
    src, dst = Engine(), Engine()
    src(op="register", address=address, layout=layout or LAYOUT, fill=True, seed=5)
    dst(op="register", address=address, layout=layout or LAYOUT)
    return src, dst


# The lane's three block sizes (kernels/aot.py THREADS): whole pages of >= 32 KiB a block take the
# wide one (LAYOUT's 32 KiB regions one block each, 64 KiB regions two), pages of at most 8 KiB the
# small one, the others the narrow one.
PAGES = {
    "wide-32k": LAYOUT,
    "wide-64k": dict(LAYOUT, page_size=32),
    "narrow-16k": dict(LAYOUT, total_kv_heads=4),
    "small-8k": dict(LAYOUT, total_kv_heads=2),
}


@pytest.mark.parametrize("pages", sorted(PAGES))
@pytest.mark.parametrize("n", [1, 40])
def test_lane_copies_on_the_gpu_byte_for_byte(service: str, n: int, pages: str) -> None:
    src_eng, dst_eng = _engines(service, PAGES[pages])
    try:
        rng = np.random.default_rng(n)
        src = rng.permutation(64)[: n + 3].tolist()
        dst = rng.permutation(64)[:n].tolist()
        for turn in range(3):  # repeated: the kernel and its buffers are reused
            tid = f"lane-{n}-{turn}"
            assert dst_eng(op="expect", tid=tid, prefix=3, dst=dst)["ok"]
            assert src_eng(op="send", tid=tid, src=src, peer=service)["lane"], "not sent over the lane"
            got_d, got_s = dst_eng(op="wait", tid=tid), src_eng(op="wait", tid=tid)
            assert got_d["state"] == got_s["state"] == "DONE", (got_d, got_s)
            assert got_d["route_note"] == "lane" and got_d["path"] == "FUSED"
            assert dst_eng(op="pages", pages=dst)["sums"] == src_eng(op="pages", pages=src[3:])["sums"]
        untouched = sorted(set(range(64)) - set(dst))
        assert all(s == 0 for region in dst_eng(op="pages", pages=untouched)["sums"] for s in region)
    finally:
        src_eng.close()
        dst_eng.close()


def test_lane_abort_before_send_writes_nothing(service: str) -> None:
    src_eng, dst_eng = _engines(service)
    try:
        assert dst_eng(op="expect", tid="ab", prefix=0, dst=[1, 2])["ok"]
        dst_eng(op="abort", tid="ab")
        sent = src_eng(op="send", tid="ab", src=[5, 6], peer=service)
        assert not sent["lane"]
        assert src_eng(op="wait", tid="ab")["state"] in ("FAILED", "ABORTED")
        assert all(s == 0 for region in dst_eng(op="pages", pages=list(range(64)))["sums"] for s in region)
    finally:
        src_eng.close()
        dst_eng.close()


MIXED = dict(num_layers=2, page_size=16, num_pages=32, total_kv_heads=8, head_dim=128, dtype="bfloat16")


@pytest.mark.parametrize(("p", "d"), [(4, 2), (2, 1), (1, 2), (2, 4)])
@pytest.mark.parametrize("across", [False, True], ids=["one-gpu", "gpu0to1"])
def test_lane_mixed_tp_head_slices_on_the_gpu(service: str, p: int, d: int, across: bool) -> None:
    """Mixed TP on the lane's kernel: every sender rank's SEND goes over the lane, every receiver
    rank ends DONE over it with each global head where it belongs, and no other page changed."""
    import torch

    if across and torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    senders = [Engine() for _ in range(p)]
    receivers = [Engine() for _ in range(d)]
    try:
        for r, e in enumerate(senders):
            lay = {**MIXED, "tp_size": p, "tp_rank": r}
            e(op="register", address=service, layout=lay, fill=True, seed=10 + r)
        for r, e in enumerate(receivers):
            lay = {**MIXED, "tp_size": d, "tp_rank": r}
            e(op="register", address=service, layout=lay, device=int(across))
        src, dst = [3, 7, 9, 30, 12], [1, 2, 4, 5]
        tid = f"lane-tp-{p}-{d}-{across}"
        for e in receivers:
            assert e(op="expect", tid=tid, prefix=1, dst=dst)["ok"]
        for e in senders:
            assert e(op="send", tid=tid, src=src, peer=service)["lane"], "not sent over the lane"
        states = [e(op="wait", tid=tid) for e in receivers + senders]
        assert all(s["state"] == "DONE" and s["route_note"] == "lane" for s in states), states
        ls, ld = 8 // p, 8 // d
        src_sums = [np.array(e(op="head_sums", pages=src[1:])["sums"]) for e in senders]
        dst_sums = [np.array(e(op="head_sums", pages=dst)["sums"]) for e in receivers]
        for g in range(8):  # global head g: sender rank g // ls (local g % ls), receiver g // ld
            np.testing.assert_array_equal(dst_sums[g // ld][:, :, g % ld], src_sums[g // ls][:, :, g % ls])
        untouched = sorted(set(range(32)) - set(dst))
        for e in receivers:
            assert all(s == 0 for region in e(op="pages", pages=untouched)["sums"] for s in region)
    finally:
        for e in senders + receivers:
            e.close()


def test_service_stopped_with_lane_copies_in_flight_exits_and_every_rank_ends(tmp_path: Path) -> None:
    """SIGTERM while four sender ranks' large copies are queued on the lane's stream (TP 4 -> 2,
    512 MiB each): the service exits promptly (its finisher thread drains what was launched),
    every receiver rank's wait returns an end state, and no page outside the named ones changed."""
    import signal

    procs, socks = kvservice_procs(tmp_path, ("a",))
    wait_lanes(socks[:1])
    big = {**MIXED, "num_layers": 32, "num_pages": 1100}
    senders = [Engine() for _ in range(4)]
    receivers = [Engine() for _ in range(2)]
    try:
        for r, e in enumerate(senders):
            e(op="register", address=socks[0], layout={**big, "tp_size": 4, "tp_rank": r}, fill=True, seed=r)
        for r, e in enumerate(receivers):
            e(op="register", address=socks[0], layout={**big, "tp_size": 2, "tp_rank": r})
        rng = np.random.default_rng(0)
        src, dst = rng.permutation(1100)[:1024].tolist(), rng.permutation(1024).tolist()
        for e in receivers:
            assert e(op="expect", tid="stop-lane", prefix=0, dst=dst, deadline_ms=20_000)["ok"]
        for e in senders:
            e(op="send", tid="stop-lane", src=src, peer=socks[0])
        t0 = time.monotonic()
        procs[0].send_signal(signal.SIGTERM)
        procs[0].wait(30)
        assert time.monotonic() - t0 < 30
        for e in receivers:
            got = e(op="wait", tid="stop-lane", timeout=30)
            assert got["state"] in ("DONE", "FAILED", "ABORTED"), got
            untouched = sorted(set(range(1100)) - set(dst))
            assert all(s == 0 for region in e(op="pages", pages=untouched)["sums"] for s in region)
    finally:
        for e in senders + receivers:
            try:
                e.close()
            except Exception:
                pass
        for p in procs:
            if p.poll() is None:
                p.kill()


@pytest.mark.parametrize("cuts", [[1], [1, 2, 3, 4, 5, 6, 7], list(range(1, 32))], ids=["2", "8", "32"])
def test_lane_takes_chunked_transfers_with_aux_rows_on_the_gpu(service: str, cuts: list[int]) -> None:
    """SGLang's shape (chunks, aux rows in host memory on the last) on the lane, byte exact."""
    src_eng, dst_eng = Engine(), Engine()
    try:
        src_eng(op="register", address=service, layout=LAYOUT, fill=True, seed=5, aux_rows=16)
        dst_eng(op="register", address=service, layout=LAYOUT, aux_rows=16)
        rng = np.random.default_rng(len(cuts))
        n = len(cuts) + 1
        src, dst = rng.permutation(64)[: n + 2].tolist(), rng.permutation(64)[:n].tolist()
        for turn in range(2):
            tid = f"chunks-{n}-{turn}"
            assert dst_eng(op="expect", tid=tid, prefix=2, dst=dst, aux={"meta": [turn, 9]})["ok"]
            bounds = [0, *[c + 2 for c in cuts], n + 2]
            lane = []
            for i in range(len(bounds) - 1):
                last = i == len(bounds) - 2
                got = src_eng(
                    op="send",
                    tid=tid,
                    src=src[bounds[i] : bounds[i + 1]],
                    offset=bounds[i],
                    last=last,
                    aux={"meta": [3, 4 + turn]} if last else None,
                    peer=service,
                )
                lane.append(got["lane"])
            assert all(lane), f"not every chunk went over the lane: {lane}"
            got_d, got_s = dst_eng(op="wait", tid=tid), src_eng(op="wait", tid=tid)
            assert got_d["state"] == got_s["state"] == "DONE", (got_d, got_s)
            assert got_d["route_note"] == "lane"
            assert dst_eng(op="pages", pages=dst)["sums"] == src_eng(op="pages", pages=src[2:])["sums"]
            assert dst_eng(op="aux", rows=[turn, 9])["rows"] == src_eng(op="aux", rows=[3, 4 + turn])["rows"]
        untouched = sorted(set(range(64)) - set(dst))
        assert all(s == 0 for region in dst_eng(op="pages", pages=untouched)["sums"] for s in region)
    finally:
        src_eng.close()
        dst_eng.close()


@pytest.mark.parametrize(
    ("ps", "pd", "n_src", "prefix", "n_dst", "cuts"),
    [(16, 1, 4, 8, 56, [1]), (16, 64, 7, 0, 2, [2, 5]), (1, 16, 40, 1, 2, [7, 20]), (64, 16, 2, 1, 7, [])],
    ids=["vllm16-to-sglang1", "vllm16-to-sglang64-part-filled", "sglang1-to-vllm16", "sglang64-to-vllm16"],
)
def test_lane_converts_page_sizes_on_the_gpu(
    service: str, ps: int, pd: int, n_src: int, prefix: int, n_dst: int, cuts: list[int]
) -> None:
    """Pools of two page sizes on the lane's kernel (units of gcd tokens): every chunk over the
    lane, each token at its sequence position, no other page written."""
    src_eng, dst_eng = Engine(), Engine()
    try:
        src_eng(
            op="register", address=service, layout=dict(LAYOUT, page_size=ps, num_pages=1024 // ps), fill=True
        )
        dst_eng(op="register", address=service, layout=dict(LAYOUT, page_size=pd, num_pages=1024 // pd))
        rng = np.random.default_rng(ps * 100 + pd)
        src = rng.permutation(1024 // ps)[:n_src].tolist()
        dst = rng.permutation(1024 // pd)[:n_dst].tolist()
        assert dst_eng(op="expect", tid="units", prefix=prefix, dst=dst)["ok"]
        bounds = [0, *cuts, n_src]
        lane = [
            src_eng(
                op="send",
                tid="units",
                src=src[bounds[i] : bounds[i + 1]],
                offset=bounds[i],
                last=i == len(bounds) - 2,
                peer=service,
            )["lane"]
            for i in range(len(bounds) - 1)
        ]
        assert all(lane), f"not every chunk went over the lane: {lane}"
        got_d, got_s = dst_eng(op="wait", tid="units"), src_eng(op="wait", tid="units")
        assert got_d["state"] == got_s["state"] == "DONE", (got_d, got_s)
        assert got_d["route_note"] == "lane"
        lo, hi = prefix * pd, min(n_src * ps, (prefix + n_dst) * pd)  # sequence tokens landed
        want = src_eng(op="tokens", pages=src, lo=lo, hi=hi)["digests"]
        assert dst_eng(op="tokens", pages=dst, lo=0, hi=hi - lo)["digests"] == want
        untouched = sorted(set(range(1024 // pd)) - set(dst))
        assert all(s == 0 for region in dst_eng(op="pages", pages=untouched)["sums"] for s in region)
    finally:
        src_eng.close()
        dst_eng.close()


@pytest.mark.parametrize(
    ("src_pl", "dst_pl", "cuts"),
    [("nhc", "nhd", []), ("nhd", "nhc", [1, 2]), ("kv_nhd", "hnd", [2])],
    ids=["vllm-nhc-to-sglang-nhd", "sglang-nhd-to-vllm-nhc-3-chunks", "flashinfer-kv-nhd-to-hnd"],
)
def test_lane_converts_page_layouts_on_the_gpu(
    service: str, src_pl: str, dst_pl: str, cuts: list[int]
) -> None:
    """Pools of two page layouts on the lane's kernel (each head's rows a strided segment):
    every chunk over the lane, each head's K and V rows at their token."""
    src_eng, dst_eng = Engine(), Engine()
    try:
        src_eng(op="register", address=service, layout=dict(LAYOUT, page_layout=src_pl), fill=True, seed=3)
        dst_eng(op="register", address=service, layout=dict(LAYOUT, page_layout=dst_pl))
        src, dst = [9, 3, 40, 17, 22], [5, 60, 7, 33]
        assert dst_eng(op="expect", tid="layouts", prefix=1, dst=dst)["ok"]
        bounds = [0, *cuts, len(src)]
        lane = [
            src_eng(
                op="send", tid="layouts", src=src[bounds[i] : bounds[i + 1]], offset=bounds[i],
                last=i == len(bounds) - 2, peer=service,
            )["lane"]
            for i in range(len(bounds) - 1)
        ]  # fmt: skip
        assert all(lane), f"not every chunk went over the lane: {lane}"
        got_d, got_s = dst_eng(op="wait", tid="layouts"), src_eng(op="wait", tid="layouts")
        assert got_d["state"] == got_s["state"] == "DONE", (got_d, got_s)
        assert got_d["route_note"] == "lane"
        assert dst_eng(op="heads", pages=dst)["digests"] == src_eng(op="heads", pages=src[1:])["digests"]
    finally:
        src_eng.close()
        dst_eng.close()
