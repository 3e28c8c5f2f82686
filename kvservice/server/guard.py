"""The front door of every listener: who may call what, and requests that do not decode.

One ``Guard`` (a grpc.aio server interceptor) per server. Before any servicer code runs:

* Calls over the Unix socket: the socket's file mode decides who reaches it; ``LocalGate``
  (server/local_gate.py) decides per call with the kernel's identity: ``allowed_uids`` for
  every engine call, KVPeer only for co-located kvservices (own uid or ``peer_uids``).
* Health checks pass everywhere (probes carry no credentials; they learn only SERVING or not).
* Over TCP, KVPeer calls need the listener to serve peers and, when a peer token file is set,
  one of its tokens (``kvservice-peer-token``); all other calls need the listener to serve
  engines and, when a token file is set, ``authorization: Bearer <token>``. Client
  certificates, when required, were checked by the TLS handshake before the call existed.
* A request over a per-call cap (server/limits.py) is answered INVALID_ARGUMENT naming it.
* A request that does not decode is answered INVALID_ARGUMENT naming the message type (gRPC
  itself would answer UNKNOWN, which reads as the service's fault).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import Message
from kvservice_client.contract import BEARER_METADATA_KEY, PEER_TOKEN_METADATA_KEY, TokenFile

from ..rpc_handlers import rewrap
from .errors import STATUS_ORIGIN_METADATA_KEY
from .limits import CallLimits
from .local_gate import LocalGate

__all__ = ["Guard", "ListenerPolicy"]

_HEALTH = "/grpc.health.v1.Health/"
_PEER = "/kvservice.v1.KVPeer/"


@dataclasses.dataclass(frozen=True)
class ListenerPolicy:
    """What TCP callers of one server must show (the Unix socket is gated by its file mode)."""

    engines_over_tcp: bool = True  # KVService (and reflection) on this server's TCP port
    peers_over_tcp: bool = True  # KVPeer on this server's TCP port
    token: TokenFile | None = None  # engine bearer tokens
    peer_token: TokenFile | None = None  # peer tokens
    listener: str = "tcp_address"  # named in refusals
    limits: CallLimits = CallLimits()  # per-call caps (every listener, the Unix socket too)
    local: LocalGate | None = None  # the Unix socket's per-call rule (None: the file mode only)


class _Undecodable:
    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


Refusal = tuple[grpc.StatusCode, str]


class Guard(grpc.aio.ServerInterceptor):
    def __init__(self, policy: ListenerPolicy) -> None:
        self.policy = policy

    def refusal(self, method: str, context: Any) -> Refusal | None:
        """Why this call may not run, or None."""
        if method.startswith(_HEALTH):
            return None
        pol = self.policy
        metadata = dict(context.invocation_metadata() or ())
        if context.peer().startswith("unix"):
            return pol.local.refusal(method, metadata) if pol.local is not None else None
        if method.startswith(_PEER):
            if not pol.peers_over_tcp:
                return (
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"KVPeer is not served on {pol.listener}; peers use peer_tcp_address",
                )
            if pol.peer_token is not None and not pol.peer_token.matches(
                metadata.get(PEER_TOKEN_METADATA_KEY)
            ):
                return (
                    grpc.StatusCode.UNAUTHENTICATED,
                    f"{PEER_TOKEN_METADATA_KEY}: a valid peer token is required",
                )
            return None
        if not pol.engines_over_tcp:
            return (
                grpc.StatusCode.PERMISSION_DENIED,
                f"{method.strip('/')} is not served on {pol.listener} (a peer-only listener)",
            )
        if pol.token is not None:
            scheme, _, token = str(metadata.get(BEARER_METADATA_KEY, "")).partition(" ")
            if scheme.lower() != "bearer" or not pol.token.matches(token.strip()):
                return (
                    grpc.StatusCode.UNAUTHENTICATED,
                    f"{BEARER_METADATA_KEY}: a valid bearer token is required",
                )
        return None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        method, type_name = details.method, _request_type(handler)
        return rewrap(
            handler,
            lambda fn: self._wrap(fn, method, handler.request_streaming, type_name),
            _tolerant(handler.request_deserializer),
        )

    def _wrap(
        self, fn: Callable[..., Any], method: str, streaming: bool, type_name: str
    ) -> Callable[..., Any]:
        async def admit(request: Any, context: Any) -> Any:
            refusal = self.refusal(method, context)
            if refusal is not None:
                await _refuse(context, *refusal)
            if streaming:
                return _checked_stream(request, context, type_name)
            if isinstance(request, _Undecodable):
                await _refuse(context, grpc.StatusCode.INVALID_ARGUMENT, _bad(type_name, request))
            if isinstance(request, Message):
                why = self.policy.limits.breach(request)
                if why:
                    await _refuse(context, grpc.StatusCode.INVALID_ARGUMENT, why)
            return request

        if inspect.isasyncgenfunction(fn):

            async def agen(request: Any, context: Any) -> AsyncIterator[Any]:
                async for item in fn(await admit(request, context), context):
                    yield item

            return agen

        if inspect.iscoroutinefunction(fn):

            async def coro(request: Any, context: Any) -> Any:
                return await fn(await admit(request, context), context)

            return coro

        async def other(request: Any, context: Any) -> Any:  # sync servicers (none of ours)
            result = fn(await admit(request, context), context)
            return await result if inspect.isawaitable(result) else result

        return other


def _request_type(handler: grpc.RpcMethodHandler) -> str:
    deser = handler.request_deserializer
    owner = getattr(deser, "__self__", None)
    descriptor = getattr(owner, "DESCRIPTOR", None)
    return getattr(descriptor, "full_name", "") or "request"


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def decode(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - any decode failure is the caller's
            return _Undecodable(str(exc) or type(exc).__name__)

    return decode


def _bad(type_name: str, item: _Undecodable) -> str:
    return f"request: not a valid {type_name} message ({item.error})"


async def _checked_stream(requests: Any, context: Any, type_name: str) -> AsyncIterator[Any]:
    async for item in requests:
        if isinstance(item, _Undecodable):
            await _refuse(context, grpc.StatusCode.INVALID_ARGUMENT, _bad(type_name, item))
        yield item


async def _refuse(context: Any, code: grpc.StatusCode, message: str) -> None:
    context.set_trailing_metadata(((STATUS_ORIGIN_METADATA_KEY, "service"),))
    await context.abort(code, message)
