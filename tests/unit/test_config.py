"""Settings: sane defaults, normalised URLs, unsafe values refused with a clear message."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from backfill.config import Settings, libpq_url, normalise_database_url


def test_defaults_point_at_local_services() -> None:
    s = Settings()
    assert s.database_url.startswith("postgresql+psycopg://")
    assert "127.0.0.1:5432" in s.database_url
    assert s.redis_url.startswith("redis://127.0.0.1:6379")


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("postgres://u@h/db", "postgresql+psycopg://u@h/db"),
        ("postgresql://u@h:5/db", "postgresql+psycopg://u@h:5/db"),
        ("postgresql+psycopg://u@h/db", "postgresql+psycopg://u@h/db"),
    ],
)
def test_database_urls_are_normalised_for_psycopg3(given: str, expected: str) -> None:
    assert normalise_database_url(given) == expected
    assert libpq_url(expected).startswith("postgresql://")


@pytest.mark.parametrize("bad", ["mysql://u@h/db", "not a url", "postgresql://"])
def test_other_databases_are_refused(bad: str) -> None:
    with pytest.raises(ValidationError, match="database"):
        Settings(database_url=bad)


def test_env_variables_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BACKFILL_DATABASE_URL", "postgres://x@y:1/z")
    monkeypatch.setenv("BACKFILL_CLAIM_BATCH_SIZE", "7")
    s = Settings()
    assert s.database_url == "postgresql+psycopg://x@y:1/z"
    assert s.claim_batch_size == 7


def test_heartbeat_must_fit_twice_inside_the_lease() -> None:
    with pytest.raises(ValidationError, match="HEARTBEAT"):
        Settings(lease_ttl_s=10, heartbeat_interval_s=5)


@pytest.mark.parametrize("field", ["lease_ttl_s", "claim_batch_size", "max_file_bytes"])
def test_non_positive_numbers_are_refused(field: str) -> None:
    with pytest.raises(ValidationError):
        Settings(**{field: 0})


def test_redis_url_scheme_is_checked() -> None:
    with pytest.raises(ValidationError, match="REDIS_URL"):
        Settings(redis_url="http://localhost:6379")


def test_namespace_is_checked() -> None:
    with pytest.raises(ValidationError, match="NAMESPACE"):
        Settings(redis_namespace="a b")


def test_the_default_wait_must_fit_the_wait_cap() -> None:
    Settings(gateway_max_wait_s=60, gateway_max_wait_cap_s=60)
    with pytest.raises(ValueError, match="BACKFILL_GATEWAY_MAX_WAIT_CAP_S"):
        Settings(gateway_max_wait_s=61, gateway_max_wait_cap_s=60)


def test_a_webhook_sealing_key_that_is_no_key_is_refused_by_name_and_never_echoed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BACKFILL_WEBHOOKS_SECRET_KEYS", "CHANGE-ME")
    with pytest.raises(ValidationError, match="BACKFILL_WEBHOOKS_SECRET_KEYS: key 1 of 1") as e:
        Settings()
    assert "CHANGE-ME" not in str(e.value)
    monkeypatch.setenv(
        "BACKFILL_WEBHOOKS_SECRET_KEYS", "Ty7q2cU1vJ8mFQ6yQZ2r3oKk0xWm4eHnB5pL9sDaG1c=, x"
    )
    with pytest.raises(ValidationError, match="key 2 of 2"):
        Settings()
    monkeypatch.setenv(
        "BACKFILL_WEBHOOKS_SECRET_KEYS", "Ty7q2cU1vJ8mFQ6yQZ2r3oKk0xWm4eHnB5pL9sDaG1c="
    )
    assert Settings().webhooks_seal_keys == ("Ty7q2cU1vJ8mFQ6yQZ2r3oKk0xWm4eHnB5pL9sDaG1c=",)
