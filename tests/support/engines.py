"""Engine processes in tests: each owns a shm KV pool, registers it with its service and runs
the client calls the test sends it (results and errors come back as data)."""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
from typing import Any

from google.protobuf.json_format import MessageToDict
from kvservice_client import Client, Layout, ShmKVPool

from tests.support.pools import fill_random

__all__ = ["EngineError", "EngineProc"]


def _engine_main(conn: Any, address: str, layout: Layout, aux: dict[str, tuple[int, int]], seed: int) -> None:
    """An engine: owns a shm KV pool, registers it, runs client calls the test sends it."""
    pool = ShmKVPool.create(layout, aux=aux)
    try:
        fill_random(pool, seed)
        with Client(address, client_name="e2e-engine", timeout=15) as kv:
            reg = kv.register_buffers(layout, pool.k_regions, pool.v_regions, pool.aux_specs)
            conn.send((reg.buffer_set_id, pool.name))
            while True:
                msg = conn.recv()
                if msg is None:
                    break
                method, args, kwargs = msg
                try:
                    res = getattr(kv, method)(*args, **kwargs)
                    if hasattr(res, "DESCRIPTOR"):  # protobuf replies travel as dicts
                        res = MessageToDict(res, preserving_proto_field_name=True)
                    conn.send(("ok", res))
                except Exception as exc:  # handed back to the test as data
                    conn.send(("err", type(exc).__name__, str(exc)))
    finally:
        pool.close()
        conn.close()


class _Mapped:
    """An engine's shm object mapped by path: unlike SharedMemory, never seen by the resource
    tracker (which the spawned engines share with us and would otherwise double-unregister)."""

    def __init__(self, name: str) -> None:
        fd = os.open(f"/dev/shm/{name.lstrip('/')}", os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self.buf = memoryview(self._mm)
        self.name = name

    def close(self) -> None:
        try:
            self.buf.release()
            self._mm.close()
        except BufferError:  # a view is still alive; the mapping goes with the process
            pass


class EngineError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


class EngineProc:
    """Handle on an engine process; ``pool`` is the test's own mapping of its KV pool."""

    def __init__(
        self, address: str, layout: Layout, aux: dict[str, tuple[int, int]] | None = None, seed: int = 0
    ) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.layout = layout
        self.aux = aux or {}
        self.proc = ctx.Process(
            target=_engine_main, args=(child, address, layout, self.aux, seed), daemon=True
        )
        self.proc.start()
        child.close()
        self.pool: ShmKVPool | None = None
        self.bs = ""

    def ready(self, timeout: float = 30.0) -> EngineProc:
        if not self._conn.poll(timeout):
            raise RuntimeError("engine process did not register in time")
        self.bs, name = self._conn.recv()
        self.pool = ShmKVPool(self.layout, _Mapped(name), self.aux, owner=False)  # type: ignore[arg-type]
        return self

    def call(self, method: str, *args: Any, timeout: float = 30.0, **kwargs: Any) -> Any:
        self._conn.send((method, args, kwargs))
        if not self._conn.poll(timeout):
            raise RuntimeError(f"engine call {method} hung")
        r = self._conn.recv()
        if r[0] == "err":
            raise EngineError(r[1], r[2])
        return r[1]

    def stop(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        try:
            self._conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
