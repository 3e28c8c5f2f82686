"""Bearer tokens kept in a file: one per line, re-read when the file changes.

Kubernetes projected service-account tokens and mounted secrets are replaced by swapping a
symlink, so the file is re-stat'ed (at most once a second) and re-read when its inode, size or
mtime moved. Several lines are several valid tokens, so a rotation can overlap old and new.
A file that vanishes or empties fails closed: no token matches until it is back.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
import time

__all__ = ["TokenFile", "TokenFileError"]

log = logging.getLogger(__name__)
RESTAT_S = 1.0


MAX_TOKEN_FILE = 1 << 20  # bytes read of a token file, at most


class TokenFileError(ValueError):
    """The token file cannot be read or holds no token."""


class TokenFile:
    """The tokens in ``path`` (thread-safe; cheap to call per RPC)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._tokens: tuple[bytes, ...] = ()
        self._checked = -RESTAT_S

    def tokens(self) -> tuple[bytes, ...]:
        """The current tokens; raises TokenFileError when the file is unreadable or empty."""
        now = time.monotonic()
        with self._lock:
            if now - self._checked < RESTAT_S and self._tokens:
                return self._tokens
            self._checked = now
            try:
                st = os.stat(self.path)
                stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
                if stamp != self._stamp:
                    with open(self.path, "rb") as f:
                        data = f.read(MAX_TOKEN_FILE + 1)
                    if len(data) > MAX_TOKEN_FILE:  # a token file is a few lines: this is not one
                        self._tokens, self._stamp = (), None
                        raise TokenFileError(f"{self.path} is larger than {MAX_TOKEN_FILE} bytes")
                    lines = [ln.strip() for ln in data.splitlines()]
                    self._tokens = tuple(ln for ln in lines if ln and not ln.startswith(b"#"))
                    self._stamp = stamp
            except OSError as exc:
                self._tokens, self._stamp = (), None
                raise TokenFileError(f"cannot read {self.path}: {exc.strerror}") from None
            if not self._tokens:
                raise TokenFileError(f"{self.path} holds no token")
            return self._tokens

    def first(self) -> str:
        """The token this side sends (the file's first)."""
        return self.tokens()[0].decode()

    def matches(self, presented: str | bytes | None) -> bool:
        """Whether ``presented`` is one of the tokens (constant-time per token; False when the
        file cannot be read, logged)."""
        if not presented:
            return False
        given = presented.encode() if isinstance(presented, str) else presented
        try:
            valid = self.tokens()
        except TokenFileError as exc:
            log.error("token check failed closed: %s", exc)
            return False
        ok = False
        for token in valid:
            ok |= hmac.compare_digest(token, given)
        return ok
