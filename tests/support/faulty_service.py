"""``python tests/support/faulty_service.py ARGS``: ``python -m kvservice ARGS`` with a fault injected, for
tests of services that run as processes (in-process services are monkeypatched instead, as in
tests/transfer/test_integrity.py). Without its variable it is the plain service.

``KVS_TEST_CORRUPT_PACKED=<file>``: while ``<file>`` exists, each packed batch this service sends
has one byte flipped after the sender's checksum was taken (behind its pack, ``pack_hashed``) and
before the batch is written to the receiver: what arrives is not what the check covers, a staging
batch corrupted in transit. Each corrupted batch appends a line to ``<file>``.

``KVS_TEST_SLOW_LANE_UNPACK_US=<µs>``: the cross-node lane's receiving side starts each unpack
that late (the native fault hook ``set_slow_unpack``): a receiver to kill mid-transfer.

``KVS_TEST_SLOW_LANE_START_S=<s>``: the native lane's module loads that much later (a first build):
peers handshake with this service while its lane is not up yet.
"""

from __future__ import annotations

import os
import sys
from typing import Any


def _corrupt_packed(trigger: str) -> None:
    import torch

    from kvservice.transfer.routes import packed

    real = packed.pack_hashed

    async def corrupting(plan: Any, target: Any, regions: Any, src: Any, view: Any, **kw: Any) -> Any:
        check = await real(plan, target, regions, src, view, **kw)
        if view is not None and os.path.exists(trigger):
            flat = view.reshape(-1)
            flat[flat.numel() // 2] ^= 0x5A
            if flat.is_cuda:  # on the device before the write reads the batch
                torch.cuda.synchronize(flat.device)
            with open(trigger, "a") as f:
                f.write(f"corrupted a packed batch of {flat.numel()} bytes on {flat.device}\n")
        return check

    packed.pack_hashed = corrupting


def _slow_lane_unpack(us: int) -> None:
    from kvservice.transfer.lane.cross import CrossBook

    real = CrossBook.start.__func__  # type: ignore[attr-defined]

    def start(cls: type, engine: Any, native: Any, *args: Any, **kw: Any) -> Any:
        native.set_slow_unpack(us)
        return real(cls, engine, native, *args, **kw)

    CrossBook.start = classmethod(start)  # type: ignore[method-assign,assignment]


def _slow_lane_start(seconds: float) -> None:
    import time

    from kvservice.transfer.lane import native

    real = native.load

    def load() -> Any:
        time.sleep(seconds)
        return real()

    native.load = load


def main() -> int:
    trigger = os.environ.get("KVS_TEST_CORRUPT_PACKED")
    if trigger:
        _corrupt_packed(trigger)
    slow = os.environ.get("KVS_TEST_SLOW_LANE_UNPACK_US")
    if slow:
        _slow_lane_unpack(int(slow))
    late = os.environ.get("KVS_TEST_SLOW_LANE_START_S")
    if late:
        _slow_lane_start(float(late))
    from kvservice.cli import main as serve

    return serve()


if __name__ == "__main__":
    sys.exit(main())
