"""How every Backfill process writes its log lines (`backfill.logs` sets them up)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator


class LogSettings(BaseModel):
    """The level and the shape of Backfill's log lines."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """level of Backfill's loggers (DEBUG, INFO, WARNING, ERROR) in every process"""
    log_format: Literal["text", "json"] = "text"
    """`text`: one human line; `json`: one JSON object a line (`ts`, `level`, `logger`,
    `message`, and the event's `action`, `node`, `job`, `item`, `attempt`, `lease`, `tenant`),
    uvicorn's and Celery's lines included"""

    @field_validator("log_level", mode="before")
    @classmethod
    def _log_level(cls, value: object) -> object:
        return value.strip().upper() if isinstance(value, str) else value
