"""Structured logs: one line per event, message plus key=value fields (or one JSON object).

Modules below the agent (k8s/, model/, datapath/) log with the standard library and pass their
fields as `extra={...}`; they cannot import this module (layering), and do not need to: the
formatter installed here renders every non-standard LogRecord attribute as a field. So a line
such as `invalid Service default/web: spec.ports[0].port: ...` also carries `object=default/web
field=spec.ports[0].port reason=port_out_of_range`, greppable in text and queryable in JSON.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import Any, TextIO

# Attributes every LogRecord has; anything else on a record came from `extra=`.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


def _timestamp(record: logging.LogRecord) -> str:
    stamp = datetime.datetime.fromtimestamp(record.created, tz=datetime.timezone.utc)
    return stamp.strftime("%Y-%m-%dT%H:%M:%S.") + f"{stamp.microsecond // 1000:03d}Z"


def _text_value(value: Any) -> str:
    text = str(value)
    if not text or any(c in text for c in ' ="\n'):
        return json.dumps(text)
    return text


class TextFormatter(logging.Formatter):
    """`2024-05-01T10:00:00.000Z INFO ebpf_proxy.agent.agent: synced full=true services=12`"""

    def format(self, record: logging.LogRecord) -> str:
        parts = [_timestamp(record), record.levelname, f"{record.name}:", record.getMessage()]
        parts += [f"{k}={_text_value(v)}" for k, v in record_fields(record).items()]
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, then the record's fields."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {"ts": _timestamp(record), "level": record.levelname.lower(), "logger": record.name,
                               "msg": record.getMessage()}
        for key, value in record_fields(record).items():
            doc.setdefault(key, value)
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def setup_logging(fmt: str = "text", level: str = "info", stream: TextIO | None = None) -> logging.Handler:
    """Install one handler on the root logger (replacing earlier ones from this function)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler._ebpf_proxy = True  # type: ignore[attr-defined]
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_ebpf_proxy", False)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    # The kubernetes client and urllib3 are chatty at debug; their retries show up in our own logs.
    for noisy in ("urllib3", "kubernetes"):
        logging.getLogger(noisy).setLevel(max(root.level, logging.WARNING))
    return handler
