"""Structured logging: one JSON object per line (or plain text), with any ``extra`` fields.

Every line about a transfer carries ``transfer_id`` (pass it in ``extra``).
"""

from __future__ import annotations

import json
import logging
import sys
import time

__all__ = ["setup_logging"]

_STD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update({k: v for k, v in vars(record).items() if k not in _STD})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        extra = " ".join(f"{k}={v}" for k, v in vars(record).items() if k not in _STD)
        base = f"{self.formatTime(record)} {record.levelname:7s} {record.name}: {record.getMessage()}"
        text = f"{base} {extra}".rstrip()
        return text + ("\n" + self.formatException(record.exc_info) if record.exc_info else "")


def setup_logging(level: str = "INFO", fmt: str = "json") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
