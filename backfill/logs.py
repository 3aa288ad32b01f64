"""Logs: one configuration for every Backfill process, from the typed settings, and the
structured fields its events carry.

``BACKFILL_LOG_LEVEL`` sets the level of Backfill's own loggers, ``BACKFILL_LOG_FORMAT`` the
form: ``text`` (one human line) or ``json`` (one object a line, for a log pipeline). Events
about the work name it in fields, not only in their message: :func:`fields` builds the
``extra`` of a logging call, e.g.::

    log.info("item %s requeued", item.id, extra=fields("requeue", item=item.id, attempt=2))

and both formats show them (text as ``key=value`` after the message).
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Literal

LogFormat = Literal["text", "json"]

FIELDS = ("action", "node", "job", "item", "attempt", "lease", "tenant")
"""The structured fields an event may carry, in the order text shows them."""

_KEY = "backfill_fields"
_MARK = "_backfill_handler"


def fields(action: str, **values: object) -> dict[str, Any]:
    """The ``extra`` of a logging call for an event: its ``action`` and the ids it is about
    (one of :data:`FIELDS`; None values are left out)."""
    unknown = sorted(set(values) - set(FIELDS))
    if unknown:
        raise ValueError(f"unknown log fields {unknown}; known: {', '.join(FIELDS)}")
    carried = {"action": action, **{k: v for k, v in values.items() if v is not None}}
    return {_KEY: carried}


def _carried(record: logging.LogRecord) -> Mapping[str, Any]:
    value = getattr(record, _KEY, None)
    return value if isinstance(value, Mapping) else {}


class TextFormatter(logging.Formatter):
    """``[time LEVEL logger] message key=value ...``."""

    def __init__(self) -> None:
        super().__init__("[%(asctime)s %(levelname)s %(name)s] %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        carried = _carried(record)
        if not carried:
            return line
        tail = " ".join(f"{k}={carried[k]}" for k in FIELDS if k in carried)
        head, newline, rest = line.partition("\n")  # keep a traceback below the fields
        return f"{head} {tail}{newline}{rest}"


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ``ts`` (UTC, ISO 8601), ``level``, ``logger``, ``message``,
    the event's fields, and ``exc`` with the traceback when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in _carried(record).items():
            out[key] = value if isinstance(value, str | int | float | bool) else str(value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def formatter(form: LogFormat) -> logging.Formatter:
    return JsonFormatter() if form == "json" else TextFormatter()


def configure(level: str = "INFO", form: LogFormat = "text", *, root: bool = False) -> None:
    """Send Backfill's loggers (``backfill`` and below) to stderr at ``level`` in ``form``;
    with ``root`` every other library's records too (a process Backfill owns alone). Calling
    it again replaces what the last call set up, nothing else."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(form))
    setattr(handler, _MARK, True)
    targets = [logging.getLogger("backfill")] + ([logging.getLogger()] if root else [])
    for logger in targets:
        for old in [h for h in logger.handlers if getattr(h, _MARK, False)]:
            logger.removeHandler(old)
        logger.addHandler(handler)
    backfill = logging.getLogger("backfill")
    backfill.setLevel(level.upper())
    backfill.propagate = False  # its own handler: a root handler set by others would repeat it
    if root:
        logging.getLogger().setLevel(logging.WARNING)
    # One line per engine request would drown everything else.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def uvicorn_config(level: str = "INFO", form: LogFormat = "text") -> dict[str, Any]:
    """A ``logging.config.dictConfig`` for a uvicorn server (its ``log_config``, applied in
    every server process): Backfill's loggers and uvicorn's own in one form."""
    cls = f"{__name__}.{'JsonFormatter' if form == 'json' else 'TextFormatter'}"
    handler = {
        "class": "logging.StreamHandler",
        "formatter": "backfill",
        "stream": "ext://sys.stderr",
    }
    quiet = {"level": "WARNING", "handlers": ["backfill"], "propagate": False}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"backfill": {"()": cls}},
        "handlers": {"backfill": handler},
        "loggers": {
            "backfill": {"level": level.upper(), "handlers": ["backfill"], "propagate": False},
            "uvicorn": {"level": level.upper(), "handlers": ["backfill"], "propagate": False},
            "uvicorn.error": {"level": level.upper(), "propagate": True},
            "uvicorn.access": {
                "level": level.upper(),
                "handlers": ["backfill"],
                "propagate": False,
            },
            "httpx": quiet,
        },
    }
