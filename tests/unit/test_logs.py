"""backfill.logs: one configuration from the settings, structured fields in text and JSON."""

from __future__ import annotations

import io
import json
import logging
import logging.config
import sys

import pytest
from pydantic import ValidationError

from backfill import logs
from backfill.config import Settings


def _record(message: str, **extra: object) -> logging.LogRecord:
    record = logging.LogRecord("backfill.worker", logging.INFO, __file__, 1, message, (), None)
    for key, value in extra.items():
        setattr(record, key, value)
    return record


def test_text_lines_carry_the_event_fields_after_the_message() -> None:
    record = _record("item requeued", **logs.fields("requeue", item="it_1", attempt=2, job=None))
    line = logs.TextFormatter().format(record)
    assert line.endswith("item requeued action=requeue item=it_1 attempt=2")
    assert "job=" not in line
    assert logs.TextFormatter().format(_record("plain")).endswith("] plain")


def test_json_lines_are_one_object_with_the_fields_and_the_traceback() -> None:
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        record = logging.LogRecord(
            "backfill.worker", logging.ERROR, __file__, 1, "lost %s", ("n1",), sys.exc_info()
        )
    record.__dict__.update(logs.fields("engine_trouble", node="n1", lease=7))
    out = json.loads(logs.JsonFormatter().format(record))
    assert out["message"] == "lost n1"
    assert out["level"] == "ERROR"
    assert out["logger"] == "backfill.worker"
    assert (out["action"], out["node"], out["lease"]) == ("engine_trouble", "n1", 7)
    assert "RuntimeError: boom" in out["exc"]
    assert out["ts"].endswith("+00:00")


def test_an_unknown_field_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown log fields \\['itme'\\]"):
        logs.fields("start", itme="x")


def test_configure_twice_leaves_one_handler_in_the_new_form(
    capsys: pytest.CaptureFixture[str],
) -> None:
    log = logging.getLogger("backfill")
    before = list(log.handlers)
    try:
        logs.configure("DEBUG", "text")
        logs.configure("INFO", "json")
        ours = [h for h in log.handlers if h not in before]
        assert len(ours) == 1
        assert isinstance(ours[0].formatter, logs.JsonFormatter)
        assert log.level == logging.INFO
        stream = io.StringIO()
        ours[0].setStream(stream)  # type: ignore[attr-defined]
        logging.getLogger("backfill.test").info("hello", extra=logs.fields("probe"))
        assert json.loads(stream.getvalue())["action"] == "probe"
    finally:
        for handler in [h for h in log.handlers if h not in before]:
            log.removeHandler(handler)
        log.propagate = True
        log.setLevel(logging.NOTSET)


def test_uvicorns_config_puts_its_loggers_and_backfills_in_one_form() -> None:
    config = logs.uvicorn_config("warning", "json")
    assert config["formatters"]["backfill"]["()"] == "backfill.logs.JsonFormatter"
    assert config["loggers"]["uvicorn.access"]["level"] == "WARNING"
    assert config["loggers"]["backfill"]["propagate"] is False


def test_the_settings_take_a_level_in_any_case_and_refuse_others() -> None:
    assert Settings(log_level="debug").log_level == "DEBUG"  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        Settings(log_level="loud")  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        Settings(log_format="xml")  # type: ignore[arg-type]
