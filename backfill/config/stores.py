"""Where Backfill keeps its state: the Postgres that is the source of truth, the Redis of the
ledger, Celery's broker, and the key prefix that keeps deployments sharing a Redis apart."""

from __future__ import annotations

from typing import Self

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from backfill.redis_client import SERVER_SCHEMES, check_url, is_cluster_url

_PG_SCHEMES = {
    "postgres": "postgresql+psycopg",
    "postgresql": "postgresql+psycopg",
    "postgresql+psycopg": "postgresql+psycopg",
}


def normalise_database_url(url: str) -> str:
    """Return a SQLAlchemy URL for psycopg 3 from any usual spelling of a Postgres DSN."""
    scheme, sep, rest = url.partition("://")
    if not sep or not rest:
        raise ValueError(f"not a URL (expected postgresql://user@host:port/db): {url!r}")
    target = _PG_SCHEMES.get(scheme.lower())
    if target is None:
        raise ValueError(
            f"unsupported database scheme {scheme!r}: Backfill needs PostgreSQL (postgresql://...)"
        )
    return f"{target}://{rest}"


def libpq_url(url: str) -> str:
    """The same DSN as plain libpq understands it (for psycopg without SQLAlchemy)."""
    _, _, rest = url.partition("://")
    return f"postgresql://{rest}"


class StoreSettings(BaseModel):
    """The stores every process reaches, checked before anything connects."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    database_url: str = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
    """Postgres (source of truth); `postgres://` and `postgresql://` are read as psycopg 3's"""
    redis_url: str = "redis://127.0.0.1:6379/0"
    """Redis (ledger and Celery broker): one server (`redis://`, `rediss://`, `unix://`), or
    `redis+cluster://host:port[,host:port]` (`rediss+cluster://`) for a Redis Cluster
    ([docs/scaling.md](scaling.md))"""
    broker_url: str | None = None
    """Celery's broker, one Redis server: required when `BACKFILL_REDIS_URL` is a cluster
    (Celery cannot use one)"""
    redis_namespace: str = "bf"
    """key prefix: deployments sharing a Redis stay apart"""

    @field_validator("database_url")
    @classmethod
    def _database_url(cls, value: str) -> str:
        return normalise_database_url(value)

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str) -> str:
        try:
            return check_url(value)
        except ValueError as exc:
            raise ValueError(f"BACKFILL_REDIS_URL {exc}") from None

    @field_validator("broker_url")
    @classmethod
    def _broker_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if is_cluster_url(value) or value.partition("://")[0].lower() not in SERVER_SCHEMES:
            raise ValueError(
                f"BACKFILL_BROKER_URL must name one Redis server (redis://, rediss://, "
                f"unix://): Celery cannot use a Redis Cluster: {value!r}"
            )
        return value

    @property
    def celery_broker_url(self) -> str:
        """Where Celery's messages go: BACKFILL_BROKER_URL, else BACKFILL_REDIS_URL."""
        return self.broker_url or self.redis_url

    @field_validator("redis_namespace")
    @classmethod
    def _namespace(cls, value: str) -> str:
        if not value or not all(c.isalnum() or c in "-_." for c in value):
            raise ValueError("BACKFILL_REDIS_NAMESPACE must be non-empty letters, digits, - _ .")
        return value

    @model_validator(mode="after")
    def _broker_beside_cluster(self) -> Self:
        if is_cluster_url(self.redis_url) and self.broker_url is None:
            raise ValueError(
                "BACKFILL_REDIS_URL names a Redis Cluster, which Celery cannot use as its "
                "broker: set BACKFILL_BROKER_URL to one Redis server (redis://host:port/0)"
            )
        return self
