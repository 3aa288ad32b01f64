"""The embedded services of ``backfill dev``: real PostgreSQL and Redis servers from wheels,
started in a scratch home, migrated, restarted on the same data, stopped without leftovers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import psycopg
import pytest
import redis

from backfill.config import Settings, libpq_url
from backfill.store import Repository, ensure_database
from devkit.dev import start_services
from devkit.embedded import EmbeddedServer, EmbeddedServiceError, start_postgres, start_redis
from migrations.migrate import upgrade
from tests.conftest import REDIS_URL

pytestmark = pytest.mark.timeout(120)


def _gone(pid: int, timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def _processes_with(text: str) -> list[str]:
    """Command lines of live processes that mention ``text`` (PostgreSQL's backends name the
    data directory only through their postmaster, so callers pass the data directory)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in argv:
            found.append(argv)
    return found


def _children(parent: int) -> list[int]:
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def test_postgres_is_migrated_and_keeps_its_data_across_restarts(tmp_path: Path) -> None:
    first = start_postgres(tmp_path)
    try:
        assert first.port != 5432
        url = ensure_database(first.url, "backfill_dev")
        upgrade(url)
        repo = Repository.connect(url, pool_size=1)
        try:
            created = repo.tenants.create_tenant("survivor")
        finally:
            repo.close()
        children = _children(first.pid)
        assert children  # checkpointer, walwriter, backends ...
    finally:
        first.stop()
    assert _gone(first.pid)
    assert all(_gone(pid) for pid in children)
    assert _processes_with(str(first.data_dir)) == []

    second = start_postgres(tmp_path)
    try:
        assert second.data_dir == first.data_dir
        repo = Repository.connect(f"{second.url.rpartition('/')[0]}/backfill_dev", pool_size=1)
        try:
            assert repo.tenants.tenant_by_name("survivor").id == created.id
        finally:
            repo.close()
        # Upgrading again is a no-op on a database already at head.
        upgrade(f"{second.url.rpartition('/')[0]}/backfill_dev")
    finally:
        second.stop()
    assert _gone(second.pid)


def test_servers_run_in_their_own_session_so_a_terminal_ctrl_c_misses_them(
    tmp_path: Path,
) -> None:
    """The worker needs the database while it requeues its items after Ctrl-C; the services
    must outlive the signal the terminal sends to the dev command's process group."""
    pg = start_postgres(tmp_path)
    rd = start_redis(tmp_path)
    try:
        for server in (pg, rd):
            assert os.getsid(server.pid) == server.pid
            assert os.getpgid(server.pid) != os.getpgid(0)
    finally:
        pg.stop()
        rd.stop()


def test_redis_round_trip_and_stop_leaves_nothing(tmp_path: Path) -> None:
    server = start_redis(tmp_path)
    try:
        assert server.port != 6379
        client = redis.Redis.from_url(server.url)
        client.set("bf:probe", "ok")
        assert client.get("bf:probe") == b"ok"
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        client.close()
    finally:
        server.stop()
    assert _gone(server.pid)
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(server.url, socket_connect_timeout=1).ping()


def test_servers_left_by_a_killed_run_are_stopped_by_the_next(tmp_path: Path) -> None:
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from devkit.embedded import start_postgres, start_redis\n"
        "pg = start_postgres(Path(sys.argv[1])); rd = start_redis(Path(sys.argv[1]))\n"
        "print(pg.pid, rd.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[2],
    )
    assert owner.stdout is not None
    old_pg, old_redis = (int(p) for p in owner.stdout.readline().split())
    owner.send_signal(signal.SIGKILL)  # no cleanup runs: both servers are orphaned
    owner.wait()
    assert not _gone(old_pg, 0.5)
    assert not _gone(old_redis, 0.5)

    started: list[EmbeddedServer] = []
    try:
        started.append(start_postgres(tmp_path))
        started.append(start_redis(tmp_path))
        assert _gone(old_pg)
        assert _gone(old_redis)
        with psycopg.connect(libpq_url(started[0].url)) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        for server in started:
            server.stop()


def test_a_second_live_run_is_refused_rather_than_sharing_the_data(tmp_path: Path) -> None:
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from devkit.embedded import start_postgres\n"
        "pg = start_postgres(Path(sys.argv[1]))\n"
        "print(pg.pid, flush=True)\n"
        "try:\n"
        "    sys.stdin.read()\n"
        "finally:\n"
        "    pg.stop()\n"
    )
    owner = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[2],
    )
    assert owner.stdout is not None
    assert owner.stdin is not None
    pid = int(owner.stdout.readline())
    try:
        with pytest.raises(EmbeddedServiceError, match="another running backfill dev"):
            start_postgres(tmp_path)
        assert not _gone(pid, 0.2)
    finally:
        owner.stdin.close()
        owner.wait(30)
    assert _gone(pid)


def test_dev_embeds_only_the_services_whose_url_is_unset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BACKFILL_HOME", str(tmp_path))
    monkeypatch.delenv("BACKFILL_DATABASE_URL", raising=False)
    monkeypatch.setenv("BACKFILL_REDIS_URL", REDIS_URL)
    settings = Settings()
    with ExitStack() as stack:
        dev = start_services(settings, "auto", stack)
        assert dev.redis_url == settings.redis_url
        assert dev.database_url != settings.database_url
        port = int(dev.database_url.rpartition(":")[2].partition("/")[0])
        with psycopg.connect(libpq_url(dev.database_url)) as conn:
            assert conn.execute("SHOW data_directory").fetchone() == (
                str(tmp_path / "embedded" / "postgres-18"),
            )
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(f"postgresql://postgres@127.0.0.1:{port}/postgres", connect_timeout=2)


def test_sigterm_to_dev_stops_the_services_it_started(tmp_path: Path) -> None:
    """SIGTERM unwinds ``backfill dev`` like Ctrl-C: the embedded servers stop. The engine is
    replaced by a stand-in that never becomes ready (no vLLM here), so the signal lands while
    dev waits for it, with the database migrated and both servers up."""
    script = (
        "import sys, time\n"
        "from backfill.config import Settings\n"
        "from devkit import dev, devengine\n"
        "def never_ready(*args, **kwargs):\n"
        "    print('engine: waiting', flush=True)\n"
        "    time.sleep(600)\n"
        "devengine.start_model = never_ready\n"
        "sys.exit(dev.run_dev(Settings(), dev.DevOptions(model='tiny')))\n"
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("BACKFILL_DATABASE_URL", "BACKFILL_REDIS_URL")
    }
    env["BACKFILL_HOME"] = str(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=Path(__file__).parents[2],
    )
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("engine: waiting"):
            break
    text = "".join(seen)
    assert "services: embedded PostgreSQL" in text, text
    data_dir = tmp_path / "embedded" / "postgres-18"
    postmaster = int((data_dir / "postmaster.pid").read_text().split()[0])
    redis_pid = int((tmp_path / "embedded" / "redis" / "redis.pid").read_text().split()[0])

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 128 + signal.SIGTERM
    assert _gone(postmaster)
    assert _gone(redis_pid)
    assert _processes_with(str(data_dir)) == []
