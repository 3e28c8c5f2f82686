"""Where a same-node lane transfer's time goes, seen from the engines' process (one service).

Timestamps around each hop of ``send_delta`` -> the receiving engine's ``wait`` returning DONE:
the call reaching ``Lane.send``, the REPLY decoded, ``send_delta`` returning, the receiver's END
decoded, ``wait`` returning; ``copy_us`` is the service's own copy time from the END. Medians
for one page (64 KiB) and 2 GiB, at Python's default thread switch interval and at 50 µs.

    python3 bench/probe_lane.py            # GPU 0 (PROBE_DEV=cpu: shm pools); JSON to $OUT
    PROBE_SPINS=0:0,200:0,200:100 python3 bench/probe_lane.py   # lane_spin_us service:SDK
    PROBE_NO_READER=1 python3 bench/probe_lane.py    # the clients' lane reader threads off (A/B)

The END's timeline (``lane_wire.end_times``) splits ``lane_send_to_end_rx`` into the hops through
the service: ``lane_send_to_svc_recv`` (the SEND's way in), ``svc_recv_to_svc_checked`` (its
checks and the receiver ranks), ``svc_checked_to_svc_launch`` (the copy's table and launch),
``svc_launch_to_svc_done`` (the copy, as the finisher sees it), ``svc_done_to_svc_end`` and
``svc_end_to_end_rx`` (the END's way out, decoded).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import numpy as np
from _harness import Services, pools
from kvservice_client import Client, Layout, _lane, lane_wire

T: dict[str, float] = {}
_decode, _send = lane_wire.decode, _lane.Lane.send


def _timed_decode(data: bytes) -> Any:
    msg = _decode(data)
    kind = "reply" if isinstance(msg, lane_wire.Reply) else f"end{msg[0]}"
    T[kind] = time.perf_counter()
    if kind.startswith("end"):
        T["copy_us_" + kind] = msg[8]
        at = lane_wire.end_times(data)
        if at is not None and kind == "end0":  # the service's timeline, same clock
            T["svc_recv"], T["svc_checked"], T["svc_launch"], T["svc_done"], T["svc_end"] = at
    return msg


def _timed_send(self: Any, *a: Any, **kw: Any) -> bool:
    T["lane_send"] = time.perf_counter()
    return _send(self, *a, **kw)


_lane.lane_wire.decode = _timed_decode  # type: ignore[attr-defined]
_lane.Lane.send = _timed_send  # type: ignore[method-assign]
DEV: Any = os.environ.get("PROBE_DEV", "0")
DEV = int(DEV) if DEV.isdigit() else DEV


def _service_steps(end_rx: float) -> dict[str, float]:
    """The hops inside lane_send_to_end_rx, from the END's timeline (absent: none)."""
    if "svc_recv" not in T:
        return {}
    pts = ("lane_send", "svc_recv", "svc_checked", "svc_launch", "svc_done", "svc_end")
    steps = {f"{a}_to_{b}": (T[b] - T[a]) * 1e6 for a, b in zip(pts[:-1], pts[1:], strict=True)}
    steps["svc_end_to_end_rx"] = (end_rx - T["svc_end"]) * 1e6
    return steps


if os.environ.get("PROBE_NO_READER") == "1":  # A/B: the clients' lane reader threads never run
    _lane.Lane._read = lambda self: None  # type: ignore[method-assign]


def one(layers: int, pages: int, iters: int, svc_spin: int = 0, sdk_spin: int = 0) -> dict[str, Any]:
    layout = Layout.mha(
        num_layers=layers, page_size=16, num_pages=2048, total_kv_heads=8, head_dim=128, dtype="bfloat16"
    )
    rng = np.random.default_rng(0)
    src = rng.choice(2048, pages, replace=False).astype(np.int64)
    dst = rng.choice(2048, pages, replace=False).astype(np.int64)
    rows = []
    env = {"KVSERVICE_LANE_SPIN_US": str(svc_spin)}
    with Services(1, env) as svc, pools((layout, DEV, 1), (layout, DEV, None)) as (ps, pr):
        a, peer = svc.addresses[0], svc.peer_addresses[0]
        with (
            Client(a, client_name="tx", lane_spin_us=sdk_spin) as ka,
            Client(a, client_name="rx", lane_spin_us=sdk_spin) as kb,
        ):
            ra = ka.register_buffers(layout, *ps.regions()).buffer_set_id
            rb = kb.register_buffers(layout, *pr.regions()).buffer_set_id
            for it in range(iters + 1):
                tid = f"p-{layers}-{pages}-{it}"
                kb.expect_delta(tid, rb, prefix_pages=0, dst_page_indices=dst, sender_address=peer)
                T.clear()
                t0 = time.perf_counter()
                ka.send_delta(tid, ra, src_page_indices=src, peer_address=peer, path="auto")
                t1 = time.perf_counter()
                (r,) = kb.wait(tid, timeout=30)
                t2 = time.perf_counter()
                ka.wait(tid, timeout=30)
                if it:  # the first round warms the lane
                    end = T.get("end0", t2)
                    rows.append(
                        {
                            "send_call_to_lane": (T["lane_send"] - t0) * 1e6,
                            "lane_send_to_reply": (T["reply"] - T["lane_send"]) * 1e6,
                            "reply_to_send_return": (t1 - T["reply"]) * 1e6,
                            "lane_send_to_end_rx": (end - T["lane_send"]) * 1e6,
                            "end_rx_to_wait_return": (t2 - end) * 1e6,
                            "copy_us": T.get("copy_us_end0", -1),
                            **_service_steps(end),
                            "e2e": (t2 - t0) * 1e6,
                            "route": r.route_note,
                        }
                    )
    med: dict[str, Any] = {k: float(np.median([r[k] for r in rows])) for k in rows[0] if k != "route"}
    med["routes"] = sorted({r["route"] for r in rows})
    return med


def main() -> None:
    """PROBE_SPINS: "service µs:SDK µs" pairs (lane_spin_us of the service and of the clients),
    each measured at Python's thread switch interval; PROBE_SW50=1 adds the 50 µs one."""
    out: dict[str, Any] = {}
    spins = [tuple(int(x) for x in p.split(":")) for p in os.environ.get("PROBE_SPINS", "0:0").split(",")]
    for sw in (0, 50) if os.environ.get("PROBE_SW50") == "1" else (0,):
        if sw:
            sys.setswitchinterval(sw * 1e-6)
        for svc_spin, sdk_spin in spins:
            tag = f"sw{sw}_spin{svc_spin}_{sdk_spin}"
            out[f"64k_{tag}"] = one(1, 1, 300, svc_spin, sdk_spin)
            out[f"2g_{tag}"] = one(32, 1024, 40, svc_spin, sdk_spin)
            print(json.dumps({k: out[k] for k in (f"64k_{tag}", f"2g_{tag}")}, indent=1), flush=True)
    d = os.environ.get("OUT", "/tmp")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, f"lane_probe{os.environ.get('PROBE_TAG', '')}.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
