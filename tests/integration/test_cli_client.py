"""The tenant's commands (submit, status, results, cancel, list, capacity) against a live API.

The API runs in-process (batch_api_support.serve) over this test's database and Redis; the
commands run through typer's runner, as the console script runs them, and one runs as a real
subprocess to pin down the one-line error an operator sees.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from batch_api_support import (
    LiveServer,
    Tenant,
    chat_file,
    result_lines,
    run_worker,
)
from typer.testing import CliRunner

from backfill.config import Settings
from backfill.ledger import Ledger, NodePool
from backfill.store import Repository
from backfill_cli.app import app
from devkit.harness import free_port

BACKFILL = str(Path(sys.executable).parent / "backfill")


def cli(server: LiveServer, key: str | None, *args: str) -> tuple[int, str, str]:
    env = {"BACKFILL_API_URL": server.base_url, "COLUMNS": "160"}
    if key is not None:
        env["BACKFILL_API_KEY"] = key
    result = CliRunner().invoke(app, list(args), env=env, catch_exceptions=True)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def one_line_error(code: int, stderr: str) -> str:
    assert code != 0
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: ")
    return lines[0]


def submit_jsonl(server: LiveServer, key: str, tmp_path: Path, n: int = 3) -> str:
    path = tmp_path / "requests.jsonl"
    path.write_bytes(chat_file(n))
    code, stdout, stderr = cli(server, key, "submit", str(path), "--window", "2h")
    assert code == 0, stderr
    batch_id = stdout.strip()
    assert batch_id.startswith("batch_")
    return batch_id


def test_submit_a_jsonl_file_prints_the_batch_id(
    server: LiveServer, acme: Tenant, tmp_path: Path
) -> None:
    batch_id = submit_jsonl(server, acme.key, tmp_path, n=3)
    batch = server.client(acme.key).batches.retrieve(batch_id)
    assert batch.request_counts is not None
    assert batch.request_counts.total == 3
    assert batch.completion_window == "2h"
    assert batch.endpoint == "/v1/chat/completions"


def test_submit_a_folder_turns_each_document_into_a_summary_request(
    server: LiveServer, acme: Tenant, repo: Repository, tmp_path: Path
) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "hamlet.txt").write_text("A prince of Denmark hesitates.")
    (docs / "odyssey.txt").write_text("A king sails home for ten years.")
    (docs / "notes.md").write_text("not a document")
    code, stdout, stderr = cli(
        server,
        acme.key,
        "submit",
        str(docs),
        "--model",
        "tiny-model",
        "--max-tokens",
        "40",
        "--window",
        "1h",
    )
    assert code == 0, stderr
    batch_id = stdout.strip()
    items = repo.items.items(batch_id)
    assert sorted(i.custom_id for i in items) == ["hamlet", "odyssey"]
    client = server.client(acme.key)
    sent = client.files.content(client.batches.retrieve(batch_id).input_file_id).text
    body = next(r["body"] for r in result_lines(sent) if r["custom_id"] == "hamlet")
    assert body["model"] == "tiny-model"
    assert body["max_tokens"] == 40
    assert "A prince of Denmark hesitates." in body["messages"][0]["content"]


def test_submit_a_folder_without_a_model_is_one_line(
    server: LiveServer, acme: Tenant, tmp_path: Path
) -> None:
    (tmp_path / "a.txt").write_text("text")
    assert "--model" in one_line_error(*cli(server, acme.key, "submit", str(tmp_path))[::2])
    missing = tmp_path / "nope.jsonl"
    assert "nope.jsonl" in one_line_error(*cli(server, acme.key, "submit", str(missing))[::2])


def test_status_shows_items_by_state_tokens_and_eta(
    server: LiveServer, acme: Tenant, repo: Repository, tmp_path: Path
) -> None:
    batch_id = submit_jsonl(server, acme.key, tmp_path, n=4)
    run_worker(repo, fail={"req-1"}, leave_running=1)
    code, stdout, stderr = cli(server, acme.key, "status", batch_id)
    assert code == 0, stderr
    assert batch_id in stdout
    assert "in_progress" in stdout
    assert "3/4 items finished" in stdout
    for state in ("running", "succeeded", "failed"):
        assert state in stdout
    assert "output tokens" in stdout
    assert "ETA" in stdout


def test_status_watch_returns_once_the_batch_is_finished(
    server: LiveServer, acme: Tenant, repo: Repository, tmp_path: Path
) -> None:
    batch_id = submit_jsonl(server, acme.key, tmp_path, n=2)
    code, _, stderr = cli(server, acme.key, "cancel", batch_id)
    assert code == 0, stderr
    code, stdout, stderr = cli(server, acme.key, "status", batch_id, "--watch", "--interval", "0.1")
    assert code == 0, stderr
    assert "cancelled" in stdout


def test_results_stream_by_state_to_stdout_and_to_a_file(
    server: LiveServer, acme: Tenant, repo: Repository, tmp_path: Path
) -> None:
    batch_id = submit_jsonl(server, acme.key, tmp_path, n=3)
    run_worker(repo, fail={"req-2"})
    code, stdout, stderr = cli(server, acme.key, "results", batch_id)
    assert code == 0, stderr
    assert sorted(r["custom_id"] for r in result_lines(stdout)) == ["req-0", "req-1", "req-2"]

    code, stdout, _ = cli(server, acme.key, "results", batch_id, "--state", "failed")
    assert code == 0
    assert [r["custom_id"] for r in result_lines(stdout)] == ["req-2"]

    target = tmp_path / "ok.jsonl"
    code, _, stderr = cli(
        server, acme.key, "results", batch_id, "--state", "succeeded", "-o", str(target)
    )
    assert code == 0, stderr
    assert "2 results written" in stderr
    rows = result_lines(target.read_text())
    assert [r["custom_id"] for r in rows] == ["req-0", "req-1"]
    assert rows[0]["response"]["status_code"] == 200
    assert not (tmp_path / "ok.jsonl.part").exists()

    assert "--state" in one_line_error(
        *cli(server, acme.key, "results", batch_id, "--state", "done")[::2]
    )


def test_results_keep_each_line_whole_whatever_characters_the_model_wrote(
    server: LiveServer, acme: Tenant, repo: Repository, tmp_path: Path
) -> None:
    """JSON leaves U+2028, U+2029 and U+0085 unescaped inside strings; a model writes them
    now and then. Lines are split on newlines only (red before: httpx's ``iter_lines``
    split a result in two, one invalid JSON line each)."""
    text = "one\u2028two\u2029three\x85four"
    batch_id = submit_jsonl(server, acme.key, tmp_path, n=2)
    run_worker(repo, answer=text)
    code, stdout, stderr = cli(server, acme.key, "results", batch_id)
    assert code == 0, stderr
    rows = [json.loads(line) for line in stdout.split("\n") if line.strip()]
    assert sorted(r["custom_id"] for r in rows) == ["req-0", "req-1"]
    body = rows[0]["response"]["body"]
    assert body["choices"][0]["message"]["content"] == text


def test_cancel_and_list(server: LiveServer, acme: Tenant, tmp_path: Path) -> None:
    first = submit_jsonl(server, acme.key, tmp_path, n=1)
    second = submit_jsonl(server, acme.key, tmp_path, n=2)
    code, stdout, stderr = cli(server, acme.key, "cancel", first)
    assert code == 0, stderr
    assert first in stdout
    assert "cancel" in stdout
    code, stdout, stderr = cli(server, acme.key, "list")
    assert code == 0, stderr
    assert stdout.index(second) < stdout.index(first)  # newest first
    assert "0/2" in stdout
    code, stdout, _ = cli(server, acme.key, "list", "--limit", "1")
    assert second in stdout
    assert first not in stdout
    assert f"--after {second}" in stdout


def test_capacity_shows_each_nodes_pool_from_the_ledger(
    settings: Settings, server: LiveServer, acme: Tenant, repo: Repository
) -> None:
    repo.nodes.upsert_node("gpu-0", "http://engine:8001", "tiny-model", 1000, 16, 4000)
    ledger = Ledger.from_url(settings.redis_url, settings.redis_namespace)
    try:
        ledger.rebuild([NodePool("gpu-0", 16_000, 16, 4000)], [], epoch=1)
        ledger.reserve("gpu-0", "interactive", 1000, 500)
        ledger.reserve("gpu-0", "batch", 2000, 1000)
    finally:
        ledger.close()
    code, stdout, stderr = cli(server, acme.key, "capacity")
    assert code == 0, stderr
    row = next(line for line in stdout.splitlines() if "gpu-0" in line)
    for figure in ("16,000", "4,000", "1,504", "3,008"):
        assert figure in row, row
    assert "gpu-0*" not in row  # live figures from the ledger, not Postgres's fallback


def test_capacity_watch_without_a_terminal_prints_each_reading_as_it_comes(
    settings: Settings, server: LiveServer, acme: Tenant, repo: Repository
) -> None:
    """The real command with its output in a pipe. Red before: rich's live view, with no
    terminal to redraw in, prints only when it stops, and a capacity watch never stops by
    itself: the pipe read nothing."""
    repo.nodes.upsert_node("gpu-0", "http://engine:8001", "tiny-model", 1000, 16, 4000)
    ledger = Ledger.from_url(settings.redis_url, settings.redis_namespace)
    try:
        ledger.rebuild([NodePool("gpu-0", 16_000, 16, 4000)], [], epoch=1)
    finally:
        ledger.close()
    env = {
        **os.environ,
        "BACKFILL_API_URL": server.base_url,
        "BACKFILL_API_KEY": acme.key,
        "COLUMNS": "160",
    }
    proc = subprocess.Popen(
        [BACKFILL, "capacity", "--watch", "--interval", "0.1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")))
    reader.start()
    try:
        for _ in range(600):  # a failure's bound (60 s); the first reading comes at once
            if any("gpu-0" in line for line in lines):
                break
            time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(10)
        reader.join(10)
    row = next((line for line in lines if "gpu-0" in line), None)
    assert row is not None, "".join(lines)
    assert "16,000" in row, row


def test_a_wrong_key_and_an_unknown_batch_are_one_line_each(
    server: LiveServer, acme: Tenant
) -> None:
    line = one_line_error(*cli(server, "bf-not-a-key", "list")[::2])
    assert "401" in line
    line = one_line_error(*cli(server, acme.key, "status", "batch_nope")[::2])
    assert "404" in line
    assert "BACKFILL_API_KEY" in one_line_error(*cli(server, None, "list")[::2])


def test_an_unreachable_api_is_one_line_from_the_real_command() -> None:
    env = {
        **os.environ,
        "BACKFILL_API_URL": f"http://127.0.0.1:{free_port()}",
        "BACKFILL_API_KEY": "bf-x",
    }
    result = subprocess.run(
        [BACKFILL, "status", "batch_x"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    line = one_line_error(result.returncode, result.stderr)
    assert "cannot reach the API" in line
