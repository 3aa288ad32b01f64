"""The tenant's commands of ``backfill``: submit, status, results, cancel, list, capacity.

They talk to a running API over HTTP (:mod:`backfill_cli.api_client`), never to Postgres or
Redis, so they work from any machine that can reach the API with a key. A failure is one
line on stderr and exit code 1; Ctrl-C during ``--watch`` exits 130 without a traceback.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, ParamSpec, TypeVar

import typer
from rich import box
from rich.console import Console, Group, RenderableType
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from backfill_cli.api_client import DEFAULT_API_URL, ApiClient, ApiError, summarisation_lines
from backfill_cli.watch import watch

P = ParamSpec("P")
R = TypeVar("R")

TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})
ITEM_STATES = (
    "queued",
    "deferred",
    "reserved",
    "running",
    "preempted",
    "succeeded",
    "failed",
    "expired",
    "cancelled",
)
RESULT_STATES = ("succeeded", "failed", "expired", "cancelled")
SUMMARY_PROMPT = (
    "Summarise the following document in two or three sentences. Say what it is and what "
    "it says.\n\n{text}"
)

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)

ApiOpt = Annotated[
    str,
    typer.Option("--api", envvar="BACKFILL_API_URL", help="The API's base URL."),
]
KeyOpt = Annotated[
    str | None,
    typer.Option(
        "--key", envvar="BACKFILL_API_KEY", help="The tenant's API key.", show_default=False
    ),
]
WatchOpt = Annotated[bool, typer.Option("--watch", "-w", help="Keep refreshing until Ctrl-C.")]
IntervalOpt = Annotated[float, typer.Option(min=0.1, help="Seconds between refreshes.")]


def _fail(message: str, code: int = 1) -> typer.Exit:
    err.print(f"error: {message}", soft_wrap=True, markup=False)
    return typer.Exit(code)


def one_line_errors(command: Callable[P, R]) -> Callable[P, R]:
    """Turns the failures a tenant can cause or meet into one line and a non-zero exit."""

    @functools.wraps(command)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return command(*args, **kwargs)
        except ApiError as exc:
            raise _fail(str(exc)) from None
        except OSError as exc:
            raise _fail(f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": ")) from None
        except KeyboardInterrupt:
            raise typer.Exit(130) from None

    return wrapper


def _client(api: str, key: str | None) -> ApiClient:
    if not key:
        raise ApiError("no API key: pass --key or set BACKFILL_API_KEY")
    return ApiClient(api, key)


# ---------------------------------------------------------------------------------------------
# Rendering


def _ago_or_in(at: int | None, now: float) -> str:
    if at is None:
        return "-"
    delta = int(at - now)
    span = _duration(abs(delta))
    return f"in {span}" if delta >= 0 else f"{span} ago"


def _duration(seconds: int) -> str:
    if seconds < 90:
        return f"{seconds}s"
    if seconds < 90 * 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m"


def _done_total(batch: dict[str, Any]) -> tuple[int, int]:
    counts = batch.get("request_counts") or {}
    done = int(counts.get("completed", 0)) + int(counts.get("failed", 0))
    return done, int(counts.get("total", 0))


def progress_head(
    shown: dict[str, Any], model: object, done: int, total: int, what: str
) -> tuple[Text, Table]:
    """A batch's or a summary job's first two lines: its id, status and model; a bar of
    ``done`` of ``total`` (``what``: the unit and what finishing means)."""
    header = Text.assemble(
        (str(shown.get("id")), "bold"),
        "  ",
        (str(shown.get("status")), "cyan"),
        f"  model {model}",
    )
    bar = Table.grid(padding=(0, 1))
    bar.add_row(
        ProgressBar(total=max(total, 1), completed=done, width=40),
        f"{done}/{total} {what}",
    )
    return header, bar


def render_status(batch: dict[str, Any], now: float | None = None) -> RenderableType:
    """A batch's progress: a bar, items by state, tokens, ETA and deadline."""
    now = time.time() if now is None else now
    extra = batch.get("backfill") or {}
    done, total = _done_total(batch)
    model = extra.get("model") or batch.get("model") or "-"
    header, bar = progress_head(batch, model, done, total, "items finished")
    items = extra.get("items") or {}
    states = Table(box=None, show_header=True, header_style="bold", pad_edge=False)
    shown = [s for s in ITEM_STATES if items.get(s)] or ["queued"]
    for state in shown:
        states.add_column(state, justify="right")
    states.add_row(*(str(items.get(s, 0)) for s in shown))
    tokens = extra.get("tokens") or {}
    facts = Table.grid(padding=(0, 2))
    facts.add_row("output tokens", f"{tokens.get('done', 0)} of at most {tokens.get('total', 0)}")
    facts.add_row("prompt tokens", str(tokens.get("prompt", 0)))
    eta = extra.get("eta")
    basis = f" ({extra['eta_basis']})" if extra.get("eta_basis") else ""
    risk = "  [red]past the deadline[/]" if extra.get("at_risk") else ""
    facts.add_row("ETA", Text.from_markup(f"{_ago_or_in(eta, now)}{basis}{risk}"))
    facts.add_row("deadline", _ago_or_in(extra.get("deadline"), now))
    for name in ("output_file_id", "error_file_id"):
        if batch.get(name):
            facts.add_row(name.removesuffix("_id").replace("_", " "), str(batch[name]))
    return Group(header, bar, states, facts)


