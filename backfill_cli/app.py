"""The ``backfill`` command: serve the API, migrate the database, manage tenants.

Each layer is imported inside the commands that run it (FastAPI and uvicorn in ``api``,
Celery in ``worker`` and ``beat``, the dev kit (``devkit``) in ``dev``; the settings and
Redis's client in the commands that run a service), so every other command stays fast and
works without them. Every failure is one line on stderr and a non-zero exit,
never a traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer
from rich.console import Console

from backfill import logs
from backfill.errors import BackfillError, Conflict, NotFound
from backfill_cli import capacity_commands, client_commands, summary_commands, webhook_commands

if TYPE_CHECKING:
    from backfill.config import Settings

app = typer.Typer(
    help="Backfill: a batch LLM job queue that fills the KV-cache slack interactive traffic "
    "leaves free.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
tenants_app = typer.Typer(help="Tenants and their API keys.", no_args_is_help=True)
app.add_typer(tenants_app, name="tenants")
# The tenant's commands (submit, status, results, ...) talk to the API over HTTP.
client_commands.register(app)
summary_commands.register(app)
webhook_commands.register(app)
# Capacity planning and the simulator: pure computation, no services.
capacity_commands.register(app)

out = Console(highlight=False)

T = TypeVar("T")


class CommandFailed(Exception):
    """A command's expected failure, reported as one line."""


def _settings() -> Settings:
    # The settings (pydantic-settings, Redis's client through their URL checks) load only
    # for the commands that run a service: a client command starts without them.
    from pydantic import ValidationError  # noqa: PLC0415

    from backfill.config import Settings  # noqa: PLC0415

    try:
        return Settings()
    except ValidationError as exc:
        first = exc.errors()[0]
        message = str(first["msg"]).removeprefix("Value error, ")
        if first["loc"]:
            name = "BACKFILL_" + "_".join(str(p) for p in first["loc"]).upper()
            message = f"{name}: {message}"
        raise CommandFailed(f"invalid settings: {message}") from exc


def _run(action: Callable[[], T]) -> T:
    try:
        return action()
    except CommandFailed:
        raise
    except Conflict as exc:
        raise CommandFailed(f"conflict: {_first_line(exc)}") from exc
    except NotFound as exc:
        raise CommandFailed(_first_line(exc)) from exc
    except BackfillError as exc:
        raise CommandFailed(_first_line(exc)) from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@app.command()
def api(
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    workers: Annotated[int, typer.Option(help="Server processes.")] = 1,
) -> None:
    """Serve the OpenAI-compatible Batch API (uvicorn)."""
    settings = _settings()
    import uvicorn  # noqa: PLC0415 - the web stack loads only for this command

    uvicorn.run(
        "queue_api.app:served_app",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        log_config=logs.uvicorn_config(settings.log_level, settings.log_format),
    )


@app.command()
def migrate() -> None:
    """Bring the database schema to the latest version."""
    settings = _settings()
    from migrations.migrate import (  # noqa: PLC0415 - alembic loads only here
        current_revision,
        head_revision,
        upgrade,
    )

    try:
        before = current_revision(settings.database_url)
        upgrade(settings.database_url)
    except Exception as exc:  # alembic and the driver raise many types; one line for all
        raise CommandFailed(f"migration failed: {_first_line(exc)}") from exc
    head = head_revision()
    if before == head:
        out.print(f"database schema already at the latest version ({head}): nothing to do")
    else:
        out.print(f"database schema migrated from {before or 'empty'} to {head}")


WeightOpt = Annotated[
    float,
    typer.Option(
        help="Share of each node's batch capacity relative to the other tenants with work "
        "(2 gets twice what 1 does; an idle tenant's share goes to the others).",
    ),
]


