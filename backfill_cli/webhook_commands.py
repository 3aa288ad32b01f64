"""``backfill webhooks``: the tenant's webhook endpoints and their delivery log, over the API.

``add`` prints the endpoint's signing secret once, alone on the last line (as ``tenants
create`` prints a key), so ``SECRET=$(backfill webhooks add URL | tail -1)`` works.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Annotated, Any

import typer
from rich.table import Table

from backfill_cli.api_client import DEFAULT_API_URL
from backfill_cli.client_commands import ApiOpt, KeyOpt, _ago_or_in, _client, one_line_errors, out

EVENT_TYPES = ("batch.completed", "batch.failed", "batch.expired", "batch.cancelled")

webhooks_app = typer.Typer(
    help="Webhook endpoints that hear when your batches end (signed as OpenAI signs them).",
    no_args_is_help=True,
)


def _when(at: int | None) -> str:
    if at is None:
        return "-"
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M:%S")


@webhooks_app.command("add")
@one_line_errors
def add(
    url: Annotated[str, typer.Argument(help="The http(s) URL that receives events.")],
    events: Annotated[
        list[str] | None,
        typer.Option(
            "--events",
            help=f"Event types (repeatable, or comma-separated): {', '.join(EVENT_TYPES)}; "
            "default all.",
            show_default=False,
        ),
    ] = None,
    name: Annotated[
        str | None, typer.Option(help="A name for the endpoint (default: its URL).")
    ] = None,
    api: ApiOpt = DEFAULT_API_URL,
    key: KeyOpt = None,
) -> None:
    """Add an endpoint; its signing secret is printed once, on the last line."""
    wanted = [e.strip() for value in events or [] for e in value.split(",") if e.strip()]
    with _client(api, key) as client:
        endpoint = client.create_webhook_endpoint(url, wanted or None, name)
    out.print(
        f"webhook endpoint {endpoint['id']} -> {endpoint['url']} "
        f"({', '.join(endpoint.get('event_types') or [])})",
        soft_wrap=True,
        markup=False,
    )
    out.print("signing secret (shown only now; verify with openai's client.webhooks.unwrap):")
    # Plain print: nothing may wrap or mark up the secret, and it must be the last line.
    print(endpoint["signing_secret"])


@webhooks_app.command("list")
@one_line_errors
def list_endpoints(api: ApiOpt = DEFAULT_API_URL, key: KeyOpt = None) -> None:
    """The tenant's endpoints, newest first."""
    with _client(api, key) as client:
        page = client.webhook_endpoints()
    if not page.get("data"):
        out.print("no webhook endpoints")
        return
    table = Table(header_style="bold")
    for column in ("id", "url", "events", "secret", "created"):
        table.add_column(column, overflow="fold")
    for endpoint in page["data"]:
        table.add_row(
            str(endpoint.get("id")),
            str(endpoint.get("url")),
            ", ".join(endpoint.get("event_types") or []),
            str(endpoint.get("signing_secret_hint") or "-"),
            _when(endpoint.get("created_at")),
        )
    out.print(table)


@webhooks_app.command("remove")
@one_line_errors
def remove(
    endpoint_id: Annotated[str, typer.Argument(metavar="ENDPOINT", help="The endpoint id.")],
    api: ApiOpt = DEFAULT_API_URL,
    key: KeyOpt = None,
) -> None:
    """Remove an endpoint (and its delivery log); nothing more is sent to it."""
    with _client(api, key) as client:
        client.delete_webhook_endpoint(endpoint_id)
    out.print(f"removed webhook endpoint {endpoint_id}")


def _outcome(delivery: dict[str, Any]) -> str:
    if delivery.get("last_status_code") is not None:
        return f"HTTP {delivery['last_status_code']}"
    return str(delivery.get("last_error") or "-")


@webhooks_app.command("deliveries")
@one_line_errors
def deliveries(
    endpoint: Annotated[
        str | None,
        typer.Option("--endpoint", help="Only this endpoint's.", show_default=False),
    ] = None,
    batch: Annotated[
        str | None, typer.Option("--batch", help="Only this batch's.", show_default=False)
    ] = None,
    limit: Annotated[int, typer.Option(min=1, max=100, help="Deliveries to show.")] = 20,
    api: ApiOpt = DEFAULT_API_URL,
    key: KeyOpt = None,
) -> None:
    """The delivery log, newest first: attempts, the last answer, the next attempt."""
    with _client(api, key) as client:
        page = client.webhook_deliveries(endpoint_id=endpoint, batch_id=batch, limit=limit)
    if not page.get("data"):
        out.print("no deliveries")
        return
    now = time.time()
    table = Table(header_style="bold")
    for column in ("webhook id", "event", "about", "status", "attempts", "last", "next"):
        table.add_column(column, overflow="fold")
    for d in page["data"]:
        table.add_row(
            str(d.get("id")),
            str(d.get("event_type")),
            str(d.get("subject_id") or d.get("batch_id")),
            str(d.get("status")),
            str(d.get("attempts")),
            _outcome(d),
            _ago_or_in(d.get("next_attempt_at"), now),
        )
    out.print(table)


@webhooks_app.command("new-key")
def new_key() -> None:
    """Print a new key for BACKFILL_WEBHOOKS_SECRET_KEYS (seals signing secrets at rest; put
    a new one first to rotate, and drop the old one once the sender has resealed)."""
    from backfill.webhooks import sealing  # noqa: PLC0415 - cryptography loads only here

    print(sealing.new_key())


def register(app: typer.Typer) -> None:
    app.add_typer(webhooks_app, name="webhooks")