def _pool_bar(node: dict[str, Any], width: int = 16) -> Text:
    capacity = max(int(node.get("capacity_tokens") or 0), 1)
    interactive = int(node.get("interactive_in_use") or 0)
    batch = int(node.get("batch_in_use") or node.get("batch_reserved_tokens") or 0)
    slack = int(node.get("slack_tokens") or 0)
    parts = [(interactive, "magenta"), (batch, "cyan"), (slack, "green")]
    bar = Text()
    used = 0
    for tokens, style in parts:
        cells = round(width * min(tokens, capacity) / capacity)
        cells = min(cells, width - used)
        bar.append("█" * cells, style=style)
        used += cells
    bar.append("░" * (width - used), style="grey50")
    return bar


def render_capacity(report: dict[str, Any]) -> RenderableType:
    """Each node's pool: who holds it and what batch may still take."""
    table = Table(
        title="KV pools (tokens)",
        title_justify="left",
        header_style="bold",
        box=box.SIMPLE_HEAD,
    )
    for column in ("node", "pool", "reserve", "interactive", "batch", "slack", "use"):
        table.add_column(
            column, justify="right" if column not in ("node", "use") else "left", no_wrap=True
        )

    def fmt(value: Any) -> str:
        return "-" if value is None else f"{int(value):,}"

    for node in report.get("nodes") or []:
        # Without the ledger only Postgres's figures exist: no live interactive use.
        mark = "*" if node.get("source") == "postgres" else ""
        table.add_row(
            f"{node.get('name')}{mark}",
            fmt(node.get("capacity_tokens")),
            fmt(node.get("interactive_reserve_tokens")),
            fmt(node.get("interactive_in_use")),
            fmt(
                node["batch_in_use"]
                if node.get("batch_in_use") is not None
                else node.get("batch_reserved_tokens")
            ),
            fmt(node.get("slack_tokens")),
            _pool_bar(node),
        )
    queued = report.get("queued_tokens") or {}
    footer = Text.assemble(
        "use: ",
        ("█", "magenta"),
        " interactive ",
        ("█", "cyan"),
        " batch ",
        ("█", "green"),
        " slack ",
        ("░", "grey50"),
        " held back",
        "   (* no live ledger figures: Postgres's view)\n",
        "queued work (worst-case tokens): ",
        ", ".join(f"{cls} {int(n):,}" for cls, n in sorted(queued.items())),
    )
    if not report.get("nodes"):
        return Group(Text("no nodes have registered yet"), footer)
    engines = [
        f"{node.get('name')}: {sched.get('name')} pauses batch for interactive work "
        f"({int(sched.get('paused_steps') or 0):,} steps paused, longest pause "
        f"{float(sched.get('longest_pause_s') or 0):.2f} s)"
        for node in report.get("nodes") or []
        if (sched := node.get("engine_scheduler"))
    ]
    if engines:
        return Group(table, footer, Text("\n".join(["engine step scheduler:", *engines])))
    return Group(table, footer)


