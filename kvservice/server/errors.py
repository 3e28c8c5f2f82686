"""The one boundary where domain errors become gRPC statuses."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from ..errors import KVServiceError

__all__ = ["STATUS_ORIGIN_METADATA_KEY", "grpc_errors"]

STATUS_ORIGIN_METADATA_KEY = "kvservice-status-origin"

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, method: str, request: Any) -> None:
    # NOTE: tells a client this status is the service's answer, not a broken connection's (which
    # it may retry: server/replay.py)
    context.set_trailing_metadata(((STATUS_ORIGIN_METADATA_KEY, "service"),))
    if isinstance(exc, KVServiceError):
        await context.abort(exc.code, exc.message)
    # NOTE: lines about a transfer carry its transfer_id (requests that name one have the field)
    extra = {"transfer_id": request.transfer_id} if getattr(request, "transfer_id", "") else {}
    log.exception("unhandled error in %s", method, exc_info=exc, extra=extra)
    await context.abort(
        grpc.StatusCode.INTERNAL, f"{method}: internal error ({type(exc).__name__}); see server log"
    )


def grpc_errors(fn: F) -> F:
    """Wrap a servicer method (unary or server-streaming) so errors map to statuses."""
    name = fn.__name__
    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def stream(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                async for item in fn(self, request, context):
                    yield item
            except (grpc.aio.AbortError, GeneratorExit):
                raise
            except Exception as exc:
                await _abort(context, exc, name, request)

        return stream  # type: ignore[return-value]

    @functools.wraps(fn)
    async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await fn(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, exc, name, request)

    return unary  # type: ignore[return-value]
