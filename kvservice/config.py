"""Service configuration: one frozen dataclass, filled from (highest first) command-line flags,
``KVSERVICE_*`` environment variables, an optional YAML file and the defaults below, validated
once at start with messages that name the option.

Every field's ``metadata["help"]`` is its documentation; flags are ``--field-name`` and
environment variables ``KVSERVICE_FIELD_NAME``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from kvservice_client.contract import (
    DEFAULT_KEEPALIVE,
    PEER_TOKEN_METADATA_KEY,
    ChannelSecurity,
    KeepalivePolicy,
)

__all__ = ["Config", "ConfigError", "load_config"]


class ConfigError(ValueError):
    """A configuration option is invalid; the message names the option."""


def _opt(default: Any, help: str) -> Any:
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass(frozen=True)
class Config:
    # -- Listening and lifecycle -------------------------------------------------------------------------
    uds_path: str = _opt(
        f"/tmp/kvservice-{os.getuid()}.sock",
        "Unix domain socket the engine API listens on ('' disables it).",
    )
    uds_mode: str = _opt("0600", "File mode of the Unix socket, octal.")
    tcp_address: str = _opt("", "Optional TCP listen address, host:port (port 0 picks one).")
    advertise_address: str = _opt(
        "", "Address peers use to reach this service (default: the TCP address, else the UDS)."
    )
    service_name: str = _opt("", "Label of this service in logs and stats (default: hostname).")
    grace_period_s: float = _opt(10.0, "On SIGTERM, seconds in-flight work may take to finish.")
    session_grace_s: float = _opt(
        5.0,
        "Seconds a session outlives a broken session stream (the client resumes it meanwhile); "
        "then its buffer sets, leases and transfers are released. Also bounds how long a killed "
        "engine's resources stay.",
    )
    keepalive_time_ms: int = _opt(10_000, "Server pings an idle client this often to find dead ones (ms).")
    keepalive_timeout_ms: int = _opt(5_000, "A ping unanswered this long closes the connection (ms).")
    keepalive_min_ping_interval_ms: int = _opt(
        5_000,
        "Clients may ping this often without data (ms); the SDK pings every 10 s. Pings closer "
        "together count as strikes and the connection is cut after two.",
    )
    max_message_mb: int = _opt(64, "Largest gRPC message, MiB.")

    # -- Transfers: deadlines, transport, staging, routes ------------------------------------------------
    default_deadline_ms: int = _opt(30_000, "Transfer deadline when a call gives none.")
    max_deadline_ms: int = _opt(600_000, "Largest deadline a call may ask for.")
    transfer_retain_s: float = _opt(300.0, "Seconds a finished transfer's status stays pollable.")
    transport: str = _opt("nixl", "Data transport: 'nixl' (UCX; DRAM and VRAM) or 'loopback' (one process).")
    nixl_progress_delay_us: int = _opt(
        1000,
        "Sleep of NIXL's UCX progress thread between idle polls (us). 0 is nixl's own default: the "
        "thread never sleeps and takes a whole core even when no transfer runs.",
    )
    host_staging_mb: int = _opt(256, "Host staging pool, MiB (pinned when CUDA exists).")
    vram_staging_mb: int = _opt(
        2048, "VRAM staging pool per GPU, MiB (only with CUDA buffer sets); bigger = fewer, larger batches."
    )
    workers_per_peer: int = _opt(
        64, "Chunks moved to one destination service at once, at most (see peer_inflight_mb)."
    )
    peer_inflight_mb: int = _opt(
        1024,
        "Bytes (MiB) of chunks moving to one destination service at once: per-peer concurrency is "
        "this byte budget (granted in arrival order), so many small deltas move side by side while "
        "large ones take turns; a chunk larger than the budget moves alone.",
    )
    same_host_route: str = _opt(
        "auto",
        "'auto': a receiver's service on this host (same kernel boot id, reached over a Unix socket "
        "or loopback) hands over its engine pools and transfers copy page to page into them (FUSED), "
        "falling back to the transport when they cannot be opened; 'off': always the transport.",
    )
    two_gpu_copy: str = _opt(
        "auto",
        "A same-node copy between pools on two GPUs: 'push' (the fused kernel on the source GPU "
        "writes the destination pools through their mapping in its own context), 'pull' (the "
        "kernel on the destination GPU reads the source pools), 'staged' (pack, one link copy, "
        "unpack: no second mapping), 'auto' (the measured fastest per size; bench/results/NOTES.md). "
        "The native lane copies in one kernel: on the destination GPU with 'pull', else the source's.",
    )
    transfer_integrity: bool = _opt(
        False,
        "End-to-end integrity of incoming transfers: senders checksum every packed batch (and the "
        "pages of direct and fused chunks; XXH3-64 on CPU, a GPU reduction on VRAM) and this "
        "service verifies before unpacking or counting them, failing the transfer on a mismatch. "
        "Costs one extra read of the bytes on each side.",
    )
    gil_switch_us: int = _opt(
        0,
        "Python's thread switch interval in this service, in µs (sys.setswitchinterval; 0 keeps "
        "Python's 5,000). A completion or poller thread that finished waiting needs the GIL to hand "
        "its result to the event loop; while the loop runs Python it waits up to this long for it "
        "(bench/results/NOTES.md has the measurement).",
    )

    # -- Native lane (same node and cross-node) ----------------------------------------------------------
    lane: bool = _opt(
        True,
        "The native lane (<uds_path>.lane): engines on this node send same-node transfers through a "
        "C++ thread that copies and answers without the service's Python (docs/decisions/0014); "
        "off: gRPC only. Needs a C++ compiler the first time (built once, cached) unless native_dir "
        "holds a prebuilt module (the image's does).",
    )
    lane_cuda_chunk_kb: int = _opt(
        32,
        "KiB of one page region each CUDA block of the lane's copy kernel moves (a page region is "
        "split into such chunks). Whole pages of 32 KiB a block or more take the 512-thread kernel, "
        "the rest (head slices, smaller pages) the 256-thread one (bench/results/NOTES.md has the "
        "sweep: on an H200, 32 KiB blocks move the same-node 2 GiB row 2 points closer to a device copy "
        "than 16 KiB blocks).",
    )
    lane_spin_us: int = _opt(
        -1,
        "µs the lane's threads keep polling without sleeping after a message or a job, the bulk "
        "thread also after an offer (0: they sleep at once; -1: 5000 when the lane copies on a "
        "GPU, 0 otherwise). A sleeping thread's wake-up on an idle core of the GPU host costs "
        "~50 µs per hop, which a transfer pays on its way in; spinning holds a core while engines "
        "send (bench/results/NOTES.md has the measurement).",
    )
    lane_wait_spin_us: int = _opt(
        -1,
        "µs an engine's thread waiting for the lane's answer (a REPLY, a transfer's END) polls "
        "before it sleeps, told to engines when their lane opens (an engine's own "
        "KVSERVICE_LANE_SPIN_US or Client(lane_spin_us=) wins). -1: 5000 when the lane copies on "
        "a GPU, 0 otherwise. A waiter asleep in poll wakes ~50-80 µs after its END on the GPU "
        "host (a twentieth of a 2 GiB copy); spinning holds a core of the engine's host while it lasts "
        "(each try releases the GIL).",
    )
    lane_cross_mb: int = _opt(
        256,
        "MiB of staging per device (host memory, and each GPU) for the cross-node lane: a delta "
        "offered at ExpectDelta to another service's engine goes from that service's lane straight "
        "into this one's (one NIXL WRITE, notified; no Python on its path; docs/decisions/0018). "
        "Half receives, half packs what this lane sends; a delta above a quarter streams "
        "through a slot in chunks (lane_cross_stream). 0: off. Needs the lane and the NIXL "
        "transport.",
    )
    lane_cross_gpu_mb: int = _opt(
        1024,
        "MiB of the cross-node lane's staging on each GPU (lane_cross_mb is host memory's, and the "
        "GPUs' too when this is 0). Larger slots mean fewer, larger chunks for a streamed delta: "
        "2 GiB through the default 256 MiB slot goes in 64 MiB chunks (bench/results/NOTES.md).",
    )
    lane_cross_parts: int = _opt(
        4,
        "Chunks of a streamed cross-node delta in flight: its slot is split in this many parts, "
        "and chunk k waits until the receiver has unpacked chunk k - parts (2..16). More parts hide "
        "the notification round trip behind the WRITEs; fewer make each chunk larger.",
    )
    lane_cross_stream: str = _opt(
        "gpu",
        "Which deltas larger than a cross-node lane slot stream through it in chunks: 'gpu' (GPU "
        "pools: the gRPC route packs those anyway), 'all' (host pools too; there the gRPC route's "
        "DIRECT writes into the registered pools are faster: bench/results/NOTES.md), 'off' "
        "(larger deltas use gRPC).",
    )
    native_dir: str = _opt(
        "",
        "Directory of prebuilt native lane modules (<native_dir>/<tag>/, made by "
        "`KVSERVICE_NATIVE_DIR=... python -m kvservice.lane.native`; the image has one): a module "
        "built for this source, Python and torch is imported from there, read-only, and no compiler "
        "is needed. Default: built on first use into the cache dir.",
    )

    # -- Prefix index and KV events ----------------------------------------------------------------------
    hash_seed: int = _opt(0, "Seed of the canonical page hash (XXH3-64); must match clients.")
    max_lease_ttl_ms: int = _opt(600_000, "Largest lease a MatchPrefix call may ask for.")
    kv_events: str = _opt(
        "",
        "KV-event streams to ingest, as a JSON list (a YAML list in --config): each "
        '{"engine_id", "endpoint", "page_size", optional "replay_endpoint", "topic", "dp_rank", '
        '"scheme": "canonical"|"engine"}.',
    )
    republish_events: str = _opt(
        "",
        "Re-publish this node's index as vLLM-format KV events, as a JSON list (a YAML list in "
        '--config): each {"endpoint" (ZMQ bind, e.g. "tcp://*:5600"), optional "replay_endpoint", '
        '"topic" (default "kv"), "engine_id" (default "*": every buffer set)}.',
    )

    # -- P/D duplicates and landing ----------------------------------------------------------------------
    duplicate_policy: str = _opt(
        "lower",
        "What a sender's index does with pages a DONE transfer copied to a receiver that indexes "
        "them (the P/D duplicate): 'keep' (mark only), 'lower' (eviction priority lowered to "
        "duplicate_priority while the mark holds) or 'off' (no marks).",
    )
    duplicate_priority: int = _opt(-1000, "Eviction priority of duplicated pages under policy 'lower'.")
    duplicate_check_ms: int = _opt(
        1000,
        "How often a sender checks with the receivers' services that its duplicate marks still "
        "hold; a mark whose receiver evicted the pages, unregistered or went away is cleared "
        "within this period (plus one peer call timeout).",
    )
    landing_pool_mb: int = _opt(
        512,
        "Landing pool per memory location (host memory; each GPU with CUDA buffer sets), MiB: landing "
        "transfers (ExpectDelta.landing) land here until claimed. Allocated at its first landing; a "
        "declaration that does not fit is refused at once (RESOURCE_EXHAUSTED).",
    )
    landing_ttl_ms: int = _opt(
        10_000, "How long landed pages wait for a Claim when the declaration gives no TTL."
    )
    landing_max_ttl_ms: int = _opt(600_000, "Largest landing TTL a declaration may ask for.")
    landing_evict: str = _opt(
        "never",
        "When a landing does not fit: 'never' (refuse it) or 'oldest' (end the oldest LANDED, unclaimed "
        "landings FAILED 'landing evicted' if that makes it fit, else refuse without evicting).",
    )

    # -- Limits and budgets ------------------------------------------------------------------------------
    max_pages_per_call: int = _opt(
        1_048_576, "Most page indices one call may name (ExpectDelta, SendDelta, PublishPages, ...)."
    )
    max_tokens_per_call: int = _opt(4_194_304, "Most token ids one MatchPrefix or publish call may carry.")
    max_buffer_sets_per_session: int = _opt(256, "Most buffer sets one session may hold registered.")
    max_transfers_per_session: int = _opt(16_384, "Most unfinished transfers one session may have.")
    max_leases_per_session: int = _opt(65_536, "Most live prefix leases one session may hold.")
    inbound_max_transfers: int = _opt(
        0,
        "Default inbound budget of a buffer set: most unfinished inbound transfers (0: unlimited). "
        "Over it ExpectDelta is refused at once with RESOURCE_EXHAUSTED; RegisterBuffers may override.",
    )
    inbound_max_bytes: int = _opt(
        0,
        "Default inbound budget of a buffer set: most bytes still to arrive over its unfinished "
        "inbound transfers (0: unlimited); RegisterBuffers may override.",
    )

    # -- Security: who may call, TLS, tokens, peers ------------------------------------------------------
    admin_uids: str = _opt(
        "",
        "Comma-separated uids (besides root and the service's own uid) whose local sessions are "
        "admin: GetStats lists every buffer set to them, to others only their own.",
    )
    admin_identities: str = _opt(
        "",
        "Comma-separated client certificate names (common name, else first DNS name) that are admin "
        "over mutual TLS: GetStats shows them the whole node without a session.",
    )
    admin_token_file: str = _opt(
        "",
        "File of bearer tokens, one per line, that are admin over TCP (GetStats shows the whole "
        "node without a session); with token_file set they must be accepted there too.",
    )
    allowed_uids: str = _opt(
        "",
        "Comma-separated uids that may open sessions over the Unix socket (root and the service's "
        "own uid always may); such sessions must then be identified (the SDK does it). Empty: "
        "any uid the socket's file mode lets in.",
    )
    peer_uids: str = _opt(
        "",
        "Comma-separated uids of co-located kvservices (besides this service's own uid) that may "
        "call KVPeer over the Unix socket; each proves its uid with a credential from "
        "<socket>.cred. Engines never may.",
    )
    peer_allowlist: str = _opt(
        "",
        "Where SendDelta may send KV: comma-separated CIDRs, DNS suffixes ('.svc.cluster.local'), "
        "host names and 'unix'. Empty: anywhere (logged as a warning at start).",
    )
    insecure: bool = _opt(
        False,
        "Allow TCP listeners that authenticate nobody (no client certificates, no token). Logged as "
        "insecure at every start; without it such a listener is refused at start-up.",
    )
    tls_cert: str = _opt("", "PEM certificate of the engine TCP listener (TLS); with tls_key.")
    tls_key: str = _opt("", "PEM private key of tls_cert.")
    tls_client_ca: str = _opt(
        "",
        "PEM CA bundle; when set, TCP callers must present a client certificate it signed (mutual "
        "TLS). Certificate files are re-read when they change (cert-manager rotation).",
    )
    token_file: str = _opt(
        "",
        "File of bearer tokens, one per line, TCP engine callers must send ('authorization: Bearer "
        "<token>'); re-read when it changes (Kubernetes projected tokens, rotation with overlap).",
    )
    peer_tcp_address: str = _opt(
        "",
        "Own TCP listener for KVPeer (service to service), host:port. When set, KVPeer is served "
        "there (and on the UDS), never on tcp_address.",
    )
    peer_tls_cert: str = _opt(
        "",
        "PEM certificate this service presents to peers, as server and as client (one cluster CA; "
        "its common name is the service's peer identity).",
    )
    peer_tls_key: str = _opt("", "PEM private key of peer_tls_cert.")
    peer_tls_ca: str = _opt(
        "", "PEM CA bundle of the cluster: peers must present a certificate it signed (mutual TLS)."
    )
    peer_token_file: str = _opt(
        "",
        "File of shared peer tokens, one per line: KVPeer calls over TCP must carry one "
        "('kvservice-peer-token'); this service sends the first. Re-read when it changes.",
    )

    # -- Operations --------------------------------------------------------------------------------------
    cache_dir: str = _opt(
        "",
        "Writable directory for JIT caches (numba, Triton); nothing is written into the installed "
        "package. Default: $XDG_CACHE_HOME/kvservice, else <tmp>/kvservice-<uid>.",
    )
    metrics_port: int = _opt(0, "Prometheus metrics port (0: off; -1: pick a free one).")
    log_level: str = _opt("INFO", "DEBUG, INFO, WARNING or ERROR.")
    log_format: str = _opt("json", "'json' (one object per line) or 'text'.")

    def validate(self) -> Config:
        """Return self if every option is valid, else raise ConfigError naming the option."""
        if not self.uds_path and not self.tcp_address:
            raise ConfigError("uds_path/tcp_address: at least one listen address is required")
        try:
            mode = int(self.uds_mode, 8)
        except ValueError:
            raise ConfigError(f"uds_mode: {self.uds_mode!r} is not an octal file mode") from None
        if not 0 <= mode <= 0o777:
            raise ConfigError(f"uds_mode: {self.uds_mode!r} is outside 0000..0777")
        if self.tcp_address:
            _check_host_port("tcp_address", self.tcp_address)
        if self.grace_period_s < 0:
            raise ConfigError("grace_period_s: must be >= 0")
        if not 0 <= self.gil_switch_us <= 100_000:
            raise ConfigError("gil_switch_us: must be 0 (Python's default) .. 100000 µs")
        if not 0 <= self.lane_cross_mb <= 1 << 20:
            raise ConfigError("lane_cross_mb: must be 0..1048576 (MiB)")
        if not 0 <= self.lane_cross_gpu_mb <= 1 << 20:
            raise ConfigError("lane_cross_gpu_mb: must be 0..1048576 (MiB)")
        if not 2 <= self.lane_cross_parts <= 16:
            raise ConfigError("lane_cross_parts: must be 2..16")
        if self.lane_cross_stream not in ("gpu", "all", "off"):
            raise ConfigError("lane_cross_stream: must be 'gpu', 'all' or 'off'")
        if not -1 <= self.lane_spin_us <= 1_000_000:
            raise ConfigError("lane_spin_us: must be -1 (auto) or 0..1000000 (µs)")
        if not -1 <= self.lane_wait_spin_us <= 1_000_000:
            raise ConfigError("lane_wait_spin_us: must be -1 (auto) or 0..1000000 (µs)")
        if not 1 <= self.lane_cuda_chunk_kb <= 65536:
            raise ConfigError("lane_cuda_chunk_kb: must be 1..65536 (KiB)")
        if not 0 < self.default_deadline_ms <= self.max_deadline_ms:
            raise ConfigError("default_deadline_ms: must be > 0 and <= max_deadline_ms")
        if not 0 <= self.hash_seed < 2**64:
            raise ConfigError("hash_seed: must fit in an unsigned 64-bit integer")
        if self.max_lease_ttl_ms <= 0:
            raise ConfigError("max_lease_ttl_ms: must be > 0")
        if self.two_gpu_copy not in ("auto", "push", "pull", "staged"):
            raise ConfigError(
                f"two_gpu_copy: {self.two_gpu_copy!r} is not 'auto', 'push', 'pull' or 'staged'"
            )
        if self.same_host_route not in ("auto", "off"):
            raise ConfigError(f"same_host_route: {self.same_host_route!r} is not 'auto' or 'off'")
        if self.session_grace_s < 0:
            raise ConfigError("session_grace_s: must be >= 0")
        for name in ("keepalive_time_ms", "keepalive_timeout_ms", "keepalive_min_ping_interval_ms"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be > 0")
        if not 1 <= self.max_message_mb <= 2047:
            raise ConfigError("max_message_mb: must be in 1..2047")
        if self.transport not in ("nixl", "loopback"):
            raise ConfigError(f"transport: {self.transport!r} is not 'nixl' or 'loopback'")
        if not 0 <= self.nixl_progress_delay_us <= 1_000_000:
            raise ConfigError("nixl_progress_delay_us: must be in 0..1000000")
        if self.host_staging_mb < 1 or self.vram_staging_mb < 1:
            raise ConfigError("host_staging_mb/vram_staging_mb: must be >= 1")
        if not 1 <= self.workers_per_peer <= 256:
            raise ConfigError("workers_per_peer: must be in 1..256")
        if self.peer_inflight_mb < 1:
            raise ConfigError("peer_inflight_mb: must be >= 1")
        if self.transfer_retain_s < 0:
            raise ConfigError("transfer_retain_s: must be >= 0")
        self.event_streams()  # raises ConfigError naming kv_events
        self.republish_streams()  # raises ConfigError naming republish_events
        try:
            self.admin_uid_set  # noqa: B018  (validates)
        except ValueError:
            raise ConfigError(
                f"admin_uids: {self.admin_uids!r} is not a comma-separated list of uids"
            ) from None
        try:
            self.allowed_uid_set  # noqa: B018  (validates)
        except ValueError:
            raise ConfigError(
                f"allowed_uids: {self.allowed_uids!r} is not a comma-separated list of uids"
            ) from None
        try:
            self.peer_uid_set  # noqa: B018  (validates)
        except ValueError:
            raise ConfigError(
                f"peer_uids: {self.peer_uids!r} is not a comma-separated list of uids"
            ) from None
        try:
            self.peer_allowlist_entries  # noqa: B018
        except ValueError as exc:
            raise ConfigError(f"peer_allowlist: {exc}") from None
        self._validate_security()
        for name in (
            "max_pages_per_call",
            "max_tokens_per_call",
            "max_buffer_sets_per_session",
            "max_transfers_per_session",
            "max_leases_per_session",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1")
        for name in ("inbound_max_transfers", "inbound_max_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must be >= 0 (0: unlimited)")
        if self.duplicate_policy not in ("keep", "lower", "off"):
            raise ConfigError(f"duplicate_policy: {self.duplicate_policy!r} is not 'keep', 'lower' or 'off'")
        if not 1 <= self.landing_pool_mb <= 1 << 20:
            raise ConfigError("landing_pool_mb: must be in 1..1048576")
        if not 1 <= self.landing_ttl_ms <= self.landing_max_ttl_ms:
            raise ConfigError("landing_ttl_ms: must be in 1..landing_max_ttl_ms")
        if self.landing_evict not in ("never", "oldest"):
            raise ConfigError(f"landing_evict: {self.landing_evict!r} is not 'never' or 'oldest'")
        if not -(2**31) <= self.duplicate_priority < 2**31:
            raise ConfigError("duplicate_priority: must fit in int32")
        if not 50 <= self.duplicate_check_ms <= 3_600_000:
            raise ConfigError("duplicate_check_ms: must be in 50..3600000")
        if not -1 <= self.metrics_port <= 65535:
            raise ConfigError("metrics_port: must be -1, 0 or a port number")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"log_level: {self.log_level!r} is not DEBUG/INFO/WARNING/ERROR")
        if self.log_format not in ("json", "text"):
            raise ConfigError(f"log_format: {self.log_format!r} is not 'json' or 'text'")
        return self

    def _validate_security(self) -> None:
        """TLS files in pairs and readable; no TCP listener that authenticates nobody unless
        ``insecure`` (see docs/design/security.md)."""
        if self.peer_tcp_address:
            _check_host_port("peer_tcp_address", self.peer_tcp_address)
        for cert, key, ca in (
            ("tls_cert", "tls_key", "tls_client_ca"),
            ("peer_tls_cert", "peer_tls_key", "peer_tls_ca"),
        ):
            if bool(getattr(self, cert)) != bool(getattr(self, key)):
                raise ConfigError(f"{cert}/{key}: give both or neither")
            if getattr(self, ca) and not getattr(self, cert):
                raise ConfigError(f"{ca}: needs {cert} and {key} (client certificates need TLS)")
        for name in ("tls_cert", "tls_key", "tls_client_ca", "peer_tls_cert", "peer_tls_key", "peer_tls_ca"):
            path = getattr(self, name)
            if path and not os.access(path, os.R_OK):
                raise ConfigError(f"{name}: cannot read {path}")
        for name in ("token_file", "peer_token_file", "admin_token_file"):
            path = getattr(self, name)
            if path:
                from kvservice_client.contract import TokenFile, TokenFileError

                try:
                    TokenFile(path).tokens()
                except TokenFileError as exc:
                    raise ConfigError(f"{name}: {exc}") from None
        if self.insecure:
            return
        if self.tcp_address and not self.engine_tcp_authenticated:
            raise ConfigError(
                "tcp_address: a TCP listener must authenticate its callers: set tls_client_ca (mutual "
                "TLS, with tls_cert/tls_key) or token_file, or pass --insecure to run it open"
            )
        if self.peer_tcp_address and not self.peer_tcp_authenticated:
            raise ConfigError(
                "peer_tcp_address: peers must authenticate: set peer_tls_ca (mutual TLS, with "
                "peer_tls_cert/peer_tls_key) or peer_token_file, or pass --insecure to run it open"
            )

    @property
    def engine_tcp_authenticated(self) -> bool:
        """tcp_address requires client certificates or a bearer token."""
        return bool(self.tls_client_ca or self.token_file)

    @property
    def peer_tcp_authenticated(self) -> bool:
        """peer_tcp_address requires peer certificates or a peer token."""
        return bool(self.peer_tls_ca or self.peer_token_file)

    @property
    def peer_security(self) -> ChannelSecurity:
        """How this service's peer channels authenticate to other services."""
        return ChannelSecurity(
            ca_file=self.peer_tls_ca,
            cert_file=self.peer_tls_cert,
            key_file=self.peer_tls_key,
            token_file=self.peer_token_file,
            token_key=PEER_TOKEN_METADATA_KEY,
        )

    @property
    def peers_on_engine_tcp(self) -> bool:
        """KVPeer rides the engine TCP listener: no listener of its own, and peers either
        authenticate with the peer token or nobody is authenticated (``insecure``)."""
        return (
            bool(self.tcp_address)
            and not self.peer_tcp_address
            and (self.insecure or bool(self.peer_token_file))
        )

    def event_streams(self) -> list[dict[str, Any]]:
        """The parsed ``kv_events`` list, validated."""
        keys = {"engine_id", "endpoint", "page_size", "replay_endpoint", "topic", "dp_rank", "scheme"}
        streams = _object_list("kv_events", self.kv_events, keys, required=("engine_id", "endpoint"))
        seen = set()
        for i, st in enumerate(streams):
            if not isinstance(st.get("page_size"), int) or st["page_size"] <= 0:
                raise ConfigError(f"kv_events[{i}].page_size: a positive integer is required")
            if st.get("scheme", "canonical") not in ("canonical", "engine"):
                raise ConfigError(f"kv_events[{i}].scheme: must be 'canonical' or 'engine'")
            if st["engine_id"] in seen:
                raise ConfigError(f"kv_events[{i}].engine_id: duplicate {st['engine_id']!r}")
            seen.add(st["engine_id"])
        return streams

    def republish_streams(self) -> list[dict[str, Any]]:
        """The parsed ``republish_events`` list, validated."""
        keys = {"endpoint", "replay_endpoint", "topic", "engine_id"}
        streams = _object_list("republish_events", self.republish_events, keys, required=("endpoint",))
        for i, st in enumerate(streams):
            for key in ("replay_endpoint", "topic", "engine_id"):
                if key in st and not isinstance(st[key], str):
                    raise ConfigError(f"republish_events[{i}].{key}: must be a string")
        return streams

    @functools.cached_property
    def admin_uid_set(self) -> frozenset[int]:
        extra = {int(u) for u in self.admin_uids.split(",") if u.strip()}
        return frozenset({0, os.getuid(), *extra})

    @functools.cached_property
    def admin_identity_set(self) -> frozenset[str]:
        return frozenset(n.strip() for n in self.admin_identities.split(",") if n.strip())

    @functools.cached_property
    def allowed_uid_set(self) -> frozenset[int] | None:
        """Uids allowed on the Unix socket, or None (no allowlist)."""
        extra = {int(u) for u in self.allowed_uids.split(",") if u.strip()}
        return frozenset({0, os.getuid(), *extra}) if extra else None

    @functools.cached_property
    def peer_uid_set(self) -> frozenset[int]:
        """Uids whose processes may call KVPeer over the Unix socket (this service's own, always)."""
        return frozenset({os.getuid(), *(int(u) for u in self.peer_uids.split(",") if u.strip())})

    @functools.cached_property
    def peer_allowlist_entries(self) -> tuple[Any, ...]:
        """Parsed once per Config (SendDelta checks every call against it)."""
        from .peers_allow import parse_allowlist

        return parse_allowlist(self.peer_allowlist)

    @property
    def keepalive(self) -> KeepalivePolicy:
        """The keepalive policy of every listener and peer client (kvservice_client.contract)."""
        return dataclasses.replace(
            DEFAULT_KEEPALIVE,
            server_time_ms=self.keepalive_time_ms,
            timeout_ms=self.keepalive_timeout_ms,
            min_recv_ping_interval_ms=self.keepalive_min_ping_interval_ms,
            time_ms=max(DEFAULT_KEEPALIVE.time_ms, 2 * self.keepalive_min_ping_interval_ms),
        )

    @property
    def uds_mode_int(self) -> int:
        return int(self.uds_mode, 8)


