"""The asyncio twin of :class:`kvservice_client._session.SessionKeeper` (same states, same rules):
the session stream is held by a task, resumed after a break until the grace deadline, and
reported lost with :class:`SessionLost` naming what the client had created in it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from ._errors import KVClientError, NotFound, SessionLost, Unavailable, map_rpc_error
from ._proto import kvservice_pb2 as pb
from ._session import BACKOFF_S, CREDENTIAL_METADATA_KEY, GRACE_MARGIN_S, Owned, fetch_credential

__all__ = ["AsyncSessionKeeper"]

log = logging.getLogger("kvservice_client")


class AsyncSessionKeeper:
    """Holds the session stream on a task (asyncio client)."""

    def __init__(
        self,
        stub: Any,
        client_name: str,
        target: str,
        owned: Owned,
        on_lost: Callable[[SessionLost], Any] | None = None,
        credential_path: str | None = None,
    ) -> None:
        self._credential_path = credential_path
        self._stub = stub
        self._client_name = client_name
        self._target = target
        self._owned = owned
        self._on_lost = on_lost
        # Told of every later event on the stream (P/D duplicate notices), on the event loop.
        self.listeners: list[Callable[[Any], None]] = []
        self._changed = asyncio.Condition()
        self._state = "idle"
        self._error: KVClientError | None = None
        self._call: Any = None
        self._task: asyncio.Task[None] | None = None
        self.session_id = ""
        self.grace_s = 0.0
        self.peer_address = ""  # the service as other kvservices reach it ("" from older services)
        self.resumes = 0

    async def current(self, timeout: float) -> str:
        """The session id: opens the session on first use, waits out a resume, raises if lost."""
        async with self._changed:
            if self._state in ("idle", "failed"):
                self._state, self._error = "opening", None
                deadline = time.monotonic() + timeout
                self._task = asyncio.get_running_loop().create_task(self._run(deadline))
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self._state not in ("opening", "resuming")), timeout
                )
            except asyncio.TimeoutError:
                msg = f"no session from {self._target} within {timeout}s ({self._state})"
                raise Unavailable(msg) from None
            if self._state == "ready":
                return self.session_id
            assert self._error is not None
            raise self._error

    def peek(self) -> str:
        """The session id if the session is open now, else '' (never opens one)."""
        return self.session_id if self._state == "ready" else ""

    async def mark_lost(self, reason: str) -> SessionLost:
        async with self._changed:
            if self._state == "lost" and isinstance(self._error, SessionLost):
                return self._error
            self._cancel()
            return self._lose(reason)

    async def reset(self) -> None:
        async with self._changed:
            self._cancel()
            self._state, self._error, self.session_id = "idle", None, ""

    async def close(self, close_rpc: Callable[[str], Awaitable[None]]) -> None:
        async with self._changed:
            ready, sid = self._state == "ready", self.session_id
            self._state, self._error = "closed", Unavailable("the client is closed")
            self._changed.notify_all()
        if ready:
            try:
                await close_rpc(sid)
            except KVClientError:
                pass  # the stream's end releases it after the grace period anyway
        async with self._changed:
            self._cancel()
        if self._task is not None:
            self._task.cancel()

    # -- the task --------------------------------------------------------------------------
    async def _run(self, deadline: float) -> None:
        try:
            call = await self._open("", deadline)
        except KVClientError as exc:
            async with self._changed:
                if self._state == "opening":
                    self._state, self._error = "failed", exc
                    self._changed.notify_all()
            return
        while call is not None:
            try:
                while (event := await call.read()) is not grpc.aio.EOF:
                    for listener in list(self.listeners):
                        try:
                            listener(event)
                        except Exception:  # a listener's bug must not end the session
                            log.exception("session event listener failed")
            except (grpc.RpcError, asyncio.CancelledError):
                if self._state == "closed":
                    return
            call = await self._resume(call)

    async def _open(self, resume_id: str, deadline: float) -> Any:
        req = pb.OpenSessionRequest(client_name=self._client_name, resume_session_id=resume_id)
        cred = "" if resume_id else await asyncio.to_thread(fetch_credential, self._credential_path)
        metadata = ((CREDENTIAL_METADATA_KEY, cred),) if cred else ()
        call = self._stub.OpenSession(req, wait_for_ready=True, metadata=metadata)  # see SessionKeeper._open
        async with self._changed:
            if self._state == "closed":
                call.cancel()
                raise Unavailable("the client is closed")
            self._call = call
        try:
            first = await asyncio.wait_for(call.read(), max(deadline - time.monotonic(), 0.001))
        except asyncio.TimeoutError:
            call.cancel()
            raise Unavailable(f"{self._target} did not answer in time") from None
        except grpc.RpcError as exc:
            raise map_rpc_error(exc) from None
        if first is grpc.aio.EOF:
            raise Unavailable("session stream ended before it started")
        async with self._changed:
            if self._state == "closed":
                call.cancel()
                raise Unavailable("the client is closed")
            self.session_id, self.grace_s = first.session_id, first.grace_ms / 1000
            self.peer_address = first.peer_address
            if first.resumed:
                self.resumes += 1
            self._state = "ready"
            self._changed.notify_all()
        return call

    async def _resume(self, broken: Any) -> Any:
        async with self._changed:
            if self._state != "ready" or self._call is not broken:
                return None
            self._state = "resuming"
            sid = self.session_id
        log.warning("kvservice session stream broke; resuming", extra={"session_id": sid})
        deadline = time.monotonic() + self.grace_s + GRACE_MARGIN_S
        pause, last = BACKOFF_S[0], "no attempt"
        while time.monotonic() < deadline:
            try:
                call = await self._open(sid, deadline)
                log.info("kvservice session resumed", extra={"session_id": sid})
                return call
            except NotFound as exc:
                last = exc.message
                break
            except KVClientError as exc:
                last = exc.message
                if self._state == "closed":
                    return None
            await asyncio.sleep(min(pause, max(deadline - time.monotonic(), 0)))
            pause = min(pause * 2, BACKOFF_S[1])
        async with self._changed:
            if self._state == "resuming":
                self._lose(f"not resumed within the {self.grace_s:g}s grace period: {last}")
        return None

    def _lose(self, reason: str) -> SessionLost:
        err = self._owned.lost(self.session_id, reason)
        self._state, self._error = "lost", err
        self._changed.notify_all()
        log.error("kvservice session lost", extra={"session_id": self.session_id, "reason": reason})
        if self._on_lost is not None:
            result = self._on_lost(err)
            if asyncio.iscoroutine(result):
                asyncio.get_running_loop().create_task(result)
        return err

    def _cancel(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None
