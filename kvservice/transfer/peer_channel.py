"""The peer channel: one bidirectional stream per (sending service -> receiving service) pair.

Replaces two unary calls per packed batch (ReserveStaging, CommitChunk) by credits and one
message each way::

    sender                                               receiver
      open, credit_request(DRAM) ───────────────────────▶  reserve W slots of its staging pool
      ◀─────────────────────────────────── grant(slots)    (the channel's until it closes)
      take a credit; pack; WRITE into the slot
      commit(seq, credit_slot=k, positions…) ───────────▶  unpack slot k into the engine's pages
      ◀─────────────────────────────────── ack(seq)        credit k is back with the sender

Every commit (direct, packed, markers) rides the channel; acks come back in completion order,
matched by ``seq``. A broken stream fails the commits in flight on the sender (UNAVAILABLE, the
transfer fails with that reason within its deadline) and frees the channel's slots on the
receiver once the unpacks in progress ended; the next use reopens it and asks for credits again.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
from kvservice_client.proto import common_pb2, peer_pb2, peer_pb2_grpc

from ..errors import DeadlineExceeded, KVServiceError, ResourceExhausted, Unavailable
from ..identity import peer_identity
from ..staging import Slot, StagingPool
from . import trace
from .peer_codec import plan_from_pb
from .peer_serving import apply_commit, receive_plans
from .peers import error_from_code
from .receiver import ticket_matches
from .values import Plan

if TYPE_CHECKING:
    from .engine import TransferEngine

__all__ = [
    "CreditBroker",
    "InboundChannel",
    "OfferBook",
    "OfferChannels",
    "OutboundChannel",
    "WINDOW",
    "end_inbound_channels",
    "serve_channel",
]

log = logging.getLogger(__name__)
MAX_PENDING_PER_CHANNEL = 4096  # commits and plan requests being handled for one sender
MAX_OFFERS = 4096  # plans a sender keeps offered per channel (the oldest go first)
WINDOW = 4  # credit slots a receiver grants one channel per pool, while it has room
IDLE_RETURN_S = 1.0  # a channel unused this long gives its credits back
_SLOT_FRACTION = 8  # a credit slot is 1/8 of the receiver's pool


# -- receiver side ---------------------------------------------------------------------------------
class CreditBroker:
    """Shares each staging pool's credit slots among the channels of this receiving service.

    A pool is cut into ``_SLOT_FRACTION`` slots; a channel's fair share is the pool's slots over
    the channels holding or waiting for them (at most ``WINDOW``, at least one). A slot changes
    hands only when its holder cannot be writing into it: when the holder's commit of it is
    answered (the ack revokes it if the holder is over its share and another channel waits), when
    the holder gives it back idle, or when its channel closes.
    """

    def __init__(self) -> None:
        self.held: dict[int, dict[InboundChannel, int]] = {}  # id(pool) -> channel -> slots held
        self.waiting: dict[int, list[tuple[InboundChannel, str, int]]] = {}

    def share(self, pool: StagingPool) -> int:
        key = id(pool)
        users = set(self.held.get(key, {})) | {c for c, _, _ in self.waiting.get(key, [])}
        return max(1, min(WINDOW, _SLOT_FRACTION // max(1, len(users))))

    def grant(self, chan: InboundChannel, pool: StagingPool, mem_kind: str, device: int) -> list[Slot]:
        key = id(pool)
        held = self.held.setdefault(key, {})
        want = self.share(pool) - held.get(chan, 0)
        slots: list[Slot] = []
        size = max(1, pool.capacity_bytes // _SLOT_FRACTION)
        while len(slots) < want and (slot := pool.try_reserve(size)) is not None:
            slots.append(slot)
        if slots:
            held[chan] = held.get(chan, 0) + len(slots)
        if held.get(chan, 0) < self.share(pool) and all(
            c is not chan for c, _, _ in self.waiting.get(key, [])
        ):
            self.waiting.setdefault(key, []).append((chan, mem_kind, device))
        return slots

    def should_revoke(self, chan: InboundChannel, pool: StagingPool) -> bool:
        key = id(pool)
        return bool(self.waiting.get(key)) and self.held.get(key, {}).get(chan, 0) > self.share(pool)

    def released(self, chan: InboundChannel, pool: StagingPool, n: int) -> None:
        """``chan`` gave up ``n`` slots of ``pool`` (already released to it): serve the waiters."""
        key = id(pool)
        held = self.held.setdefault(key, {})
        held[chan] = held.get(chan, 0) - n
        if held[chan] <= 0:
            held.pop(chan, None)
        waiters, self.waiting[key] = self.waiting.get(key, []), []
        for other, mem_kind, device in waiters:
            if not other.closed:
                other.regrant(mem_kind, device)

    def forget(self, chan: InboundChannel) -> None:
        for waiters in self.waiting.values():
            waiters[:] = [w for w in waiters if w[0] is not chan]


class OfferChannels:
    """The open inbound channel of each sending service, by its address: where ExpectDelta's
    ``sender_address`` finds the channel to push its plan on (data path v3 §3)."""

    def __init__(self) -> None:
        self._by_address: dict[str, list[InboundChannel]] = {}

    def opened(self, chan: InboundChannel) -> None:
        if chan.address:  # NOTE: a claim: another peer may claim it too (offers check identities)
            self._by_address.setdefault(chan.address, []).append(chan)

    def closed(self, chan: InboundChannel) -> None:
        chans = self._by_address.get(chan.address, [])
        if chan in chans:
            chans.remove(chan)
            if not chans:
                del self._by_address[chan.address]

    def get(self, address: str, allowed: frozenset[str]) -> InboundChannel | None:
        """The newest open channel claiming ``address`` whose proven identity ``allowed`` names;
        with nothing in ``allowed`` (peers by token: none proves who it is), the newest
        token-authenticated one claiming it (``sender_binding.offer`` says why that is safe)."""
        for chan in reversed(self._by_address.get(address, [])):
            if chan.identity in allowed or (not allowed and not chan.identity):
                return chan
        return None


class InboundChannel:
    """One sender's channel on the receiving service; ``apply`` runs a commit (peer_serving.apply_commit)."""

    def __init__(
        self,
        pool_of: Callable[[str, int], StagingPool],
        apply: Callable[[peer_pb2.CommitChunkRequest, dict[int, tuple[StagingPool, Slot]]], Awaitable[str]],
        send: Callable[[peer_pb2.ChannelMessage], Awaitable[None]],
        broker: CreditBroker,
        plans: Callable[[peer_pb2.GetReceivePlanRequest], Awaitable[peer_pb2.ReceivePlanSet]],
        identity: str = "",
        on_open: Callable[[InboundChannel], None] | None = None,
    ) -> None:
        self.identity = identity  # what the sending service proved at the channel's connection
        self.address = ""  # the sending service's address (its open message)
        self._on_open = on_open
        self._plans = plans
        self._pool_of = pool_of
        self._apply = apply
        self._send = send
        self._broker = broker
        self.slots: dict[int, tuple[StagingPool, Slot]] = {}
        self._in_use: set[int] = set()  # credit slots whose commit is being applied (unpacked)
        self._tasks: set[asyncio.Task[None]] = set()
        self.peer = ""
        self.closed = False

    async def on_message(self, msg: peer_pb2.ChannelMessage) -> None:
        which = msg.WhichOneof("body")
        if which == "open":
            self.peer, self.address = msg.open.sender_service_id, msg.open.sender_address
            if self._on_open is not None:
                self._on_open(self)
        elif which == "credit_request":
            await self._grant(msg.credit_request.mem_kind, msg.credit_request.device_id)
        elif which in ("commit", "plan_request") and len(self._tasks) >= MAX_PENDING_PER_CHANNEL:
            await self._send(  # a sender this far ahead is misbehaving: refuse, keep memory bounded
                peer_pb2.ChannelMessage(
                    seq=msg.seq,
                    ack=peer_pb2.ChannelAck(
                        error_code="RESOURCE_EXHAUSTED",
                        error=f"more than {MAX_PENDING_PER_CHANNEL} requests pending on this channel",
                    ),
                )
            )
        elif which == "commit":
            trace.mark(msg.commit.transfer_id, "commit_rx")
            self._spawn(self._commit(msg.seq, msg.commit))
        elif which == "release":
            self._release([int(i) for i in msg.release.slot_ids])
        elif which == "plan_request":
            self._spawn(self._plan(msg.seq, msg.plan_request))

    async def _plan(self, seq: int, req: peer_pb2.GetReceivePlanRequest) -> None:
        try:
            reply = peer_pb2.ChannelMessage(seq=seq, plan=await self._plans(req))
        except KVServiceError as exc:
            reply = peer_pb2.ChannelMessage(
                seq=seq, ack=peer_pb2.ChannelAck(error_code=exc.code.name, error=exc.message)
            )
        except Exception as exc:
            log.exception("channel plan request failed", extra={"transfer_id": req.transfer_id})
            reply = peer_pb2.ChannelMessage(
                seq=seq, ack=peer_pb2.ChannelAck(error_code="INTERNAL", error=f"{type(exc).__name__}: {exc}")
            )
        if not self.closed:
            await self._send(reply)

    async def offer(self, plans: peer_pb2.ReceivePlanSet) -> None:
        """Push plans the sender did not ask for yet (ExpectDelta named this sending service)."""
        if not self.closed:
            await self._send(peer_pb2.ChannelMessage(plan_offer=plans))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def regrant(self, mem_kind: str, device: int) -> None:
        if not self.closed:
            self._spawn(self._grant(mem_kind, device))

    async def _grant(self, mem_kind: str, device: int) -> None:
        pool = self._pool_of(mem_kind, device)
        granted = self._broker.grant(self, pool, mem_kind, device)
        for slot in granted:
            self.slots[slot.serial] = (pool, slot)
        if self.closed:  # closed while this grant was on its way: nobody will use them
            self._release([s.serial for s in granted])
            return
        await self._send(
            peer_pb2.ChannelMessage(
                grant=peer_pb2.CreditGrant(
                    mem_kind=mem_kind,
                    device_id=device,
                    slots=[
                        peer_pb2.StagingSlot(
                            slot_id=s.serial,
                            address=s.addr,
                            size_bytes=s.nbytes,
                            mem_kind="VRAM" if pool.kind == "vram" else "DRAM",
                            device_id=pool.device,
                        )
                        for s in granted
                    ],
                )
            )
        )

    def _release(self, slot_ids: list[int]) -> None:
        by_pool: dict[int, tuple[StagingPool, int]] = {}
        for sid in slot_ids:
            held = self.slots.pop(sid, None)
            if held is None:
                continue
            pool, slot = held
            pool.release(slot)
            n = by_pool.get(id(pool), (pool, 0))[1]
            by_pool[id(pool)] = (pool, n + 1)
        for pool, n in by_pool.values():
            self._broker.released(self, pool, n)

    async def _commit(self, seq: int, req: peer_pb2.CommitChunkRequest) -> None:
        ack = peer_pb2.ChannelAck()
        slot_id = req.staging_slot if req.credit_slot else None
        if slot_id is not None:
            self._in_use.add(slot_id)
        try:
            state = await self._apply(req, self.slots)
            ack.state = common_pb2.TransferState.Value(f"TRANSFER_STATE_{state}")
        except KVServiceError as exc:
            ack.error_code, ack.error = exc.code.name, exc.message
        except Exception as exc:  # never leave a sender waiting on an ack
            log.exception("channel commit failed", extra={"transfer_id": req.transfer_id})
            ack.error_code, ack.error = "INTERNAL", f"{type(exc).__name__}: {exc}"
        finally:
            if slot_id is not None:
                self._in_use.discard(slot_id)
                if self.closed:  # the channel closed while this batch was being unpacked
                    self._release([slot_id])
        if self.closed:
            return
        held = self.slots.get(req.staging_slot) if req.credit_slot else None
        if held is not None and self._broker.should_revoke(self, held[0]):
            ack.credit_revoked = True
            self._release([req.staging_slot])
        trace.mark(req.transfer_id, "ack_sent")
        await self._send(peer_pb2.ChannelMessage(seq=seq, ack=ack))

    def close(self) -> None:
        """The stream ended: free the channel's slots now, or as their unpack ends (it reads them)."""
        self.closed = True
        self._broker.forget(self)
        self._release([sid for sid in self.slots if sid not in self._in_use])