@tenants_app.command("create")
def tenants_create(
    name: Annotated[str, typer.Argument(help="A unique tenant name.")],
    quota: Annotated[
        int | None,
        typer.Option(min=1, help="Enqueued-token quota (prompt + max output of unfinished work)."),
    ] = None,
    weight: WeightOpt = 1.0,
) -> None:
    """Create a tenant and its first API key; the key is printed once, on the last line."""
    from backfill.store import Repository, key_id  # noqa: PLC0415

    repo = Repository.connect(_settings().database_url, pool_size=1)
    try:
        try:
            tenant = _run(lambda: repo.tenants.create_tenant(name, quota, weight=weight))
        except CommandFailed as exc:
            if str(exc).startswith("conflict"):
                raise CommandFailed(f"a tenant named {name!r} already exists") from exc
            raise
        key = _run(lambda: repo.tenants.create_api_key(tenant.id))
    finally:
        repo.close()
    quota_text = "unlimited" if quota is None else f"{quota} tokens"
    out.print(
        f"tenant {tenant.name} ({tenant.id}), enqueued-token quota: {quota_text}, "
        f"weight {tenant.weight:g}"
    )
    out.print(f"key id {key_id(key)} (names the key in `tenants keys` and `tenants revoke-key`)")
    out.print("API key (shown only now; store it safely):")
    # Plain print: no wrapping or markup may touch the key, and it must be the last line.
    print(key)


@tenants_app.command("set-weight")
def tenants_set_weight(
    name: Annotated[str, typer.Argument(help="The tenant's name.")],
    weight: Annotated[float, typer.Argument(help="Its new weight (> 0; tenants start at 1).")],
) -> None:
    """Change a tenant's share of each node's batch capacity; claims follow it at once."""
    from backfill.store import Repository  # noqa: PLC0415

    repo = Repository.connect(_settings().database_url, pool_size=1)
    try:
        tenant = _run(lambda: repo.tenants.set_tenant_weight(name, weight))
    finally:
        repo.close()
    out.print(f"tenant {tenant.name} ({tenant.id}): weight {tenant.weight:g}")


@tenants_app.command("keys")
def tenants_keys(name: Annotated[str, typer.Argument(help="The tenant's name.")]) -> None:
    """List a tenant's API keys by id (the keys themselves are not kept)."""
    from backfill.store import Repository  # noqa: PLC0415

    repo = Repository.connect(_settings().database_url, pool_size=1)
    try:
        tenant = _run(lambda: repo.tenants.tenant_by_name(name))
        keys = _run(lambda: repo.tenants.api_keys(tenant.id))
    finally:
        repo.close()
    for record in keys:
        created = record.created_at.isoformat(timespec="seconds")
        state = (
            "live"
            if record.revoked_at is None
            else f"revoked {record.revoked_at.isoformat(timespec='seconds')}"
        )
        out.print(f"{record.key_id}  created {created}  {state}")


@tenants_app.command("revoke-key")
def tenants_revoke_key(
    key: Annotated[str, typer.Argument(help="The API key, or its id (its first 11 characters).")],
) -> None:
    """Revoke an API key: every API process that hears of it through Redis stops accepting
    it at once; one cut off from Redis, within BACKFILL_API_KEY_CACHE_S."""
    import redis  # noqa: PLC0415

    from backfill.keycache import announce_revocation  # noqa: PLC0415
    from backfill.redis_client import connect  # noqa: PLC0415
    from backfill.store import Repository  # noqa: PLC0415

    settings = _settings()
    repo = Repository.connect(settings.database_url, pool_size=1)
    try:
        revoked = _run(lambda: repo.tenants.revoke_api_key(key.rstrip(".")))
    finally:
        repo.close()
    out.print(f"revoked key {revoked.key_id}... of tenant {revoked.tenant}")
    within = f"within {settings.api_key_cache_s:g} s (BACKFILL_API_KEY_CACHE_S)"
    client = connect(settings.redis_url, socket_timeout=2, socket_connect_timeout=2)
    try:
        listeners = announce_revocation(client, settings.redis_namespace, [revoked.digest])
    except redis.RedisError as exc:
        reason = _first_line(exc)
        out.print(f"Redis unreachable ({reason}): API processes stop accepting it {within}")
        return
    finally:
        client.close()
    out.print(
        f"{listeners} API process(es) heard it and stopped accepting it at once; any "
        f"other (cut off from Redis just now) stops {within}"
    )


