"""One exception tree for the whole service.

Every error the service raises on purpose is a :class:`KVServiceError`; each class carries the
gRPC status code it is reported with, so the server boundary maps errors in one place
(``server/errors.py``) and a caller's mistake never surfaces as ``UNKNOWN`` or ``INTERNAL``::

    KVServiceError                      INTERNAL (only for our own bugs)
    ├── InvalidArgument                 INVALID_ARGUMENT   a field is malformed; names it
    ├── NotFound                        NOT_FOUND          unknown buffer set / transfer / lease
    ├── AlreadyExists                   ALREADY_EXISTS     transfer id declared twice
    ├── PermissionDenied                PERMISSION_DENIED  resource owned by another session
    ├── Unauthenticated                 UNAUTHENTICATED    no or unknown session
    ├── FailedPrecondition              FAILED_PRECONDITION layout mismatch, wrong state
    ├── ResourceExhausted               RESOURCE_EXHAUSTED staging full past the deadline
    ├── DeadlineExceeded                DEADLINE_EXCEEDED  transfer or wait out of time
    ├── Aborted                         ABORTED            transfer aborted
    ├── Unavailable                     UNAVAILABLE        peer unreachable, shutting down
    ├── Unimplemented                   UNIMPLEMENTED      feature not built / not available here
    └── TransportError                  UNAVAILABLE        NIXL / UCX failure, mapped at the boundary

Lower layers (OS, CUDA, NIXL) raise their own exceptions; the module that calls them translates
them into this tree (see ``translate_os_error``).
"""

from __future__ import annotations

import errno

import grpc

__all__ = [
    "AlreadyExists",
    "Aborted",
    "DeadlineExceeded",
    "FailedPrecondition",
    "InvalidArgument",
    "KVServiceError",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "TransportError",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "translate_os_error",
]


class KVServiceError(Exception):
    """Base of every deliberate error; ``code`` is the gRPC status it maps to."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(KVServiceError):
    """A request field is malformed. The message names the field and the reason."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class NotFound(KVServiceError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(KVServiceError):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(KVServiceError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Unauthenticated(KVServiceError):
    code = grpc.StatusCode.UNAUTHENTICATED


class FailedPrecondition(KVServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(KVServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceeded(KVServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Aborted(KVServiceError):
    code = grpc.StatusCode.ABORTED


class Unavailable(KVServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class Unimplemented(KVServiceError):
    code = grpc.StatusCode.UNIMPLEMENTED


class TransportError(Unavailable):
    """The data transport (NIXL/UCX) failed; raised by ``transfer/`` after translating."""


def translate_os_error(field: str, exc: OSError) -> KVServiceError:
    """Map an OS error met while importing caller-named memory to the tree.

    The caller named the memory, so a missing or inaccessible object is the caller's mistake
    (INVALID_ARGUMENT naming ``field``), not a server fault.
    """
    if exc.errno in (errno.ENOENT, errno.EACCES, errno.EPERM, errno.EINVAL, errno.ENAMETOOLONG):
        return InvalidArgument(field, f"{exc.strerror or exc}")
    if exc.errno in (errno.ENOMEM, errno.EMFILE, errno.ENFILE, errno.ENOSPC):
        return ResourceExhausted(f"{field}: {exc.strerror or exc}")
    return InvalidArgument(field, f"cannot map memory: {exc}")