async def serve_channel(
    requests: AsyncIterator[peer_pb2.ChannelMessage],
    context: grpc.aio.ServicerContext,
    engine: TransferEngine,
) -> None:
    """Run one inbound channel on a grpc.aio stream-stream call for the receiving ``engine``."""
    out: asyncio.Queue[peer_pb2.ChannelMessage | None] = asyncio.Queue()

    async def send(msg: peer_pb2.ChannelMessage) -> None:
        await out.put(msg)

    async def writer() -> None:
        while (msg := await out.get()) is not None:
            await context.write(msg)

    peer = context.peer()
    identity = peer_identity(context)  # proven once, at the channel's connection

    async def plans(req: peer_pb2.GetReceivePlanRequest) -> peer_pb2.ReceivePlanSet:
        return await receive_plans(engine, req, peer, identity)

    async def apply(req: peer_pb2.CommitChunkRequest, slots: dict[int, tuple[StagingPool, Slot]]) -> str:
        return await apply_commit(engine, req, identity, slots)

    chan = InboundChannel(
        engine.memory.pool_of,
        apply,
        send,
        engine.credit_broker,
        plans,
        identity,
        engine.offer_channels.opened,
    )
    wtask = asyncio.get_running_loop().create_task(writer())
    why = "the sending service closed its channel"
    me = asyncio.current_task()
    if me is not None:  # the engine ends open channels when it closes (server stop would wait on them)
        engine.inbound_channels.add(me)
    try:
        async for msg in requests:
            await chan.on_message(msg)
    except asyncio.CancelledError:
        # NOTE: not re-raised: the call is over either way (the sender went away, or this service
        # is stopping and the engine ended its channels), and grpc.aio logs a CancelledError
        # escaping a servicer as an unhandled exception, with a traceback, at every server stop.
        why = "the sending service's channel broke (service gone or connection lost)"
    finally:
        engine.inbound_channels.discard(me)
        engine.offer_channels.closed(chan)
        chan.close()
        if chan.peer:  # its transfers fail now, not at their deadline
            asyncio.get_running_loop().create_task(engine.sender_gone(chan.peer, why))
        await out.put(None)
        try:
            await asyncio.wait_for(wtask, 1.0)
        except (asyncio.TimeoutError, Exception):
            wtask.cancel()


