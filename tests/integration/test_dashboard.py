"""The web dashboard in a real headless Chromium, against a live API with a tenant's key.

Chromium loads ``/dashboard/#key=...``; the page calls the JSON API with that key from the
browser. ``--dump-dom`` gives the DOM once the page's fetches have settled (virtual time), and
a screenshot is kept under the test's tmp dir (and, with BACKFILL_DASHBOARD_PNG set, copied
there: that is how docs/dashboard.png is made).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from batch_api_support import (
    LiveServer,
    Tenant,
    chat_file,
    make_tenant,
    run_worker,
)
from sqlalchemy import text

from backfill.config import Settings
from backfill.finalize import finalize_ready_jobs, settle_cancelling
from backfill.ledger import Ledger, NodePool
from backfill.store import Repository
from backfill.summarize import driver, jobs
from backfill.summarize.job_plan import JobShape

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="needs Debian's chromium (scripts/test.sh installs it)"
)


def chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    profile = tmp_path / "profile"
    profile.mkdir(exist_ok=True)
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--hide-scrollbars",
        "--window-size=1280,1000",
    ]
    return subprocess.run(
        [CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=120, check=False
    )


def submit(server: LiveServer, key: str, n: int, window: str = "2h") -> str:
    client = server.client(key)
    uploaded = client.files.create(file=("in.jsonl", chat_file(n)), purpose="batch")
    return client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window=window
    ).id


@pytest.fixture
def scene(
    settings: Settings, server: LiveServer, repo: Repository
) -> tuple[Tenant, list[str], str]:
    """acme with three jobs in different states, another tenant's job, and a busy node."""
    acme = make_tenant(repo, "acme")
    other = make_tenant(repo, "other")
    hidden = submit(server, other.key, 2)
    done = submit(server, acme.key, 4, "1h")
    run_worker(repo, fail={"req-3"})
    finalize_ready_jobs(repo)
    cancelled = submit(server, acme.key, 3, "24h")
    server.client(acme.key).batches.cancel(cancelled)
    settle_cancelling(repo, cancelled)
    running = submit(server, acme.key, 10)
    run_worker(repo, limit=6, leave_running=2)
    repo.nodes.upsert_node("gpu-0", "http://engine:8001", "SmolLM2-135M", 2048, 16, 8192)
    ledger = Ledger.from_url(settings.redis_url, settings.redis_namespace)
    try:
        ledger.rebuild([NodePool("gpu-0", 32_768, 16, 8192)], [], epoch=1)
        ledger.reserve("gpu-0", "interactive", 3000, 1000)
        ledger.reserve("gpu-0", "batch", 6000, 2000)
    finally:
        ledger.close()
    return acme, [running, cancelled, done], hidden


def test_the_dashboard_is_served_as_static_files(server: LiveServer) -> None:
    page = httpx.get(f"{server.base_url}/dashboard/", timeout=10)
    assert page.status_code == 200
    assert "<title>Backfill</title>" in page.text
    script = httpx.get(f"{server.base_url}/dashboard/app.js", timeout=10)
    assert script.status_code == 200
    assert "javascript" in script.headers["content-type"]
    home = httpx.get(server.base_url, timeout=10, follow_redirects=False)
    assert home.headers["location"] == "/dashboard/"
    # A page that holds an API key: its own scripts only, never framed, nothing sniffed.
    for answer in (page, script):
        policy = answer.headers["content-security-policy"]
        assert "script-src 'self'" in policy
        assert "frame-ancestors 'none'" in policy
        assert answer.headers["x-content-type-options"] == "nosniff"
        assert answer.headers["x-frame-options"] == "DENY"
        assert answer.headers["referrer-policy"] == "no-referrer"