# The options by subject: the declaration above follows it, and so do --help and the docs.
SECTIONS: dict[str, tuple[str, ...]] = {
    "Listening and lifecycle": (
        "uds_path",
        "uds_mode",
        "tcp_address",
        "advertise_address",
        "service_name",
        "grace_period_s",
        "session_grace_s",
        "keepalive_time_ms",
        "keepalive_timeout_ms",
        "keepalive_min_ping_interval_ms",
        "max_message_mb",
    ),
    "Transfers: deadlines, transport, staging, routes": (
        "default_deadline_ms",
        "max_deadline_ms",
        "transfer_retain_s",
        "transport",
        "nixl_progress_delay_us",
        "host_staging_mb",
        "vram_staging_mb",
        "workers_per_peer",
        "peer_inflight_mb",
        "same_host_route",
        "two_gpu_copy",
        "transfer_integrity",
        "gil_switch_us",
    ),
    "Native lane (same node and cross-node)": (
        "lane",
        "lane_cuda_chunk_kb",
        "lane_spin_us",
        "lane_wait_spin_us",
        "lane_cross_mb",
        "lane_cross_gpu_mb",
        "lane_cross_parts",
        "lane_cross_stream",
        "native_dir",
    ),
    "Prefix index and KV events": (
        "hash_seed",
        "max_lease_ttl_ms",
        "kv_events",
        "republish_events",
    ),
    "P/D duplicates and landing": (
        "duplicate_policy",
        "duplicate_priority",
        "duplicate_check_ms",
        "landing_pool_mb",
        "landing_ttl_ms",
        "landing_max_ttl_ms",
        "landing_evict",
    ),
    "Limits and budgets": (
        "max_pages_per_call",
        "max_tokens_per_call",
        "max_buffer_sets_per_session",
        "max_transfers_per_session",
        "max_leases_per_session",
        "inbound_max_transfers",
        "inbound_max_bytes",
    ),
    "Security: who may call, TLS, tokens, peers": (
        "admin_uids",
        "admin_identities",
        "admin_token_file",
        "allowed_uids",
        "peer_uids",
        "peer_allowlist",
        "insecure",
        "tls_cert",
        "tls_key",
        "tls_client_ca",
        "token_file",
        "peer_tcp_address",
        "peer_tls_cert",
        "peer_tls_key",
        "peer_tls_ca",
        "peer_token_file",
    ),
    "Operations": (
        "cache_dir",
        "metrics_port",
        "log_level",
        "log_format",
    ),
}