async def end_inbound_channels(engine: TransferEngine, timeout: float = 2.0) -> None:
    """End the channels of every sending service now and wait (bounded) for their handlers.

    Called when the service stops, once its transfers are over and before its servers stop: grpc
    cancels a stream still open at its server's stop and logs that as an unhandled exception, with
    a traceback. Each sender sees its stream end and reopens it on its next use (another instance).
    """
    tasks = list(engine.inbound_channels)
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout)


# -- sender side -----------------------------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class Offered:
    """The plans of one transfer a receiver pushed (one per receiver rank), until its deadline."""

    plans: dict[int, Plan]  # receiver TP rank -> its plan (decoded on arrival; no route yet)
    metadata_epoch: int
    expires: float
    service_id: str = ""  # the receiving service's (another than our handshake's: it restarted)
    used_by: set[int] = dataclasses.field(default_factory=set)  # our TP ranks that took it


class OfferBook:
    """Offers by transfer id, bounded (MAX_OFFERS, oldest out) and dropped at their deadline."""

    def __init__(self, on_lane_slot: Callable[[peer_pb2.ReceivePlan], None] | None = None) -> None:
        self._by_tid: dict[str, Offered] = {}
        self._on_lane_slot = on_lane_slot  # each offer, for the cross-node lane (kvservice.transfer.lane)

    def add(self, offer: peer_pb2.ReceivePlanSet) -> None:
        now = time.monotonic()
        for m in offer.plans:  # NOTE: decoded here, while the prefill computes, not at SendDelta
            plan = plan_from_pb(m, 0)  # the route (and its source rank) is each sender rank's
            hit = self._by_tid.get(plan.transfer_id)
            if hit is None or hit.expires < now:
                hit = self._by_tid[plan.transfer_id] = Offered(
                    {}, offer.metadata_epoch, now + plan.remaining_ms / 1000, offer.service_id
                )
            hit.plans[plan.dst_layout.tp_rank] = plan
            hit.metadata_epoch = max(hit.metadata_epoch, offer.metadata_epoch)
            if self._on_lane_slot is not None:
                try:
                    self._on_lane_slot(m)
                except Exception:  # the offer stands for gRPC; the lane just does not take it
                    log.exception(
                        "arming the cross-node lane failed", extra={"transfer_id": plan.transfer_id}
                    )
        while len(self._by_tid) > MAX_OFFERS:
            del self._by_tid[next(iter(self._by_tid))]

    def get(self, transfer_id: str) -> Offered | None:
        hit = self._by_tid.get(transfer_id)
        if hit is not None and hit.expires < time.monotonic():
            del self._by_tid[transfer_id]
            return None
        return hit

    def consume(self, transfer_id: str, rank: int | None) -> None:
        """Sender rank ``rank`` (None: unknown, every rank) took ``transfer_id``'s offer another
        way (the cross-node lane): no later SendDelta may write with its plans, since the
        receiver may have ended; it asks for a plan instead, and learns."""
        hit = self._by_tid.get(transfer_id)
        if hit is not None and rank is not None:
            hit.used_by.add(rank)
        elif hit is not None:
            del self._by_tid[transfer_id]

    def drop(self, transfer_id: str, ticket: str) -> bool:
        """Forget ``transfer_id``'s offers if one carries ``ticket`` (the receiver ended it)."""
        hit = self._by_tid.get(transfer_id)
        if hit is None or not any(ticket_matches(p.sender_ticket, ticket) for p in hit.plans.values()):
            return False
        del self._by_tid[transfer_id]
        return True

    def clear(self) -> None:
        self._by_tid.clear()