@app.command()
def worker(
    node: Annotated[str, typer.Option(help="This GPU node's name (one worker per engine).")],
    engine_url: Annotated[
        str, typer.Option(help="The node's vLLM server, e.g. http://127.0.0.1:8001.")
    ],
    beat: Annotated[
        bool, typer.Option(help="Also schedule maintenance (one per deployment; dev mode).")
    ] = False,
    scheduler_metrics_url: Annotated[
        str | None,
        typer.Option(
            help="Where the engine's step scheduler serves its metrics (backfill_vllm, "
            "BACKFILL_SCHED_METRICS_PORT), e.g. http://127.0.0.1:8101/metrics; default "
            "BACKFILL_ENGINE_SCHEDULER_METRICS_URL."
        ),
    ] = None,
) -> None:
    """Feed a node's vLLM engine from its batch slack (a Celery worker with the dispatcher)."""
    settings = _settings()
    if not engine_url.startswith(("http://", "https://")):
        raise CommandFailed(f"--engine-url must be an http(s) URL, got {engine_url!r}")
    if scheduler_metrics_url is not None:
        if not scheduler_metrics_url.startswith(("http://", "https://")):
            raise CommandFailed(
                f"--scheduler-metrics-url must be an http(s) URL, got {scheduler_metrics_url!r}"
            )
        settings = settings.model_copy(
            update={"engine_scheduler_metrics_url": scheduler_metrics_url}
        )
    from worker.run import run_worker  # noqa: PLC0415 - Celery loads only for this command

    run_worker(settings, node, engine_url, beat=beat)


@app.command()
def ingest() -> None:
    """Check and store the files of large batch creates (deferred by the API), until stopped.
    Run any number beside the API; each reads one batch's file at a time (while it stores the
    one before), tenants in turn."""
    settings = _settings()
    from backfill import ingester  # noqa: PLC0415 - the store loads only for this command

    out.print("ingesting deferred batch creates (Ctrl-C to stop)")
    ingester.serve(settings)


@app.command("beat")
def beat_command() -> None:
    """Schedule the periodic maintenance (reap, rebuild, expire, finalize): run exactly one."""
    settings = _settings()
    from worker.run import run_beat  # noqa: PLC0415 - Celery loads only for this command

    run_beat(settings)


class DevServices(StrEnum):
    """Where ``backfill dev`` gets PostgreSQL and Redis."""

    AUTO = "auto"
    """Embedded servers for whichever of BACKFILL_DATABASE_URL / BACKFILL_REDIS_URL is unset."""
    EMBEDDED = "embedded"
    """Embedded servers (from the ``embedded`` extra's wheels) for both."""
    EXTERNAL = "external"
    """The configured servers (the settings' defaults when the variables are unset)."""


@app.command()
def dev(
    model: Annotated[
        str,
        typer.Option(
            help="tiny (gibberish, fast), smollm2 (real), or tiny-embed (an embeddings batch)."
        ),
    ] = "smollm2",
    port: Annotated[int, typer.Option(help="API port.")] = 8000,
    max_tokens: Annotated[int, typer.Option(min=1, help="Summary length cap.")] = 96,
    services: Annotated[
        DevServices,
        typer.Option(
            help="PostgreSQL and Redis: auto (embedded ones, from wheels, unless "
            "BACKFILL_DATABASE_URL / BACKFILL_REDIS_URL are set), embedded, or external "
            "(the configured servers)."
        ),
    ] = DevServices.AUTO,
    backfill_scheduler: Annotated[
        bool,
        typer.Option(
            help="Run the engine with Backfill's step scheduler (backfill_vllm: batch pauses "
            "in the steps interactive work needs); --no-backfill-scheduler: vLLM's own."
        ),
    ] = True,
    stay: Annotated[
        bool | None,
        typer.Option(
            "--stay/--no-stay",
            help="After the job, keep the API, worker and engine up until Ctrl-C (printing "
            "the dashboard, CLI and SDK lines that work against them), or stop them and end. "
            "Default: stay when run from a terminal.",
        ),
    ] = None,
) -> None:
    """Run everything on this machine and a real bulk summarisation job end to end."""
    settings = _settings()
    try:
        from devkit.dev import DevOptions, run_dev  # noqa: PLC0415 - the dev kit loads only here
    except ModuleNotFoundError as exc:
        if exc.name != "devkit":
            raise
        # The production image (Dockerfile) leaves devkit out; a checkout and the wheel have it.
        raise CommandFailed(
            "this installation has no devkit package: run it from a checkout or the wheel"
        ) from exc

    options = DevOptions(
        model=model,
        port=port,
        max_tokens=max_tokens,
        services=services.value,
        scheduler=backfill_scheduler,
        stay=stay,
    )
    code = run_dev(settings, options)
    raise typer.Exit(code)


def main() -> None:
    """The console script's entry point."""
    try:
        app()
    except CommandFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
