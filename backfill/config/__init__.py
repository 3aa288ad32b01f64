"""Settings, read once from the environment (prefix ``BACKFILL_``).

Defaults point at the local services every developer and CI machine runs. A malformed or
unsafe value refuses to start with a message that names the variable and what is wrong,
rather than failing later in a worker with a stack trace.

Each module here owns the settings of one part of Backfill, with the checks that tie them
together (a lease and its heartbeat, a wait and its cap); :class:`Settings` is all of them in
one flat model, so every variable keeps its one name, ``BACKFILL_`` and the field's.
"""

from __future__ import annotations

from functools import lru_cache

from pydantic_settings import BaseSettings, SettingsConfigDict

from backfill.config.api import ApiSettings
from backfill.config.batch_lines import BatchLineSettings
from backfill.config.engine_feed import EngineFeedSettings
from backfill.config.gateway import GatewaySettings
from backfill.config.intake import IntakeSettings
from backfill.config.logs import LogSettings
from backfill.config.queue import QueueSettings
from backfill.config.stores import StoreSettings, libpq_url, normalise_database_url
from backfill.config.webhooks import WebhookSettings
from backfill.config.work_budget import WorkBudgetSettings

__all__ = ["Settings", "get_settings", "libpq_url", "normalise_database_url"]


class Settings(
    # pydantic orders the fields from the last base to the first: this is the order of
    # docs/configuration.md, read upwards (stores first, webhooks last).
    WebhookSettings,
    WorkBudgetSettings,
    GatewaySettings,
    ApiSettings,
    BatchLineSettings,
    EngineFeedSettings,
    IntakeSettings,
    QueueSettings,
    LogSettings,
    StoreSettings,
    BaseSettings,
):
    """Everything a Backfill process can be told from outside."""

    # A bad value is named in the error, never echoed: some hold passwords and keys.
    # Each field's docstring is its meaning on docs/configuration.md (`python -m
    # devkit.config_doc` writes the page from them).
    model_config = SettingsConfigDict(
        env_prefix="BACKFILL_",
        extra="ignore",
        hide_input_in_errors=True,
        use_attribute_docstrings=True,
    )


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings (read once)."""
    return Settings()
