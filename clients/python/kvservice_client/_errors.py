"""Client-side exception tree, mapped from gRPC status codes at one boundary (``map_rpc_error``).

KVClientError
├── InvalidArgument        INVALID_ARGUMENT
├── NotFound               NOT_FOUND
├── AlreadyExists          ALREADY_EXISTS
├── PermissionDenied       PERMISSION_DENIED
├── Unauthenticated        UNAUTHENTICATED
├── FailedPrecondition     FAILED_PRECONDITION
├── ResourceExhausted      RESOURCE_EXHAUSTED
├── DeadlineExceeded       DEADLINE_EXCEEDED
├── Aborted                ABORTED
├── Unavailable            UNAVAILABLE
│   └── SessionLost        the service released this client's session (names what was lost)
├── Unimplemented          UNIMPLEMENTED
└── ServerError            INTERNAL, UNKNOWN, DATA_LOSS, anything else
"""

from __future__ import annotations

import grpc

__all__ = [
    "Aborted",
    "AlreadyExists",
    "DeadlineExceeded",
    "FailedPrecondition",
    "InvalidArgument",
    "KVClientError",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "ServerError",
    "SessionLost",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "map_rpc_error",
]


class KVClientError(Exception):
    """Base of every error the client raises; ``code`` is the gRPC status."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class InvalidArgument(KVClientError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(KVClientError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(KVClientError):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(KVClientError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Unauthenticated(KVClientError):
    code = grpc.StatusCode.UNAUTHENTICATED


class FailedPrecondition(KVClientError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(KVClientError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceeded(KVClientError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Aborted(KVClientError):
    code = grpc.StatusCode.ABORTED


class Unavailable(KVClientError):
    code = grpc.StatusCode.UNAVAILABLE


class SessionLost(Unavailable):
    """The session is gone: its stream broke and was not resumed within the service's grace period
    (or the service released it). Everything it owned on the service is released; the ids below
    are what this client had created in it. ``Client.reopen_session(reregister=True)`` opens a new
    session and registers again the buffer sets whose regions the client still holds.
    """

    def __init__(
        self,
        session_id: str,
        reason: str,
        buffer_set_ids: tuple[str, ...] = (),
        lease_ids: tuple[str, ...] = (),
        transfer_ids: tuple[str, ...] = (),
    ) -> None:
        self.session_id = session_id
        self.reason = reason
        self.buffer_set_ids = buffer_set_ids
        self.lease_ids = lease_ids
        self.transfer_ids = transfer_ids
        super().__init__(
            f"session {session_id} lost ({reason}); released with it: buffer sets {list(buffer_set_ids)}, "
            f"leases {list(lease_ids)}, unfinished transfers {list(transfer_ids)}"
        )


class Unimplemented(KVClientError):
    code = grpc.StatusCode.UNIMPLEMENTED


class ServerError(KVClientError):
    """The server failed (INTERNAL, UNKNOWN, DATA_LOSS): a bug to report, not a caller mistake."""


_BY_CODE: dict[grpc.StatusCode, type[KVClientError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        PermissionDenied,
        Unauthenticated,
        FailedPrecondition,
        ResourceExhausted,
        DeadlineExceeded,
        Aborted,
        Unavailable,
        Unimplemented,
    )
}


def map_rpc_error(exc: grpc.RpcError) -> KVClientError:
    """Translate a grpc error (sync or aio) into the client tree."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    cls = _BY_CODE.get(code, ServerError)
    return cls(details or code.name, code)
