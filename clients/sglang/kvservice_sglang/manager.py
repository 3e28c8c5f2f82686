"""SGLang's ``BaseKVManager`` on kvservice: one a scheduler rank, owning its session.

At start it registers the rank's pools (``regions.register_kv_args``: KV, aux rows, state slots)
as its attention TP rank, and each of its layers again on its own, named by the model's layer
number (``layers``: the per-layer transfers of rooms where either instance runs pipeline
parallelism; a PP stage holds some layers). Every RPC of the rank's senders and receivers runs on
its :class:`BackgroundClient` thread. When the service forgets the session (it restarted), the first
transfer that meets ``SessionLost`` opens a new one, registers the same pools again and makes
its call again (:meth:`on_session`), so only the transfers in flight on the lost session fail.

What SGLang 0.5.23's decode scheduler asks of every manager beyond the base class: the prefill's
parallel info (``prefill_info_table``, ``try_ensure_parallel_info``): a room is found by its
number at the prefill's bootstrap server, whatever DP rank serves it, so every prefill looks like
one DP rank here; and ``clear_deferred_abort_state`` (this backend defers no release: an
acknowledged Abort lets no further byte land, so SGLang may free the pages at once).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any, NamedTuple, TypeVar

import numpy as np
from kvservice_client import BackgroundClient, SessionLost
from sglang.srt.disaggregation.base.conn import BaseKVManager, KVArgs

from .bootstrap import http_json
from .layers import LayerSets, register_layers, stage_layers
from .regions import register_kv_args
from .settings import Settings

__all__ = ["KVServiceManager", "PrefillService"]

log = logging.getLogger(__name__)
T = TypeVar("T")
_SENDER_TTL_S = 60.0  # how long a decode trusts a bootstrap server's answer to GET /service


def _attention_tp(args: KVArgs, server_args: Any) -> tuple[int, int]:
    """(attention TP size, this rank's attention TP rank). SGLang's own figure where its parallel
    state is published (the scheduler process: ``get_parallel().attn_tp_size`` in 0.5.x,
    ``get_attention_tp_size()`` before); else the server args' (``tp_size`` over ``dp_size`` under
    DP attention, over ``attn_cp_size``). The prefill's ``engine_rank`` is its TP rank, the
    decode's already its attention TP rank: modulo the size, both are the attention TP rank."""
    size = 0
    for module, read in (
        ("sglang.srt.runtime_context", lambda m: m.get_parallel().attn_tp_size),
        ("sglang.srt.layers.dp_attention", lambda m: m.get_attention_tp_size()),
    ):
        try:
            size = int(read(importlib.import_module(module)))
            break
        except (ImportError, AttributeError, AssertionError, RuntimeError, ValueError, TypeError):
            continue  # not this SGLang, or not published in this process
    if size <= 0:
        size = int(getattr(server_args, "tp_size", 1) or 1)
        if getattr(server_args, "enable_dp_attention", False):
            size //= int(getattr(server_args, "dp_size", 1) or 1)
        size //= int(getattr(server_args, "attn_cp_size", 1) or 1)
    size = max(1, size)
    return size, int(args.engine_rank) % size


class PrefillService(NamedTuple):
    """A prefill instance as its bootstrap server describes it (``GET /service``)."""

    peer: str  # its kvservice ("": none named): the decode's ExpectDelta sender_address
    pp_size: int  # its pipeline stages: > 1 (or a decode of PP > 1) makes rooms per layer


@dataclasses.dataclass(frozen=True)
class PrefillInfo:
    """What SGLang's decode reads of a prefill instance before it starts a receiver."""

    dp_size: int = 1
    follow_bootstrap_room: bool = True


class _EveryPrefill(Mapping[str, PrefillInfo]):
    """``prefill_info_table``: the same answer for every bootstrap address (one DP rank)."""

    _INFO = PrefillInfo()

    def __getitem__(self, key: str) -> PrefillInfo:
        return self._INFO

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def __contains__(self, key: object) -> bool:
        return True


