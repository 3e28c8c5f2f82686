"""The wire contract, public: kvservice.v1's protobuf messages and gRPC stubs (``proto/`` at the
repository root), for the service and for clients that speak gRPC themselves.

The modules are generated into ``kvservice_client._proto`` (their own relative imports live
there); this package is the name to import them by::

    from kvservice_client.proto import kvservice_pb2, kvservice_pb2_grpc
"""

from .._proto import (
    common_pb2,
    common_pb2_grpc,
    kvservice_pb2,
    kvservice_pb2_grpc,
    peer_pb2,
    peer_pb2_grpc,
)

__all__ = [
    "common_pb2",
    "common_pb2_grpc",
    "kvservice_pb2",
    "kvservice_pb2_grpc",
    "peer_pb2",
    "peer_pb2_grpc",
]
