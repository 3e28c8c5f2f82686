"""Synchronous client: the blocking face over the SDK's core (``_calls``, ``_landing``; see
``_steps``). Every method maps grpc errors to the client exception tree.

The client opens an ownership session on first use (a server stream held by a background
thread): buffer sets, leases and transfers it creates belong to that session and are released
by the service when the client closes or its process dies.
"""

from __future__ import annotations

import threading
from typing import Any

from . import _requests as rq
from ._calls import Connecting
from ._errors import Unimplemented
from ._keepalive import DEFAULT_KEEPALIVE, KeepalivePolicy
from ._landing import LandingCalls
from ._proto import kvservice_pb2_grpc
from ._session import SessionKeeper
from ._steps import SyncFace
from ._transfer_stream import TransferStream

__all__ = ["Client", "channel_options", "message_size_options"]


def message_size_options(max_message_mb: int = 64) -> list[tuple[str, Any]]:
    size = max_message_mb * 1024 * 1024
    return [("grpc.max_send_message_length", size), ("grpc.max_receive_message_length", size)]


def channel_options(
    max_message_mb: int = 64, keepalive: KeepalivePolicy = DEFAULT_KEEPALIVE
) -> list[tuple[str, Any]]:
    """Channel arguments of SDK clients (and of peer clients between services)."""
    return message_size_options(max_message_mb) + keepalive.client_options()


class Client(SyncFace, LandingCalls):
    """Blocking client for one kvservice (``target``: "unix:/path" or "host:port").

    ``on_session_lost`` (optional) is called on a background thread with the
    :class:`SessionLost` when the session could not be resumed; owned calls raise it too.
    ``credential_path``: the service's credential socket, from which the client proves its local
    identity (needed to register memory); default ``<socket>.cred`` for "unix:" targets, none for
    TCP targets (pass it to register over TCP on the same host; "" turns it off).
    ``security``: TLS files and/or a bearer token file for a TCP service that requires them
    (:class:`ChannelSecurity`); Unix-socket targets need none.
    ``transfer_stream``: make ExpectDelta / SendDelta / Abort on the session's Transfers stream
    (one held stream; ended transfers arrive on it, so :meth:`wait` opens no watch). False, or
    a service without that RPC: unary calls and a watch per wait.
    ``lane_spin_us``: how long a thread waiting for the lane's answer polls before it sleeps
    (None: ``KVSERVICE_LANE_SPIN_US``, else what the service advises: its ``lane_wait_spin_us``,
    5 ms on a GPU lane by default); each try releases the GIL.
    """

    def _connect(self, how: Connecting) -> None:
        self._channel = how.security.channel(self.target, channel_options(keepalive=how.keepalive))
        self._stub = kvservice_pb2_grpc.KVServiceStub(self._channel)
        self._tx: TransferStream | None = None
        self._tx_lock = threading.Lock()
        self._tx_enabled = how.transfer_stream
        if self._lane.enabled:  # wait() reads the lane on the waiting thread (see _lane)
            self._tx_book.pump, self._tx_book.wake = self._lane.pump, self._lane.wake
        self._session = SessionKeeper(
            self._stub, self.client_name, self.target, self.owned, how.on_session_lost, self._credential_path
        )

    # -- session ---------------------------------------------------------------------------
    @property
    def session_id(self) -> str:
        """Open the session if needed (or wait out a resume) and return its id."""
        return self._session.current(self.timeout)

    @property
    def service_peer_address(self) -> str:
        """The address that names this client's service on every node, as the service tells each
        session (its ``advertise_address``, else a peer TCP listener bound to a named host). A
        prefill engine names it as the sender of its transfers, so the decode's service lets only
        that service fetch the plan (ExpectDelta's ``sender_address``). Opens the session if
        needed; "" when the service announces none or is older and sends none.
        """
        self._session.current(self.timeout)
        return self._session.peer_address

    def _transfer_stream(self) -> TransferStream | None:
        """The session's Transfers stream, opened (again) if needed; None when not used."""
        with self._tx_lock:
            tx = self._tx
            if tx is not None and tx.closed and isinstance(tx.error, Unimplemented):
                self._tx_enabled = False  # an older service: unary calls from now on
            if not self._tx_enabled:
                return None
            if tx is None or tx.closed:
                md = ((rq.SESSION_METADATA_KEY, self.session_id),)
                tx = self._tx = TransferStream(self._stub, md, self._tx_book)
            return tx

    def _lane_reports_ends(self) -> bool:
        # NOTE: on the lane only once the session's Transfers stream answered a call: from then on
        # it reports every end of this session's transfers (the book waits on it and the lane)
        tx = self._tx
        return tx is not None and tx.answered and not tx.closed

    def close(self) -> None:
        """End the session (the service releases what it owns at once) and close the channel."""
        self._lane.close()
        with self._tx_lock:
            if self._tx is not None:
                self._tx.close()
        self._session.close(min(self.timeout, 5.0))
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def ask_service_peer_address(address: str, client_name: str, timeout: float) -> str:
    """:attr:`Client.service_peer_address` of the service at ``address``, from a short session
    of its own (no transfer stream, no lane). Raises what connecting raises (KVClientError,
    OSError, ValueError)."""
    with Client(address, client_name=client_name, timeout=timeout, transfer_stream=False, lane=False) as kv:
        return kv.service_peer_address
