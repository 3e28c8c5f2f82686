"""Registered buffer sets: imported regions, their layout and their owning session.

Hooks let other parts of the service follow registrations without this module knowing them:
the index adds/drops a buffer set, the transport registers/deregisters memory (NIXL).
A registration that fails part-way (bad region, a hook raising) is rolled back whole.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import secrets
import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvservice_client import Layout

from ..errors import InvalidArgument, NotFound, PermissionDenied
from . import guard
from .layout import validate_layout, validate_region_sizes
from .memory import MappedRegion, MemoryImporter

__all__ = ["AuxBuffer", "BufferRegistry", "BufferSet"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class AuxBuffer:
    name: str
    region: MappedRegion
    row_bytes: int
    num_rows: int


@dataclasses.dataclass(frozen=True)
class BufferSet:
    """One engine rank's registered KV pool. ``k``: per layer (MHA K or MLA latent); ``v``: MHA V."""

    buffer_set_id: str
    session_id: str
    engine_id: str
    layout: Layout
    k: tuple[MappedRegion, ...]
    v: tuple[MappedRegion, ...]
    aux: tuple[AuxBuffer, ...]

    @property
    def regions(self) -> tuple[MappedRegion, ...]:
        """KV regions in wire order: K (or latent) of every layer, then V of every layer."""
        return self.k + self.v

    @property
    def memory(self) -> str:
        return "cuda_ipc" if self.k and self.k[0].mem_kind == "VRAM" else "shm"

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over all KV regions (every layer, K and V)."""
        return sum(r.size for r in self.regions) // max(self.layout.num_pages, 1)

    @property
    def total_bytes(self) -> int:
        return sum(r.size for r in self.regions) + sum(a.region.size for a in self.aux)

    def lost(self) -> str:
        """Why this buffer set's memory can no longer be trusted (its owner shrank a segment
        under the service: guard.py), or '' while it is whole. One load while nothing faulted."""
        regions = itertools.chain(self.k, self.v, (a.region for a in self.aux))  # read only after a fault
        return guard.lost(self.buffer_set_id, (r.guard_slot for r in regions))

    def aux_by_name(self, name: str) -> AuxBuffer | None:
        return next((a for a in self.aux if a.name == name), None)


Hook = Callable[[BufferSet], Any]


class BufferRegistry:
    """Thread-safe registry; ``add_hooks(on_register, on_unregister)`` to follow it."""

    def __init__(self, importer: MemoryImporter | None = None) -> None:
        self.importer = importer or MemoryImporter()
        self._lock = threading.Lock()
        self._sets: dict[str, BufferSet] = {}
        self._hooks: list[tuple[Hook, Hook]] = []

    def add_hooks(self, on_register: Hook, on_unregister: Hook) -> None:
        self._hooks.append((on_register, on_unregister))

    def register(
        self,
        session_id: str,
        engine_id: str,
        layout: Layout,
        k_regions: Sequence[Any],
        v_regions: Sequence[Any],
        aux_regions: Sequence[Any],
        owner_uid: int | None = None,
    ) -> BufferSet:
        """Validate, import and announce a buffer set; on any error nothing stays behind.

        With ``owner_uid``, shared memory is imported only if that uid owns the segment.
        """
        validate_layout(layout)
        validate_region_sizes(layout, [r.size_bytes for r in k_regions], [r.size_bytes for r in v_regions])
        _validate_aux(aux_regions)
        mapped: list[MappedRegion] = []
        try:
            for name, regions in (("k_regions", k_regions), ("v_regions", v_regions)):
                for i, r in enumerate(regions):
                    mapped.append(self.importer.import_region(f"{name}[{i}]", r, owner_uid))
            aux = []
            for i, a in enumerate(aux_regions):
                region = self.importer.import_region(f"aux_regions[{i}].region", a.region, owner_uid)
                mapped.append(region)
                aux.append(AuxBuffer(a.name, region, a.row_bytes, a.num_rows))
            kinds = {m.mem_kind for m in mapped[: len(k_regions) + len(v_regions)]}
            if len(kinds) > 1:
                raise InvalidArgument("v_regions", "all KV regions must live in the same kind of memory")
            n = layout.num_layers
            bs = BufferSet(
                buffer_set_id="bs-" + secrets.token_hex(8),
                session_id=session_id,
                engine_id=engine_id[:128],
                layout=layout,
                k=tuple(mapped[:n]),
                v=tuple(mapped[n : n + len(v_regions)]),
                aux=tuple(aux),
            )
            done: list[Hook] = []
            try:
                for on_register, on_unregister in self._hooks:
                    on_register(bs)
                    done.append(on_unregister)
            except BaseException:
                for undo in reversed(done):
                    undo(bs)
                raise
        except BaseException:
            for m in mapped:
                self.importer.release(m)
            raise
        with self._lock:
            self._sets[bs.buffer_set_id] = bs
        log.info(
            "buffer set registered",
            extra={
                "buffer_set_id": bs.buffer_set_id,
                "engine_id": bs.engine_id,
                "session_id": session_id,
                "layout": _describe(bs.layout),
            },
        )
        return bs

    def get(
        self, buffer_set_id: str, session_id: str | None = None, field: str = "buffer_set_id"
    ) -> BufferSet:
        """The buffer set; with ``session_id``, only if that session owns it."""
        with self._lock:
            bs = self._sets.get(buffer_set_id)
        if bs is None:
            if not buffer_set_id:
                raise InvalidArgument(field, "is required")
            raise NotFound(f"{field}: no buffer set {buffer_set_id!r} on this service")
        if session_id is not None and bs.session_id != session_id:
            raise PermissionDenied(
                f"{field}: buffer set {buffer_set_id!r} belongs to another client's session"
            )
        return bs

    def unregister(self, buffer_set_id: str, session_id: str | None) -> BufferSet:
        """Remove the buffer set (owner only when ``session_id`` is given) and release its memory."""
        bs = self.get(buffer_set_id, session_id)
        with self._lock:
            if self._sets.pop(buffer_set_id, None) is None:
                raise NotFound(f"buffer_set_id: {buffer_set_id!r} was unregistered concurrently")
        for _, on_unregister in reversed(self._hooks):
            try:
                on_unregister(bs)
            except Exception:
                log.exception("unregister hook failed", extra={"buffer_set_id": buffer_set_id})
        for m in bs.k + bs.v + tuple(a.region for a in bs.aux):
            self.importer.release(m)
        log.info("buffer set unregistered", extra={"buffer_set_id": buffer_set_id})
        return bs

    def release_session(self, session_id: str) -> list[BufferSet]:
        """Unregister every buffer set the session owns."""
        with self._lock:
            owned = [b.buffer_set_id for b in self._sets.values() if b.session_id == session_id]
        return [self.unregister(b, None) for b in owned]

    def owned_by(self, session_id: str) -> int:
        with self._lock:
            return sum(1 for b in self._sets.values() if b.session_id == session_id)

    def all(self) -> list[BufferSet]:
        with self._lock:
            return list(self._sets.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._sets)


def _validate_aux(aux_regions: Sequence[Any]) -> None:
    names: set[str] = set()
    for i, a in enumerate(aux_regions):
        if not a.name:
            raise InvalidArgument(f"aux_regions[{i}].name", "is required")
        if a.name in names:
            raise InvalidArgument(f"aux_regions[{i}].name", f"duplicate name {a.name!r}")
        names.add(a.name)
        if a.row_bytes == 0 or a.num_rows == 0:
            raise InvalidArgument(f"aux_regions[{i}].row_bytes", "row_bytes and num_rows must be > 0")
        if a.region.WhichOneof("memory") == "cuda_ipc":
            # NOTE: aux rows move as NIXL descriptors of the region itself, and UCX refuses memory
            # this process imported through CUDA IPC ("VRAM memory is detected as host"): the
            # registration would fail deep in the backend naming nothing. KV pools in VRAM move
            # through staging instead; aux rows do not yet.
            raise InvalidArgument(
                f"aux_regions[{i}].region",
                "aux rows must be in host memory (shm): rows in GPU memory cannot be registered with "
                "the transport, which moves them without staging; keep the metadata rows in a host "
                "buffer (the KV pools may stay on the GPU)",
            )
        if a.region.size_bytes != a.row_bytes * a.num_rows:
            raise InvalidArgument(
                f"aux_regions[{i}].region.size_bytes",
                f"must be row_bytes x num_rows = {a.row_bytes * a.num_rows}, got {a.region.size_bytes}",
            )


def _describe(lay: Layout) -> str:
    order = lay.page_layout if lay.kind == "mha" else "latent"
    return (
        f"{lay.kind} {order}, {lay.num_layers} layers x {lay.num_pages} pages of {lay.page_size}, "
        f"{lay.local_kv_heads}/{lay.total_kv_heads} heads x {lay.head_dim_k}, {lay.dtype}, "
        f"tp {lay.tp_rank}/{lay.tp_size}"
    )