class KVServiceManager(BaseKVManager):
    def __init__(
        self, args: KVArgs, disaggregation_mode: Any, server_args: Any, is_mla_backend: bool | None = False
    ) -> None:
        settings = Settings.from_env()
        self.attn_tp = _attention_tp(args, server_args)
        self.kv_args, self.mode = args, str(getattr(disaggregation_mode, "value", disaggregation_mode))
        self.address, self.peer_address = settings.address, settings.peer_address
        self.deadline_ms, self.bootstrap_timeout_s = settings.deadline_ms, settings.bootstrap_timeout_s
        self.prefill_info_table = _EveryPrefill()
        self.pp_size = max(1, int(getattr(server_args, "pp_size", 1) or 1))
        self.pp_rank = int(getattr(args, "pp_rank", 0) or 0) if self.pp_size > 1 else 0
        if self.pp_size > 1 and any(getattr(args, "state_data_ptrs", None) or ()):
            raise NotImplementedError(  # a stage's state slots cover its layers only
                f"kvservice_sglang: state buffers (a hybrid model) with pipeline parallel size "
                f"{self.pp_size} are not supported"
            )
        self.bg = BackgroundClient(self.address, client_name=f"sglang-{self.mode}-{args.engine_rank}")
        self._senders: dict[str, tuple[float, PrefillService]] = {}  # decode: bootstrap addr -> its prefill
        reg, self.buffer_set_id = register_kv_args(self.bg, args, bool(is_mla_backend), self.attn_tp)
        ids = stage_layers(args, reg.layout.num_layers, self.pp_size)
        self.layer_ids: tuple[int, ...] = tuple(ids)  # the model's layer number of each of ours
        # NOTE: one buffer set per layer serves rooms with a PP instance: a PP stage's every room,
        # so registered now; at PP 1 only a PP peer's rooms, so registered at the first of those
        self._layer_sets: LayerSets | None = None
        self._layer_lock = asyncio.Lock()
        if self.pp_size > 1:
            self._layer_sets = self.bg.call(register_layers(self.bg, reg, ids), 60 + len(ids))
        self.page_size, self.aux_names, self.state_names = int(args.page_size), reg.aux_names, reg.state_names
        self.landing_ttl_ms = self._landing_ttl_ms(settings.landing_ttl_ms, server_args)  # 0: off
        self._registration, self._lost, self._relock = reg, False, asyncio.Lock()
        log.info(
            "kvservice: %s rank %s (PP stage %d of %d, layers %s) registered %s",
            self.mode, args.engine_rank, self.pp_rank, self.pp_size, list(ids), self.buffer_set_id,
        )  # fmt: skip

    def reader_url(self, url: str, layers: bool = False) -> str:
        """``url`` (a room entry at the other instance's bootstrap server) as this rank reads it:
        the entry stays until each of this instance's ranks (attention TP x PP) has read it;
        ``layers``: found only once the decode stages that posted it hold all of this rank's."""
        size, rank = self.attn_tp
        ranks, rank = size * self.pp_size, self.pp_rank * size + rank
        query = [f"rank={rank}&ranks={ranks}"] if ranks > 1 else []
        if layers:
            query.append("layers=" + ",".join(str(i) for i in self.layer_ids))
        return f"{url}?{'&'.join(query)}" if query else url

    def _landing_ttl_ms(self, ttl: int, server_args: Any) -> int:
        """The landing option (decode only): how long landed pages wait for the allocation."""
        if not ttl or self.mode != "decode":
            return 0
        why = ""
        if self.pp_size > 1:
            why = f"pipeline parallel size {self.pp_size}: a stage's layers arrive one transfer each"
        elif any(self.state_names):  # NOTE: a landing counts its aux rows before any allocation
            why = "state buffers are registered (a hybrid model): their slots are known only at allocation"
        elif getattr(server_args, "disaggregation_decode_enable_radix_cache", False):
            why = "the decode radix cache is on: a landing holds every page, an allocation only its delta"
        if why:
            log.warning("kvservice: SGLANG_KVSERVICE_LANDING_TTL_MS ignored, %s", why)
            return 0
        return ttl

    async def prefill_service(self, bootstrap_addr: str) -> PrefillService:
        """The prefill behind ``bootstrap_addr`` as its bootstrap server describes it (``GET
        /service``, kept a minute): its kvservice (ExpectDelta's ``sender_address``; "" when it
        names none: the transfer then names no sender) and its PP size (1 unless it says). Not
        kept when the server cannot be reached."""
        now = time.monotonic()
        hit = self._senders.get(bootstrap_addr)
        if hit is not None and hit[0] > now:
            return hit[1]
        try:
            code, body = await asyncio.to_thread(http_json, "GET", f"http://{bootstrap_addr}/service")
        except (OSError, ValueError) as exc:
            log.info("kvservice: no prefill service from %s (%s); no sender named", bootstrap_addr, exc)
            return PrefillService("", 1)
        body = body if code == 200 and isinstance(body, dict) else {}
        peer, pp = body.get("peer"), body.get("pp_size", 1)
        found = PrefillService(
            peer if isinstance(peer, str) else "", pp if isinstance(pp, int) and pp > 0 else 1
        )
        self._senders[bootstrap_addr] = (now + _SENDER_TTL_S, found)
        return found

    def layerwise(self, prefill: PrefillService) -> bool:
        """Whether a room with ``prefill`` goes one transfer per layer: either side runs PP."""
        return self.pp_size > 1 or prefill.pp_size > 1

    async def on_session(
        self, call: Callable[[str], Awaitable[T]], first: bool = True, layer: int | None = None
    ) -> T:
        """``call(buffer_set_id)``, on a live registration: the whole-cache set, or the one-layer
        set of the model's ``layer``. The service forgot this session (it restarted,
        ``SessionLost``): on a transfer's ``first`` call (nothing of it was on the lost session)
        the pools are registered again on a new session and the call is made once more; while the
        service is down, that registration's error fails the call."""

        async def bs() -> str:
            return self.buffer_set_id if layer is None else (await self._layers()).of(layer)

        if first and self._lost:
            await self._register_again()
        try:
            return await call(await bs())
        except SessionLost as exc:
            self.note_failure(exc)
            if not first:
                raise
            await self._register_again()
            return await call(await bs())

    async def _layers(self) -> LayerSets:
        """The one-layer buffer sets, registered on first use (at PP 1: the first room with a PP
        instance; again after a lost session)."""
        async with self._layer_lock:
            if self._layer_sets is None:
                self._layer_sets = await register_layers(self.bg, self._registration, self.layer_ids)
            return self._layer_sets

    def note_failure(self, exc: BaseException) -> None:
        """A call failed with ``exc``: after ``SessionLost`` the next transfer registers again."""
        if isinstance(exc, SessionLost):
            self._lost = True

    async def _register_again(self) -> None:
        async with self._relock:
            if not self._lost:
                return  # another request did it
            await self.bg.kv.reopen_session(reregister=False)  # a new session at the next call
            reg = self._registration
            bs = await self.bg.kv.register_buffers(reg.layout, reg.k_regions, reg.v_regions, reg.aux)
            self._layer_sets = None  # registered again by the next call that needs them
            self.buffer_set_id, self._lost = bs.buffer_set_id, False
            log.warning("kvservice: %s session reopened; pools registered as %s", self.mode, bs.buffer_set_id)

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        return True  # nothing to fetch: the prefill's bootstrap server answers by room

    def clear_deferred_abort_state(self, room: int) -> None:
        return  # no deferred release: after an acknowledged Abort no byte lands

    def register_to_bootstrap(self) -> None:
        return  # nothing to announce: decode instances post each room to the prefill's server

    def aux_rows(self, aux_index: int | None) -> dict[str, list[int]]:
        return {} if aux_index is None else {n: [int(aux_index)] for n in self.aux_names}

    def state_rows(self, state_indices: Any) -> dict[str, list[int]]:
        """SGLang's per-state-type slot indices as the rows of every component of that type
        (both sides name theirs; the service copies row i to row i, checking counts and sizes)."""
        out: dict[str, list[int]] = {}
        for i, idx in enumerate(state_indices or ()):
            rows = [] if idx is None else [int(x) for x in np.asarray(idx).reshape(-1)]
            if not rows:
                continue
            if i >= len(self.state_names) or not self.state_names[i]:
                raise ValueError(f"state_indices[{i}]: this engine registered no state buffer {i}")
            out.update((name, rows) for name in self.state_names[i])
        return out

    def close(self) -> None:
        self.bg.close()
