"""GPU: the cross-node lane (kvservice/transfer/lane/cross.py) between two services that do not map each
other's pools: engines in their own processes with CUDA IPC pools; the sender's lane packs into
its VRAM staging, one NIXL WRITE lands in the receiver's lane staging, the receiver's lane
unpacks, with no service's Python on the path."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from tests.support.gpu import LAYOUT, Engine, kvservice_procs, wait_lanes

pytestmark = pytest.mark.gpu
pytest.importorskip("nixl")


@pytest.fixture(params=["256", "4"], ids=["one-write", "streamed"])
def services(tmp_path: Path, request: pytest.FixtureRequest):
    """Two services; lane_cross_mb 256 (a delta up to 64 MiB is one WRITE) or 4 (a 1 MiB slot:
    40 pages of 192 KiB stream through it in 2-page chunks)."""
    env = {
        "KVSERVICE_TRANSFER_INTEGRITY": "0",
        "KVSERVICE_SAME_HOST_ROUTE": "off",
        "KVSERVICE_LANE_CROSS_MB": request.param,
    }
    procs, socks = kvservice_procs(tmp_path, ("prefill", "decode"), **env)
    wait_lanes(socks)
    yield socks
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(20)


@pytest.mark.parametrize("n", [1, 40])
def test_cross_node_lane_moves_the_delta_byte_for_byte(services: list[str], n: int) -> None:
    a, b = services
    src_eng, dst_eng = Engine(), Engine()
    try:
        src_eng(op="register", address=a, layout=LAYOUT, fill=True, seed=7)
        dst_eng(op="register", address=b, layout=LAYOUT)
        rng = np.random.default_rng(n)
        src = rng.permutation(64)[: n + 2].tolist()
        dst = rng.permutation(64)[:n].tolist()
        lane = []
        for turn in range(4):  # the first opens the prefill service's channel (gRPC); offers follow
            tid = f"x-{n}-{turn}"
            assert dst_eng(op="expect", tid=tid, prefix=2, dst=dst, sender=a)["state"] != "FAILED"
            time.sleep(0.05)  # the prefill's compute: the offer reaches the sender's lane
            lane.append(src_eng(op="send", tid=tid, src=src, peer=b)["lane"])
            got_d, got_s = dst_eng(op="wait", tid=tid), src_eng(op="wait", tid=tid)
            assert got_d["state"] == got_s["state"] == "DONE", (got_d, got_s)
            assert dst_eng(op="pages", pages=dst)["sums"] == src_eng(op="pages", pages=src[2:])["sums"]
        assert lane[1:] == [True, True, True], lane
        assert got_d["route_note"] == "cross-node lane" and got_d["path"] == "PACKED", got_d
        untouched = sorted(set(range(64)) - set(dst))
        assert all(s == 0 for region in dst_eng(op="pages", pages=untouched)["sums"] for s in region)
    finally:
        src_eng.close()
        dst_eng.close()


def test_cross_node_lane_takes_chunks_with_aux_rows_byte_for_byte(services: list[str]) -> None:
    """SGLang's shape across services: 4 chunks (one page each), aux rows in host memory on the
    last, every chunk on the cross-node lane, byte exact on the receiver's GPU and aux rows."""
    a, b = services
    src_eng, dst_eng = Engine(), Engine()
    try:
        src_eng(op="register", address=a, layout=LAYOUT, fill=True, seed=7, aux_rows=16)
        dst_eng(op="register", address=b, layout=LAYOUT, aux_rows=16)
        src, dst = [9, 3, 17, 40, 22], [5, 6, 7, 8]
        lanes = []
        for turn in range(3):  # the first opens the prefill service's channel; offers follow
            tid = f"xc-{turn}"
            assert (
                dst_eng(op="expect", tid=tid, prefix=1, dst=dst, sender=a, aux={"meta": [turn]})["state"]
                != "FAILED"
            )
            time.sleep(0.05)
            sent = []
            for i in range(5):
                last = i == 4
                got = src_eng(
                    op="send", tid=tid, src=src[i : i + 1], offset=i, last=last,
                    aux={"meta": [10 + turn]} if last else None, peer=b,
                )  # fmt: skip
                sent.append(got["lane"])
            lanes.append(all(sent))
            got_d, got_s = dst_eng(op="wait", tid=tid), src_eng(op="wait", tid=tid)
            assert got_d["state"] == got_s["state"] == "DONE", (got_d, got_s)
            assert dst_eng(op="pages", pages=dst)["sums"] == src_eng(op="pages", pages=src[1:])["sums"]
            assert dst_eng(op="aux", rows=[turn])["rows"] == src_eng(op="aux", rows=[10 + turn])["rows"]
        assert lanes[1:] == [True, True], lanes
        assert got_d["route_note"] == "cross-node lane", got_d
    finally:
        src_eng.close()
        dst_eng.close()


