"""A grpc.aio server interceptor that times every RPC by service and method.

Metrics (labels bounded by the services registered on the server):

- ``kvservice_rpc_duration_seconds{service,method}``: handling time of unary-response RPCs
  (server-streaming RPCs such as OpenSession or WatchTransfers live as long as their client,
  so their lifetime would only blur a latency histogram; they are counted, not timed).
- ``kvservice_rpc_handled_total{service,method,code}``: finished RPCs by gRPC status code.
- ``kvservice_rpc_in_progress{service,method}``: RPCs (and open streams) being handled.

The interceptor wraps the method handler's behaviour; it never changes requests, responses
or statuses, and it supports async and sync behaviours of all four cardinalities.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..rpc_handlers import rewrap
from ._buckets import LATENCY_BUCKETS

__all__ = ["RpcMetricsInterceptor"]


def _split(full_method: str) -> tuple[str, str]:
    """'/kvservice.v1.KVService/MatchPrefix' -> ('KVService', 'MatchPrefix')."""
    service, _, method = full_method.lstrip("/").rpartition("/")
    return service.rpartition(".")[2] or "unknown", method or "unknown"


def _code(context: Any, exc: BaseException | None) -> str:
    """The status the client sees: the context's code when one was set (abort, set_code)."""
    try:
        code = context.code()
    except Exception:
        code = None
    if isinstance(code, grpc.StatusCode) and (exc is None or code != grpc.StatusCode.OK):
        return str(code.name)
    if exc is None:
        return "OK"
    return "UNKNOWN" if isinstance(exc, Exception) else "CANCELLED"


class RpcMetricsInterceptor(grpc.aio.ServerInterceptor):
    """Times handlers; create one per server with that server's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.duration = Histogram(
            "kvservice_rpc_duration_seconds",
            "Handling time of unary-response RPCs.",
            ("service", "method"),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.handled = Counter(
            "kvservice_rpc_handled",
            "RPCs finished, by status code.",
            ("service", "method", "code"),
            registry=registry,
        )
        self.in_progress = Gauge(
            "kvservice_rpc_in_progress",
            "RPCs and streams being handled.",
            ("service", "method"),
            registry=registry,
        )

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        labels = _split(handler_call_details.method)
        timed = not handler.response_streaming
        return rewrap(handler, lambda fn: self._wrap(fn, labels, timed))

    def _done(
        self, labels: tuple[str, str], t0: float, timed: bool, context: Any, exc: BaseException | None
    ) -> None:
        if timed:
            self.duration.labels(*labels).observe(time.perf_counter() - t0)
        self.handled.labels(*labels, _code(context, exc)).inc()
        self.in_progress.labels(*labels).dec()

    def _wrap(self, fn: Callable[..., Any], labels: tuple[str, str], timed: bool) -> Callable[..., Any]:
        done = self._done
        gauge = self.in_progress.labels(*labels)

        if inspect.isasyncgenfunction(fn):

            async def agen(request: Any, context: Any) -> AsyncIterator[Any]:
                t0, err = time.perf_counter(), None
                gauge.inc()
                try:
                    async for item in fn(request, context):
                        yield item
                except BaseException as exc:
                    err = exc
                    raise
                finally:
                    done(labels, t0, timed, context, err)

            return agen

        if inspect.iscoroutinefunction(fn):

            async def coro(request: Any, context: Any) -> Any:
                t0, err = time.perf_counter(), None
                gauge.inc()
                try:
                    return await fn(request, context)
                except BaseException as exc:
                    err = exc
                    raise
                finally:
                    done(labels, t0, timed, context, err)

            return coro

        if inspect.isgeneratorfunction(fn):

            def gen(request: Any, context: Any) -> Iterator[Any]:
                t0, err = time.perf_counter(), None
                gauge.inc()
                try:
                    yield from fn(request, context)
                except BaseException as exc:
                    err = exc
                    raise
                finally:
                    done(labels, t0, timed, context, err)

            return gen

        def sync(request: Any, context: Any) -> Any:
            t0, err = time.perf_counter(), None
            gauge.inc()
            try:
                return fn(request, context)
            except BaseException as exc:
                err = exc
                raise
            finally:
                done(labels, t0, timed, context, err)

        return sync