def test_the_dashboard_renders_a_tenants_jobs_progress_and_pools(
    server: LiveServer, scene: tuple[Tenant, list[str], str], tmp_path: Path
) -> None:
    acme, jobs, hidden = scene
    running = jobs[0]
    url = f"{server.base_url}/dashboard/#key={acme.key}"
    result = chromium(tmp_path, "--virtual-time-budget=4000", "--dump-dom", url)
    assert result.returncode == 0, result.stderr[-2000:]
    dom = result.stdout

    for job in jobs:
        assert f'data-id="{job}"' in dom
    assert hidden not in dom  # another tenant's job never reaches this key's page
    row = re.search(rf'<tr class="job[^"]*" data-id="{running}">(.*?)</tr>', dom, re.S)
    assert row is not None
    assert "in_progress" in row.group(1)
    assert '<td class="count">4/10</td>' in row.group(1)
    # The bar: 4 of 10 succeeded, 2 running, 4 queued (widths set through the CSSOM: a style
    # attribute written as markup is dropped by the page's CSP, and the bar shows nothing).
    assert 'class="s-succeeded" style="width: 40%;"' in row.group(1)
    assert 'class="s-running" style="width: 20%;"' in row.group(1)
    assert 'class="s-queued" style="width: 40%;"' in row.group(1)
    assert ">completed<" in dom
    detail = re.search(r'<section id="job">(.*?)</section>', dom, re.S)
    assert detail is not None  # the newest job is shown in detail until another is picked
    assert running in detail.group(1)
    for state, n in (("succeeded", 4), ("running", 2), ("queued", 4), ("failed", 0)):
        assert re.search(
            rf'data-state="{state}">.*?<td class="n">{n}</td>', detail.group(1), re.S
        ), state
    assert ">cancelled<" in dom

    pool = re.search(r'<div class="pool" data-node="gpu-0">(.*?)</svg>', dom, re.S)
    assert pool is not None
    assert "32,768 tokens" in pool.group(1)
    assert "interactive 4,000" in pool.group(1)
    assert "batch 8,000" in pool.group(1)
    for layer in ("interactive", "batch", "slack", "reserve"):
        assert f'data-layer="{layer}"' in pool.group(1)
    assert acme.key not in dom  # the key left the address bar and never enters the DOM

    shot = tmp_path / "dashboard.png"
    # A longer (virtual) run, so the pool chart has some history to show.
    result = chromium(tmp_path, "--virtual-time-budget=12000", f"--screenshot={shot}", url)
    assert result.returncode == 0, result.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert shot.stat().st_size > 20_000
    keep = os.environ.get("BACKFILL_DASHBOARD_PNG")
    if keep:
        shutil.copyfile(shot, keep)


def test_a_wrong_key_shows_a_message_and_no_jobs(
    server: LiveServer, scene: tuple[Tenant, list[str], str], tmp_path: Path
) -> None:
    url = f"{server.base_url}/dashboard/#key=bf-wrong"
    result = chromium(tmp_path, "--virtual-time-budget=3000", "--dump-dom", url)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "The API refused this key" in result.stdout
    assert "data-id=" not in result.stdout


def _words(text: str) -> int:
    return 1 + len(re.findall(r"\w+|[^\w\s]|\s+", text))


def test_the_dashboard_shows_a_summary_jobs_progress_split_documents_and_results(
    settings: Settings, server: LiveServer, repo: Repository, tmp_path: Path
) -> None:
    acme = make_tenant(repo, "acme")
    tenant = repo.tenants.tenant_by_id(acme.id)
    shape = JobShape(context_tokens=400, map_prompt_tokens=20, reduce_prompt_tokens=40,
                     summary_tokens=64)  # fmt: skip
    request = jobs.SummaryJobRequest("tiny-model", "Summarise.", shape.summary_tokens, "1h")
    job = jobs.create_job(repo, settings, tenant, request, shape)
    long = "\n\n".join(f"Paragraph {i}. " + "It has several words. " * 12 for i in range(20))
    documents = [jobs.prepare_document(job, "long", long, _words)]
    documents += [jobs.prepare_document(job, f"s{i}", f"Note {i}.", _words) for i in range(3)]
    jobs.add_documents(repo, settings, tenant, job, documents)
    jobs.start_job(repo, settings, tenant, repo.summary_jobs.get_summary_job(None, job.id))
    driver.drive(repo, settings)
    run_worker(repo)
    driver.drive(repo, settings)  # the short notes end; the long one waits on its reduce
    status = httpx.get(
        f"{server.base_url}/v1/summary_jobs/{job.id}",
        headers={"Authorization": f"Bearer {acme.key}"},
        timeout=10,
    ).json()
    progress = status["progress"]
    assert progress["documents"] == {"pending": 1, "succeeded": 3, "failed": 0}

    url = f"{server.base_url}/dashboard/#key={acme.key}"
    result = chromium(tmp_path, "--virtual-time-budget=4000", "--dump-dom", url)
    assert result.returncode == 0, result.stderr[-2000:]
    row = re.search(rf'<tr class="summary" data-id="{job.id}">(.*?)</tr>', result.stdout, re.S)
    assert row is not None, result.stdout[-3000:]
    cells = row.group(1)
    assert ">in_progress<" in cells
    assert '<td class="count">3/4</td>' in cells
    steps = f"{progress['steps_done']}/{progress['steps_planned']}"
    assert f'<td class="count">{steps}</td>' in cells
    assert f'<td class="split">1 (depth {progress["deepest_split"]})</td>' in cells
    assert 'data-state="succeeded" data-n="3" style="width: 75%;"' in cells
    assert 'data-state="pending" data-n="1" style="width: 25%;"' in cells
    assert f'href="/v1/summary_jobs/{job.id}/results"' in cells
    assert acme.key not in result.stdout

    # A job started before its last document says more are coming.
    with repo.engine.begin() as conn:
        conn.execute(
            text("UPDATE summary_jobs SET documents_open = true WHERE id = :j"), {"j": job.id}
        )
    result = chromium(tmp_path, "--virtual-time-budget=4000", "--dump-dom", url)
    row = re.search(rf'<tr class="summary" data-id="{job.id}">(.*?)</tr>', result.stdout, re.S)
    assert row is not None, result.stdout[-3000:]
    assert '<td class="count" title="more documents are being sent">3/4+</td>' in row.group(1)
