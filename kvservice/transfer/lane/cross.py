"""The cross-node lane: a delta between two services' engines without either service's Python on
its path (docs/decisions/0018).

    receiving service                                     sending service
    ExpectDelta ─▶ offer_plan ─▶ ``offer_slot``: a slot of the lane's staging, armed (arm_in);
                   the plan carries it (ReceivePlan.lane_slot) ──channel──▶ ``offered``: arm_out
                                                          engine SEND_TO ─▶ native: pack into the
                                                          scratch, one WRITE + notification
    native: unpack into the declared pages, END to the ◀──────────────┘
    receiving engine, ack ─────────────────────────────────────────────▶ native: END to the engine
    completion fd ─▶ ``received``: the commit, DONE,      completion fd ─▶ ``sent``: the sender's
                     index; the slot back                                   record DONE, its marks

Each service has its own NIXL agent in the native module (the C API; the Python transport's
agent stays as it is); peers exchange its metadata in the handshake. What the native side does
not take (no offer yet, another layout, too large, a head slice, aux rows, several senders)
is answered *fallback* and goes over gRPC as before. The rules of DESIGN.md hold: a slot is
written only for a transfer its receiver armed; the receiver unpacks only an ARMED transfer (a
disarm is atomic with that check), so no byte reaches engine pages after Abort returns; a slot
whose transfer ended without the lane waits out the transfer's deadline before reuse (a late
WRITE may still land in it, never in engine pages); the sender reports DONE only after the
receiver's ack.

Here: the lane's agent, its peers and its staging; the receiving side is ``cross_in`` (``rx``),
the sending side ``cross_out`` (``tx``), the staging's slots ``cross_slots``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .cross_in import CANCELLED, CrossIn
from .cross_out import CrossOut
from .cross_slots import Arena, Slots, geometry_signature, slot_bytes

if TYPE_CHECKING:
    from ..engine import TransferEngine
    from ._native_api import NativeLane

__all__ = ["CANCELLED", "CrossBook", "Slots", "geometry_signature", "slot_bytes"]

log = logging.getLogger(__name__)
# The lanes' note format (csrc/wire.h XMAGIC): peers whose metadata carries another never pair
# (a rolling upgrade: their transfers take gRPC instead of timing out on unread notes).
WIRE = b"KVX4"


class CrossBook:
    """Python's half of the cross-node lane of one service."""

    def __init__(
        self,
        engine: TransferEngine,
        native: NativeLane,
        agent_name: str,
        arenas: list[Arena],
        stream: str = "gpu",
    ) -> None:
        self.n = native
        self.agent_name = agent_name
        self.arenas = {a.device: a for a in arenas}
        self._md = native.local_md()
        self._agents: dict[str, str] = {}  # peer service id -> its lane agent (both sides read it)
        self.rx = CrossIn(engine, native, agent_name, self.arenas, self._agents, stream)  # receiving
        self.tx = CrossOut(engine, native, self._agents)  # sending

    @property
    def n_sent(self) -> int:
        return self.tx.n_sent

    @property
    def n_received(self) -> int:
        return self.rx.n_received

    @classmethod
    def start(
        cls,
        engine: TransferEngine,
        native: NativeLane,
        staging_mb: int,
        cuda_devices: int,
        stream: str = "gpu",
        gpu_staging_mb: int = 0,
    ) -> CrossBook | None:
        """The lane's NIXL agent and its staging (host memory: ``staging_mb``; each GPU:
        ``gpu_staging_mb``, or ``staging_mb`` when 0); None (logged) when NIXL's C API is not there."""
        from .native import nixl_capi_path

        path = nixl_capi_path()
        if path is None or engine.transport.kind != "nixl":
            log.info("cross-node lane off: NIXL is not this service's transport")
            return None
        name = f"{engine.service_id}-lane"
        if not native.init_nixl(path, name):
            log.warning("cross-node lane off: %s", native.nixl_why())
            return None
        arenas = []
        for device in [-1, *range(cuda_devices)]:
            half = (gpu_staging_mb if device >= 0 and gpu_staging_mb else staging_mb) * (1 << 20) // 2
            try:
                base = native.add_arena(device, half, half)
            except RuntimeError as exc:
                log.warning("cross-node lane: no staging on device %s: %s", device, exc)
                continue
            arenas.append(Arena(device, int(base), Slots(half)))
        if not arenas:
            return None
        native.set_trace(log.isEnabledFor(logging.DEBUG))  # the chunks' timeline (log_trace)
        return cls(engine, native, name, arenas, stream)

    # -- peers ---------------------------------------------------------------------------------
    def metadata(self) -> bytes:
        return WIRE + bytes(self._md)

    def load_peer(self, service_id: str, md: bytes) -> str:
        """A peer's lane metadata (from the handshake, either way): its agent name, or ""."""
        if not md.startswith(WIRE):
            self._agents.pop(service_id, None)
            if md:
                log.warning(
                    "cross-node lane: a peer's lane speaks another version: gRPC with it",
                    extra={"peer": service_id},
                )
            return ""
        try:
            name = str(self.n.load_md(md[len(WIRE) :]))
        except RuntimeError as exc:
            log.warning(
                "cross-node lane: a peer's metadata did not load: %s", exc, extra={"peer": service_id}
            )
            return ""
        self._agents[service_id] = name
        return name

    def log_trace(self) -> None:
        """DEBUG: each chunk the lane timed since the last call, one "lane chunk" line each (the
        batch timeline of ``bench_transfer --timeline``; csrc/state.h ChunkTrace has the points)."""
        if not log.isEnabledFor(logging.DEBUG):
            return
        for tid, side, first, npages, nbytes, t in self.n.take_trace():
            log.debug(
                "lane chunk",
                extra={
                    "transfer_id": tid,
                    "side": "send" if side == 0 else "recv",
                    "first": int(first),
                    "pages": int(npages),
                    "bytes": int(nbytes),
                    "t": list(t[:5] if side == 0 else t[:4]),
                },
            )

    def log_stats(self) -> None:
        """One INFO line: where this lane's cross-node transfers spent their time (µs each)."""
        st = [int(x) for x in self.n.stats()]
        sent, got, copies = max(st[0], 1), max(st[6], 1), max(st[9], 1)
        log.info(
            "cross-node lane: %d sent (pack %d, post %d, wait %d, ack %d µs each; %d re-posted), "
            "%d received (note %d, unpack %d µs each); %d CUDA copies (lock %d, sync %d µs each)",
            st[0],
            st[1] // sent,
            st[2] // sent,
            st[3] // sent,
            st[5] // sent,
            st[8],
            st[6],
            st[4] // got,
            st[7] // got,
            st[9],
            st[10] // copies,
            st[11] // copies,
        )

    def close(self) -> None:
        self.rx.close()