def _send_chunks(eng: Engine, tid: str, src: list[int], cuts: list[int], peer: str) -> bool:
    """``src`` sent in chunks cut at ``cuts``; whether every chunk went over the lane."""
    bounds = [0, *cuts, len(src)]
    sent = [  # every chunk is sent, whatever route an earlier one took
        eng(
            op="send", tid=tid, src=src[bounds[i] : bounds[i + 1]], offset=bounds[i],
            last=i == len(bounds) - 2, peer=peer,
        )["lane"]
        for i in range(len(bounds) - 1)
    ]  # fmt: skip
    return all(sent)


@pytest.mark.parametrize(
    "ps,pd,n_src,prefix,n_dst,cuts",
    [
        pytest.param(16, 1, 4, 8, 56, [], id="vllm-16-to-sglang-1"),
        pytest.param(16, 64, 3, 0, 1, [1], id="16-to-64-2-chunks-last-page-part-filled"),
        pytest.param(1, 16, 40, 0, 3, [16, 33], id="sglang-1-to-16-3-chunks"),
        pytest.param(64, 16, 2, 1, 7, [], id="64-to-16"),
    ],
)
def test_cross_node_lane_converts_page_sizes_on_the_gpu(
    services: list[str], ps: int, pd: int, n_src: int, prefix: int, n_dst: int, cuts: list[int]
) -> None:
    """Pools of two page sizes on two services (units of gcd tokens through the lanes' VRAM
    staging, one WRITE or streamed): every chunk over the cross-node lane, each token at its
    sequence position, no other page written."""
    a, b = services
    src_eng, dst_eng = Engine(), Engine()
    try:
        src_eng(op="register", address=a, layout=dict(LAYOUT, page_size=ps, num_pages=1024 // ps), fill=True)
        dst_eng(op="register", address=b, layout=dict(LAYOUT, page_size=pd, num_pages=1024 // pd))
        rng = np.random.default_rng(ps * 100 + pd)
        src = rng.permutation(1024 // ps)[:n_src].tolist()
        dst = rng.permutation(1024 // pd)[:n_dst].tolist()
        lanes = []
        for turn in range(3):  # the first opens the prefill service's channel (gRPC); offers follow
            tid = f"xu-{turn}"
            assert dst_eng(op="expect", tid=tid, prefix=prefix, dst=dst, sender=a)["state"] != "FAILED"
            time.sleep(0.05)  # the prefill's compute: the offer reaches the sender's lane
            lanes.append(_send_chunks(src_eng, tid, src, cuts, b))
            got_d, got_s = dst_eng(op="wait", tid=tid), src_eng(op="wait", tid=tid)
            assert got_d["state"] == got_s["state"] == "DONE", (got_d, got_s)
            lo, hi = prefix * pd, min(n_src * ps, (prefix + n_dst) * pd)  # sequence tokens landed
            want = src_eng(op="tokens", pages=src, lo=lo, hi=hi)["digests"]
            assert dst_eng(op="tokens", pages=dst, lo=0, hi=hi - lo)["digests"] == want
        assert lanes[1:] == [True, True], lanes
        assert got_d["route_note"] == "cross-node lane", got_d
        untouched = sorted(set(range(1024 // pd)) - set(dst))
        assert all(s == 0 for region in dst_eng(op="pages", pages=untouched)["sums"] for s in region)
    finally:
        src_eng.close()
        dst_eng.close()


@pytest.mark.parametrize(("src_pl", "dst_pl", "cuts"), [("nhc", "nhd", []), ("nhd", "nhc", [1, 2])])
def test_cross_node_lane_converts_page_layouts_on_the_gpu(
    services: list[str], src_pl: str, dst_pl: str, cuts: list[int]
) -> None:
    """vLLM's nhc and SGLang's nhd on two services: the sender packs each head's rows into the
    receiver's page layout (one WRITE or streamed), every chunk over the cross-node lane."""
    a, b = services
    src_eng, dst_eng = Engine(), Engine()
    try:
        src_eng(op="register", address=a, layout=dict(LAYOUT, page_layout=src_pl), fill=True, seed=5)
        dst_eng(op="register", address=b, layout=dict(LAYOUT, page_layout=dst_pl))
        src, dst = [9, 3, 40, 17, 22], [5, 60, 7, 33]
        lanes = []
        for turn in range(3):  # the first opens the prefill service's channel (gRPC); offers follow
            tid = f"xl-{turn}"
            assert dst_eng(op="expect", tid=tid, prefix=1, dst=dst, sender=a)["state"] != "FAILED"
            time.sleep(0.05)
            lanes.append(_send_chunks(src_eng, tid, src, cuts, b))
            got_d, got_s = dst_eng(op="wait", tid=tid), src_eng(op="wait", tid=tid)
            assert got_d["state"] == got_s["state"] == "DONE", (got_d, got_s)
            assert dst_eng(op="heads", pages=dst)["digests"] == src_eng(op="heads", pages=src[1:])["digests"]
        assert lanes[1:] == [True, True], lanes
        assert got_d["route_note"] == "cross-node lane", got_d
    finally:
        src_eng.close()
        dst_eng.close()