def render_list(page: dict[str, Any], now: float | None = None) -> RenderableType:
    now = time.time() if now is None else now
    table = Table(header_style="bold")
    for column in ("id", "status", "progress", "items", "created", "ETA", "deadline"):
        table.add_column(column)
    for batch in page.get("data") or []:
        done, total = _done_total(batch)
        extra = batch.get("backfill") or {}
        created = datetime.fromtimestamp(int(batch.get("created_at", 0)), UTC)
        table.add_row(
            str(batch.get("id")),
            str(batch.get("status")),
            ProgressBar(total=max(total, 1), completed=done, width=16),
            f"{done}/{total}",
            created.strftime("%Y-%m-%d %H:%M"),
            _ago_or_in(extra.get("eta"), now),
            _ago_or_in(extra.get("deadline"), now),
        )
    return table


def _watch(
    fetch: Callable[[], dict[str, Any]],
    render: Callable[[dict[str, Any]], RenderableType],
    interval: float,
) -> None:
    """Show ``render`` of what ``fetch`` answers until it has a terminal status (or Ctrl-C):
    redrawn in place on a terminal, each new reading printed elsewhere (``watch``)."""
    watch(out, fetch, render, interval, TERMINAL)


# ---------------------------------------------------------------------------------------------
# Commands


def _endpoint_of(content: bytes) -> str:
    for raw in content.splitlines():
        if raw.strip():
            try:
                url = json.loads(raw).get("url")
            except (ValueError, AttributeError):
                return "/v1/chat/completions"  # the API's validation names the bad line
            return str(url or "/v1/chat/completions")
    raise ApiError("the input file has no requests")


@one_line_errors
def submit(
    path: Annotated[
        Path,
        typer.Argument(
            help="An OpenAI batch JSONL file, or a folder of .txt documents to summarise.",
            show_default=False,
        ),
    ],
    api: ApiOpt = DEFAULT_API_URL,
    key: KeyOpt = None,
    window: Annotated[str, typer.Option(help="Completion window, e.g. 30m, 2h, 24h, 7d.")] = "24h",
    model: Annotated[
        str | None, typer.Option(help="Model for a folder of documents.", show_default=False)
    ] = None,
    max_tokens: Annotated[int, typer.Option(min=1, help="Summary length cap (folder).")] = 256,
    prompt: Annotated[
        str, typer.Option(help="Prompt for each document (folder); {text} is the document.")
    ] = SUMMARY_PROMPT,
    endpoint: Annotated[
        str | None,
        typer.Option(help="Batch endpoint (default: the first request's url).", show_default=False),
    ] = None,
    idempotency_key: Annotated[
        str | None,
        typer.Option(help="Makes a retried submit create one batch only.", show_default=False),
    ] = None,
) -> None:
    """Upload a batch and create it; prints the batch id on stdout."""
    if path.is_dir():
        if not model:
            raise ApiError("a folder of documents needs --model")
        docs = sorted(path.glob("*.txt"))
        if not docs:
            raise ApiError(f"no .txt documents in {path}")
        documents = [(doc.stem, doc.read_text(encoding="utf-8", errors="replace")) for doc in docs]
        content = summarisation_lines(documents, model, max_tokens, prompt)
        filename = f"{path.name or 'documents'}.jsonl"
    else:
        content = path.read_bytes()
        filename = path.name
    with _client(api, key) as client:
        uploaded = client.upload_file(filename, content)
        batch = client.create_batch(
            str(uploaded["id"]),
            endpoint or _endpoint_of(content),
            window,
            idempotency_key=idempotency_key,
        )
    _, total = _done_total(batch)
    err.print(
        f"batch {batch['id']}: {total} requests, {batch['status']}, window {window}",
        markup=False,
    )
    # Plain print: the id alone on stdout, so `BATCH=$(backfill submit ...)` works.
    print(batch["id"])


@one_line_errors
def status(
    batch_id: Annotated[str, typer.Argument(metavar="BATCH", help="The batch id.")],
    api: ApiOpt = DEFAULT_API_URL,
    key: KeyOpt = None,
    watch: WatchOpt = False,
    interval: IntervalOpt = 1.0,
) -> None:
    """A batch's progress: items by state, tokens, ETA (live with --watch); for a summary
    job, its documents, steps and ETA."""
    from backfill_cli import summary_commands as summaries  # noqa: PLC0415 (a cycle)

    with _client(api, key) as client:
        if summaries.is_summary_job(batch_id):
            if watch:
                summaries.watch_summary(client, batch_id, interval)
            else:
                out.print(summaries.render_summary_status(client.summary_job(batch_id)))
            return
        if not watch:
            out.print(render_status(client.batch(batch_id)))
            return
        _watch(lambda: client.batch(batch_id), render_status, interval)