def _check_host_port(name: str, value: str) -> None:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"{name}: {value!r} is not host:port")


def _object_list(name: str, text: str, keys: set[str], required: tuple[str, ...]) -> list[dict[str, Any]]:
    """A JSON list of objects with only ``keys`` and non-empty strings at ``required``."""
    if not text:
        return []
    try:
        items = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{name}: not valid JSON ({exc})") from None
    if not isinstance(items, list):
        raise ConfigError(f"{name}: must be a list of stream objects")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ConfigError(f"{name}[{i}]: must be an object")
        unknown = set(item) - keys
        if unknown:
            raise ConfigError(f"{name}[{i}]: unknown keys {sorted(unknown)}")
        for key in required:
            if not isinstance(item.get(key), str) or not item[key]:
                raise ConfigError(f"{name}[{i}].{key}: a non-empty string is required")
    return items


_FIELDS = {f.name: f for f in dataclasses.fields(Config)}


def _coerce(name: str, raw: Any) -> Any:
    kind = type(_FIELDS[name].default)
    if isinstance(raw, kind) and not (kind is int and isinstance(raw, bool)):
        return raw
    text = str(raw).strip()
    try:
        if kind is bool:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if kind is int:
            return int(text, 0)
        if kind is float:
            return float(text)
    except ValueError:
        raise ConfigError(f"{name}: {raw!r} is not a valid {kind.__name__}") from None
    return text


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add one ``--option-name`` flag per config field (all default to 'not given'), in the
    argument groups of ``SECTIONS``."""
    parser.add_argument("--config", help="YAML file with options (keys as in KVSERVICE_*).")
    for title, names in SECTIONS.items():
        group = parser.add_argument_group(title)
        for name in names:
            field = _FIELDS[name]
            # NOTE: a boolean flag alone means true ("--insecure"); "--insecure false" also parses
            extra: dict[str, Any] = {"nargs": "?", "const": "true"} if isinstance(field.default, bool) else {}
            group.add_argument(
                "--" + name.replace("_", "-"), dest=name, default=None, help=field.metadata["help"], **extra
            )


def load_config(
    flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    yaml_path: str | None = None,
) -> Config:
    """Merge defaults < YAML < environment < flags and validate."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    yaml_path = yaml_path or environ.get("KVSERVICE_CONFIG") or None
    if yaml_path:
        try:
            loaded = yaml.safe_load(Path(yaml_path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"config: cannot read {yaml_path}: {exc}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config: {yaml_path} must hold a mapping of options")
        for key, raw in loaded.items():
            name = str(key).replace("-", "_")
            if name not in _FIELDS:
                raise ConfigError(f"{key}: unknown option in {yaml_path}")
            values[name] = json.dumps(raw) if isinstance(raw, list) else _coerce(name, raw)
    for key, raw in environ.items():
        if key.startswith("KVSERVICE_") and key != "KVSERVICE_CONFIG":
            name = key[len("KVSERVICE_") :].lower()
            if name not in _FIELDS:
                raise ConfigError(f"{key}: unknown environment option")
            values[name] = _coerce(name, raw)
    for name, raw in (flags or {}).items():
        if raw is not None and name in _FIELDS:
            values[name] = _coerce(name, raw)
    return Config(**values).validate()


def parse_args(argv: Sequence[str] | None = None) -> Config:
    parser = argparse.ArgumentParser(prog="kvservice serve")
    add_flags(parser)
    ns = parser.parse_args(argv)
    return load_config(vars(ns), yaml_path=ns.config)