class OutboundChannel:
    """This service's channel to one receiving service; reopened after a break."""

    def __init__(
        self,
        address: str,
        stub_of: Callable[[], peer_pb2_grpc.KVPeerStub],
        me: tuple[str, str],
        on_lane_slot: Callable[[peer_pb2.ReceivePlan], None] | None = None,
    ) -> None:
        self.address = address
        self._stub_of = stub_of
        self._me = me
        self._call: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._seq = 0
        self._pending: dict[int, asyncio.Future[peer_pb2.ChannelMessage]] = {}
        self._credits: dict[tuple[str, int], collections.deque[peer_pb2.StagingSlot]] = {}
        self._asked: set[tuple[str, int]] = set()
        self._granted: dict[tuple[str, int], int] = {}
        self._slot_bytes: dict[tuple[str, int], int] = {}
        self._waiters = 0
        self._last_use = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None
        self._changed = asyncio.Condition()
        self._lock = asyncio.Lock()
        self._wlock = asyncio.Lock()
        self.epoch = 0  # bumped on every (re)open: credits of an older epoch are void
        self.offers = OfferBook(on_lane_slot)  # plans the receiver pushed before we asked (data path v3 §3)

    async def _write(self, msg: peer_pb2.ChannelMessage) -> None:
        call = self._call
        if call is None:
            raise Unavailable(f"peer channel to {self.address} is closed")
        try:
            async with self._wlock:  # NOTE: grpc.aio allows one write in flight per call
                await call.write(msg)
        except Exception as exc:  # the stream broke under us (RpcError, InvalidStateError, ...)
            self._broken(call, f"write failed: {type(exc).__name__}: {exc}")
            raise Unavailable(f"peer channel to {self.address} broke: {exc}") from None

    async def _ensure_open(self) -> None:
        async with self._lock:
            if self._call is not None:
                return
            self._call = self._stub_of().Channel()
            self.epoch += 1
            self._reader = asyncio.get_running_loop().create_task(self._read(self._call))
            sid, addr = self._me
            await self._write(
                peer_pb2.ChannelMessage(open=peer_pb2.ChannelOpen(sender_service_id=sid, sender_address=addr))
            )

    async def _read(self, call: Any) -> None:
        why = "the receiver closed the channel"
        try:
            async for msg in call:
                which = msg.WhichOneof("body")
                if which in ("ack", "plan"):
                    fut = self._pending.pop(msg.seq, None)
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
                elif which == "plan_offer":
                    self.offers.add(msg.plan_offer)
                elif which == "grant":
                    key = (msg.grant.mem_kind, msg.grant.device_id)
                    self._credits.setdefault(key, collections.deque()).extend(msg.grant.slots)
                    self._granted[key] = self._granted.get(key, 0) + len(msg.grant.slots)
                    if msg.grant.slots:
                        self._slot_bytes[key] = min(s.size_bytes for s in msg.grant.slots)
                        self._last_use = time.monotonic()
                        if self._idle_timer is None:  # granted late, perhaps never used: return idle
                            self._idle_timer = asyncio.get_event_loop().call_later(
                                IDLE_RETURN_S, self._idle_check
                            )
                    async with self._changed:
                        self._changed.notify_all()
        except grpc.RpcError as exc:
            why = f"{exc.code().name}: {exc.details()}"
        except asyncio.CancelledError:
            why = "channel closed"
        finally:
            self._broken(call, why)

    def _broken(self, call: Any, why: str) -> None:
        if self._call is not call:
            return
        self._call = None
        # NOTE: cancelled even when it already ended: an intercepted stream (grpc.aio) writes
        # through a request generator whose task otherwise stays pending until the loop closes
        # ("Task was destroyed but it is pending" at the service's stop)
        call.cancel()
        self.offers.clear()  # NOTE: offers are tied to the channel's identity: ask after a break
        self._credits.clear()
        self._asked.clear()
        self._granted.clear()
        self._slot_bytes.clear()
        err = Unavailable(f"peer channel to {self.address} broke: {why}")
        failed = 0
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(err)
                failed += 1
        self._pending.clear()
        loop = asyncio.get_event_loop()
        loop.create_task(self._notify())
        # NOTE: an idle channel ending is ordinary (the receiver stopped; the next use reopens it):
        # a warning only when it failed requests in flight
        level = logging.WARNING if failed or self._waiters else logging.INFO
        log.log(level, "peer channel broke", extra={"peer": self.address, "reason": why, "failed": failed})

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _ask(self, key: tuple[str, int]) -> None:
        if key not in self._asked:
            self._asked.add(key)
            await self._write(
                peer_pb2.ChannelMessage(
                    credit_request=peer_pb2.CreditRequest(mem_kind=key[0], device_id=key[1])
                )
            )

    async def slot_size(self, key: tuple[str, int], deadline: float) -> int:
        """Bytes of the receiver's credit slots in that pool (asks for credits and waits for a
        grant with slots: the receiver grants as other channels give theirs back)."""
        while True:
            await self._ensure_open()
            epoch = self.epoch
            await self._ask(key)
            if self._slot_bytes.get(key):
                return self._slot_bytes[key]
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceeded("transfer deadline passed waiting for the receiver's credits")
            async with self._changed:
                try:
                    await asyncio.wait_for(self._changed.wait(), min(left, 0.5))
                except asyncio.TimeoutError:
                    pass
            if key in self._credits and not self._slot_bytes.get(key) and self.epoch == epoch:
                self._asked.discard(key)  # granted nothing yet: ask again

    async def acquire(self, mem_kind: str, device: int, deadline: float) -> tuple[peer_pb2.StagingSlot, int]:
        """A credit slot of the receiver's (mem_kind, device) pool and the channel epoch it is of;
        waits for one (credits return with acks) until ``deadline``."""
        key = (mem_kind, device)
        while True:
            await self._ensure_open()
            epoch = self.epoch
            await self._ask(key)
            queue = self._credits.get(key)
            if queue:
                return queue.popleft(), epoch
            left = deadline - time.monotonic()
            if left <= 0:
                if self._granted.get(key, 0) == 0 and key in self._credits:
                    raise ResourceExhausted(
                        f"peer {self.address} granted no staging slots (its pool is full)"
                    )
                raise DeadlineExceeded("transfer deadline passed waiting for a staging credit")
            self._waiters += 1
            try:
                async with self._changed:
                    try:
                        await asyncio.wait_for(self._changed.wait(), min(left, 0.5))
                    except asyncio.TimeoutError:
                        pass
            finally:
                self._waiters -= 1
            if key in self._credits and self._granted.get(key, 0) == 0 and self.epoch == epoch:
                self._asked.discard(key)  # granted nothing: ask again (room may have freed)

    async def _ask_reply(
        self, msg: peer_pb2.ChannelMessage, timeout: float, what: str
    ) -> peer_pb2.ChannelMessage:
        self._seq += 1
        msg.seq = seq = self._seq
        fut: asyncio.Future[peer_pb2.ChannelMessage] = asyncio.get_running_loop().create_future()
        self._pending[seq] = fut
        try:
            await self._write(msg)
            return await asyncio.wait_for(fut, max(timeout, 0.001))
        except asyncio.TimeoutError:
            raise DeadlineExceeded(f"peer {self.address} did not {what} in time") from None
        finally:
            self._pending.pop(seq, None)
            if fut.done() and not fut.cancelled():
                fut.exception()  # a break failed it: reported by the raise, not as "never retrieved"

    async def plans(self, req: peer_pb2.GetReceivePlanRequest, timeout: float) -> peer_pb2.ReceivePlanSet:
        """GetReceivePlan on the channel; raises the receiver's error."""
        await self._ensure_open()
        reply = await self._ask_reply(
            peer_pb2.ChannelMessage(plan_request=req), timeout, "answer a plan request"
        )
        if reply.WhichOneof("body") != "plan":
            raise error_from_code(reply.ack.error_code, f"peer {self.address}: {reply.ack.error}")
        return reply.plan

    def give_back(self, key: tuple[str, int], slot: peer_pb2.StagingSlot, epoch: int) -> None:
        """A credit is free again (its batch was acknowledged, or never committed)."""
        if epoch == self.epoch and self._call is not None:
            self._credits.setdefault(key, collections.deque()).append(slot)
            self._last_use = time.monotonic()
            loop = asyncio.get_event_loop()
            loop.create_task(self._notify())
            if self._idle_timer is None:
                self._idle_timer = loop.call_later(IDLE_RETURN_S, self._idle_check)

    def _idle_check(self) -> None:
        """Unused for IDLE_RETURN_S: give every credit back, so busier channels get the pool."""
        self._idle_timer = None
        if self._call is None:
            return
        idle = time.monotonic() - self._last_use
        if self._pending or self._waiters or idle < IDLE_RETURN_S:
            self._idle_timer = asyncio.get_event_loop().call_later(
                max(0.05, IDLE_RETURN_S - idle), self._idle_check
            )
            return
        ids = [sl.slot_id for q in self._credits.values() for sl in q]
        self._credits.clear()
        self._granted.clear()
        self._asked.clear()
        if ids:
            msg = peer_pb2.ChannelMessage(release=peer_pb2.CreditRelease(slot_ids=ids))
            asyncio.get_event_loop().create_task(self._write_quiet(msg))

    async def _write_quiet(self, msg: peer_pb2.ChannelMessage) -> None:
        try:
            await self._write(msg)
        except Unavailable:
            pass

    async def commit(
        self,
        req: peer_pb2.CommitChunkRequest,
        timeout: float,
        credit: tuple[tuple[str, int], peer_pb2.StagingSlot, int] | None = None,
    ) -> peer_pb2.ChannelAck:
        """Send a commit and wait for its ack; the credit it used comes back with the ack."""
        await self._ensure_open()
        if credit is not None and credit[2] != self.epoch:
            raise Unavailable(f"peer channel to {self.address} broke before the commit")
        ack = (
            await self._ask_reply(peer_pb2.ChannelMessage(commit=req), timeout, "acknowledge a commit")
        ).ack
        if credit is not None:
            if ack.credit_revoked:  # the receiver took the slot back for another channel
                self._granted[credit[0]] = self._granted.get(credit[0], 1) - 1
            else:
                self.give_back(*credit)
        return ack

    async def close(self) -> None:
        call, self._call = self._call, None
        if call is not None:
            call.cancel()
        if self._reader is not None:
            self._reader.cancel()