@one_line_errors
def results(
    batch_id: Annotated[str, typer.Argument(metavar="BATCH", help="The batch id.")],
    api: ApiOpt = DEFAULT_API_URL,
    key: KeyOpt = None,
    state: Annotated[
        list[str] | None,
        typer.Option(
            "--state",
            help="Only these finished states (repeatable): succeeded, failed, expired, cancelled.",
            show_default=False,
        ),
    ] = None,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output", "-o", help="Write to this file instead of stdout.", show_default=False
        ),
    ] = None,
) -> None:
    """Stream a batch's finished results as JSONL (while it runs, too); a summary job's
    rows (ids, summaries, usage, split depth, errors) into -o FILE.parquet, .csv or .jsonl."""
    from backfill_cli import summary_commands as summaries  # noqa: PLC0415 (a cycle)

    if summaries.is_summary_job(batch_id):
        if output is None:
            raise ApiError(
                "a summary job's results go into a file: -o out.parquet (or .csv, .jsonl)"
            )
        with _client(api, key) as client:
            rows = summaries.write_summary_results(client, batch_id, output)
        err.print(f"{rows} rows written to {output}", markup=False)
        return
    wanted = [s.strip() for value in state or [] for s in value.split(",") if s.strip()]
    unknown = sorted(set(wanted) - set(RESULT_STATES))
    if unknown:
        raise ApiError(f"--state must be one of {', '.join(RESULT_STATES)}; got {unknown[0]!r}")
    with _client(api, key) as client:
        count = 0
        if output is None:
            sink = sys.stdout.buffer
            for line in client.results(batch_id, wanted):
                sink.write(line)
                count += 1
            sink.flush()
            return
        partial = output.with_name(output.name + ".part")
        with partial.open("wb") as sink:
            for line in client.results(batch_id, wanted):
                sink.write(line)
                count += 1
        # A file that exists is complete: a dropped stream leaves only the .part behind.
        partial.replace(output)
    err.print(f"{count} results written to {output}", markup=False)


@one_line_errors
def cancel(
    batch_id: Annotated[str, typer.Argument(metavar="BATCH", help="The batch id.")],
    api: ApiOpt = DEFAULT_API_URL,
    key: KeyOpt = None,
) -> None:
    """Cancel a batch (or a summary job): unfinished items stop; finished results are kept."""
    from backfill_cli import summary_commands as summaries  # noqa: PLC0415 (a cycle)

    with _client(api, key) as client:
        batch = (
            client.cancel_summary_job(batch_id)
            if summaries.is_summary_job(batch_id)
            else client.cancel(batch_id)
        )
    out.print(f"{batch['id']} {batch['status']}")


@one_line_errors
def list_command(
    api: ApiOpt = DEFAULT_API_URL,
    key: KeyOpt = None,
    limit: Annotated[int, typer.Option(min=1, max=100, help="Batches to show.")] = 20,
    after: Annotated[
        str | None, typer.Option(help="Show batches after this id.", show_default=False)
    ] = None,
) -> None:
    """The tenant's batches, newest first, with their progress."""
    with _client(api, key) as client:
        page = client.list_batches(limit, after)
    if not page.get("data"):
        out.print("no batches")
        return
    out.print(render_list(page))
    if page.get("has_more"):
        out.print(f"more: backfill list --after {page.get('last_id')}")


@one_line_errors
def capacity(
    api: ApiOpt = DEFAULT_API_URL,
    key: KeyOpt = None,
    watch: WatchOpt = False,
    interval: IntervalOpt = 1.0,
) -> None:
    """Each node's KV pool: interactive and batch in use, and the slack batch may take."""
    with _client(api, key) as client:
        if not watch:
            out.print(render_capacity(client.capacity()))
            return
        _watch(client.capacity, render_capacity, interval)  # no status: until Ctrl-C


def register(app: typer.Typer) -> None:
    """Adds the tenant's commands to the ``backfill`` command."""
    app.command()(submit)
    app.command()(status)
    app.command()(results)
    app.command()(cancel)
    app.command("list")(list_command)
    app.command()(capacity)
