"""Migrations: up from empty, down to base, up again, and no drift from the models."""

from __future__ import annotations

import psycopg
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from backfill.config import libpq_url
from backfill.models import Base
from migrations.migrate import downgrade, upgrade

TABLES = {"tenants", "api_keys", "files", "nodes", "jobs", "job_counters", "items", "attempts"}


def _tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade_round_trip(empty_database_url: str) -> None:
    upgrade(empty_database_url)
    assert _tables(empty_database_url) >= TABLES
    downgrade(empty_database_url)
    assert _tables(empty_database_url) == set()
    upgrade(empty_database_url)
    assert _tables(empty_database_url) >= TABLES


def test_models_and_migrations_do_not_drift(database_url: str) -> None:
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            diff = compare_metadata(ctx, Base.metadata)
    finally:
        engine.dispose()
    assert diff == [], f"models and migrations differ: {diff}"


def test_request_bodies_use_lz4_compression(database_url: str) -> None:
    with psycopg.connect(libpq_url(database_url)) as conn:
        row = conn.execute(
            "SELECT attcompression FROM pg_attribute "
            "WHERE attrelid = 'items'::regclass AND attname = 'body'"
        ).fetchone()
    assert row is not None
    assert row[0] == "l"


def test_file_pieces_are_stored_uncompressed_so_a_line_is_read_alone(database_url: str) -> None:
    # An item's body is a slice of one piece: uncompressed out-of-line storage reads only the
    # TOAST chunks under it, not the whole piece (backfill.store.bodies).
    with psycopg.connect(libpq_url(database_url)) as conn:
        row = conn.execute(
            "SELECT attstorage FROM pg_attribute "
            "WHERE attrelid = 'file_chunks'::regclass AND attname = 'data'"
        ).fetchone()
    assert row is not None
    assert row[0] == "e"


def _attempts_storage(url: str) -> tuple[list[str] | None, set[str]]:
    """The attempts table's storage options and its index names."""
    with psycopg.connect(libpq_url(url)) as conn:
        row = conn.execute("SELECT reloptions FROM pg_class WHERE oid = 'attempts'::regclass")
        options = row.fetchone()
        names = conn.execute("SELECT indexname FROM pg_indexes WHERE tablename = 'attempts'")
        return (options[0] if options else None), {r[0] for r in names}


def test_attempts_pages_leave_room_for_hot_updates_and_downgrade_restores(
    empty_database_url: str,
) -> None:
    upgrade(empty_database_url)
    options, indexes = _attempts_storage(empty_database_url)
    assert options == ["fillfactor=50"]
    assert "ix_attempts_open" not in indexes
    downgrade(empty_database_url, "0009_submit_once")
    options, indexes = _attempts_storage(empty_database_url)
    assert options is None
    assert "ix_attempts_open" in indexes


def test_the_migrate_command_says_what_it_applied_and_when_there_was_nothing_to_do(
    empty_database_url: str,
) -> None:
    """Red before: both runs said "database is at the latest schema version", a new
    database's first run included."""
    from typer.testing import CliRunner  # noqa: PLC0415

    from backfill_cli.app import app  # noqa: PLC0415

    env = {"BACKFILL_DATABASE_URL": empty_database_url}
    first = CliRunner().invoke(app, ["migrate"], env=env)
    again = CliRunner().invoke(app, ["migrate"], env=env)
    assert first.exit_code == 0, first.output
    assert "migrated from empty to " in first.stdout, first.stdout
    assert again.exit_code == 0, again.output
    assert "already at the latest version" in again.stdout, again.stdout
