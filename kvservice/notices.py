"""Session notices: what a session's stream tells its engine besides the session itself.

Today one kind: how many of a buffer set's indexed pages are P/D duplicates now (another
engine holds them too). The transfer engine's duplicate book calls :meth:`SessionNotices.duplicates`
when a mark is made or cleared; the session stream (``OpenSession``) takes them from
:meth:`SessionNotices.of`. Coalesced per buffer set: a slow stream gets the latest count once.
"""

from __future__ import annotations

from .buffers import BufferRegistry
from .errors import NotFound
from .index import PrefixIndex
from .latest import LatestQueue

__all__ = ["SessionNotices"]


class SessionNotices:
    """Pending notices per session (``put`` on the event loop, like ``LatestQueue``)."""

    def __init__(self, buffers: BufferRegistry, index: PrefixIndex) -> None:
        self._buffers = buffers
        self._index = index
        self._by_session: dict[str, LatestQueue[str, int]] = {}  # buffer set id -> duplicate count

    def of(self, session_id: str) -> LatestQueue[str, int]:
        """The pending notices of a session's stream (a resumed stream takes over the same)."""
        return self._by_session.setdefault(session_id, LatestQueue())

    def duplicates(self, buffer_set_id: str) -> None:
        """Tell the owner session of ``buffer_set_id`` how many of its pages are P/D duplicates
        now; nothing when the set is gone or its session has no stream."""
        try:
            bs = self._buffers.get(buffer_set_id)
        except NotFound:
            return
        box = self._by_session.get(bs.session_id)
        if box is not None:  # NOTE: on the event loop (the transfer engine's callbacks run there)
            box.put(buffer_set_id, self._index.duplicated_pages(buffer_set_id))

    def drop(self, session_id: str) -> None:
        """The session ended: its pending notices go with it."""
        self._by_session.pop(session_id, None)
