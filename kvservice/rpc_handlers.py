"""Rewrapping a gRPC method handler's behaviour (the server interceptors' shared step)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

__all__ = ["rewrap"]

_FACTORIES = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


def rewrap(
    handler: grpc.RpcMethodHandler,
    wrap: Callable[[Callable[..., Any]], Callable[..., Any]],
    request_deserializer: Callable[[bytes], Any] | None = None,
) -> grpc.RpcMethodHandler:
    """The same handler with ``wrap(behaviour)`` as its behaviour (and, if given, another
    request deserializer); any of the four cardinalities."""
    for kind, factory in _FACTORIES.items():
        behaviour = getattr(handler, kind, None)
        if behaviour is not None:
            return factory(
                wrap(behaviour),
                request_deserializer=request_deserializer or handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
    return handler
