"""Per-call caps, checked on every decoded request before any servicer code runs.

Generic over the messages, so a new RPC or field is covered without a line here: every
repeated field (page indices, hashes, positions, ids, ...) may hold at most
``max_pages_per_call`` items and every packed token field (``TokenIds.u32le``) at most
``max_tokens_per_call`` tokens; the whole message is already bounded by ``max_message_mb``.
Breaking a cap is the caller's mistake: INVALID_ARGUMENT naming the field and the cap.
"""

from __future__ import annotations

import dataclasses

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

__all__ = ["CallLimits"]


def _repeated(fd: FieldDescriptor) -> bool:
    flag = getattr(fd, "is_repeated", None)  # protobuf >= 6 (``label`` is gone there)
    return bool(flag) if flag is not None else fd.label == FieldDescriptor.LABEL_REPEATED


_BYTES = FieldDescriptor.TYPE_BYTES
_TOKEN_FIELD = "u32le"


@dataclasses.dataclass(frozen=True)
class CallLimits:
    max_items: int = 1 << 20  # Config.limits.max_pages_per_call
    max_tokens: int = 1 << 22  # Config.limits.max_tokens_per_call

    def breach(self, msg: Message, prefix: str = "") -> str | None:
        """Why ``msg`` breaks a cap (naming the field and the option), or None."""
        for fd, value in msg.ListFields():
            name = prefix + fd.name
            if _repeated(fd):
                if len(value) > self.max_items:
                    return f"{name}: {len(value)} items exceed max_pages_per_call ({self.max_items})"
                if fd.message_type is not None:
                    for i, item in enumerate(value):  # request messages repeat few sub-messages
                        why = self.breach(item, f"{name}[{i}].")
                        if why:
                            return why
            elif fd.message_type is not None:
                why = self.breach(value, name + ".")
                if why:
                    return why
            elif fd.type == _BYTES and fd.name == _TOKEN_FIELD and len(value) // 4 > self.max_tokens:
                return f"{name}: {len(value) // 4} tokens exceed max_tokens_per_call ({self.max_tokens})"
        return None
