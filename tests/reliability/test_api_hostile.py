"""Scenarios 9 and 10: hostile input against the API, and tenant isolation.

9. Schemathesis generates requests from the API's own OpenAPI schema (valid and invalid
   shapes): none may get a 5xx. Then hand-made hostile batch files: malformed JSONL, a huge
   line, deep JSON, invalid UTF-8, NUL bytes (raw, and as ``\\u0000`` escapes in a custom_id or
   a body), duplicate custom_ids, an oversized file, negative or huge ``max_tokens``. Each is
   refused with a clear error: a 4xx at upload or create, or, for a line that only full
   validation finds, the batch ``failed`` with an error naming the line and reason (OpenAI's
   behaviour); and no item of a refused file is ever stored (rows counted before and after).
10. Every id-taking route called with another tenant's ids answers 404 and shows nothing of
   it; API keys never appear in clear in the database or in the logs.
11. Hostile bodies (sent over a raw socket, ``tests/reliability/bodies.py``), on the batch
   routes and the gateway's: without a valid key, refused before one byte of the body is
   read; chunked past the route's limit, cut off where it crosses it, the server's memory
   growing by about the limit, not the body; a declared length over the limit refused before
   the body; JSON nested deeper than the parser's recursion limit a 400, never a 500. And what
   anonymous callers can spend: key lookups and /metrics scans are cached, the lab and
   unknown keys rate-limited per address.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.core.result import Ok
from sqlalchemy import text

from backfill.config import Settings
from backfill.errors import InvalidInput
from backfill.store import Database, Repository
from backfill.store.stats import Stats
from backfill.store.tenants import Tenants
from tests.conftest import REDIS_URL
from tests.integration.batch_api_support import (
    LiveServer,
    Tenant,
    api_settings,
    chat_line,
    jsonl,
    make_tenant,
    peak_growth,
    serve,
)
from tests.reliability.bodies import Answer, pieces, post_body
from tests.reliability.support import report

MAX_FILE = 64 * 1024
MAX_LINE = 8 * 1024
EXAMPLES = 25
GATEWAY = re.compile(r"^/v1/(chat/)?completions$")
ENGINE_SHAPED = ("POST", "/v1/summary_jobs")
"""A summary job's create asks an engine for its context and template counts: without one
registered it is a 503 with Retry-After, as the gateway's routes are."""


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@dataclass
class Api:
    server: LiveServer
    repo: Repository
    a: Tenant
    b: Tenant
    logs: Captured

    def http(self, tenant: Tenant) -> httpx.Client:
        return httpx.Client(
            base_url=self.server.base_url,
            headers={"Authorization": f"Bearer {tenant.key}"},
            timeout=30,
        )

    def rows(self) -> dict[str, int]:
        with self.repo.engine.connect() as conn:
            return {
                t: int(conn.execute(text(f"SELECT count(*) FROM {t}")).scalar_one())
                for t in ("items", "jobs", "files")
            }


@pytest.fixture(scope="module")
def api(module_database_url: str) -> Iterator[Api]:
    namespace = f"bfh{secrets.token_hex(3)}"
    s = api_settings(
        Settings(database_url=module_database_url, redis_url=REDIS_URL, redis_namespace=namespace),
        max_file_bytes=MAX_FILE,
        max_line_bytes=MAX_LINE,
        # Each hostile file is checked in its create's request, so what it stored (or not)
        # is read at once (deferred, the same checks run in the ingest process).
        ingest_inline_bytes=MAX_FILE,
    )
    logs = Captured()
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(logs)
    root.setLevel(logging.DEBUG)
    repo = Repository.connect(s.database_url)
    try:
        with serve(s) as server:
            yield Api(server, repo, make_tenant(repo, "a"), make_tenant(repo, "b"), logs)
    finally:
        root.removeHandler(logs)
        root.setLevel(old_level)
        repo.close()


def test_no_generated_request_gets_a_server_error(api: Api) -> None:
    # schemathesis' pytest plugin does not load under this pytest; its Python API does the
    # same: a Hypothesis strategy of cases per operation of the served OpenAPI schema.
    schema = schemathesis.openapi.from_url(f"{api.server.base_url}/openapi.json")
    auth = {"Authorization": f"Bearer {api.a.key}"}
    failures: list[str] = []
    calls: dict[str, int] = {}
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), f"the API's OpenAPI schema is invalid: {result}"
        operation = result.ok()
        if GATEWAY.match(operation.path) or (operation.method.upper(), operation.path) == (
            ENGINE_SHAPED
        ):
            continue  # the interactive gateway proxies to engines this deployment lacks
        for mode in GenerationMode:

            @given(case=operation.as_strategy(generation_mode=mode))
            @hsettings(
                max_examples=EXAMPLES,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            def run(case: Any) -> None:
                response = case.call(headers=auth)
                calls[case.method] = calls.get(case.method, 0) + 1
                if response.status_code >= 500:
                    failures.append(
                        f"{case.method} {case.formatted_path} -> {response.status_code}: "
                        f"{response.text[:300]}"
                    )

            try:
                run()
            except Unsatisfiable:
                continue  # no invalid input exists for an operation without parameters
    report(
        "9 schemathesis (positive + negative cases per operation)",
        requests=sum(calls.values()),
        by_method=calls,
        server_errors=len(failures),
    )
    assert not failures, failures[:5]


def _hostile_files() -> dict[str, bytes]:
    good = chat_line("ok-1", max_tokens=8)

    def line(custom_id: str = "x", **body: Any) -> dict[str, Any]:
        out = chat_line(custom_id, max_tokens=8)
        out["body"].update(body)
        return out

    deep = b'{"custom_id": "d", "method": "POST", "url": "/v1/chat/completions", "body": ' + (
        b"[" * 3500 + b"]" * 3500 + b"}\n"
    )
    return {
        "malformed JSONL": jsonl([good]) + b'{"custom_id": "bad", "method": \n',
        "not an object": jsonl([good]) + b"[1, 2, 3]\n",
        "huge line": jsonl([line("big", messages=[{"role": "user", "content": "x" * MAX_LINE}])]),
        "deep JSON": jsonl([good]) + deep,
        "invalid UTF-8": jsonl([good]) + b'{"custom_id": "\xff\xfe", "body": {}}\n',
        "raw NUL byte": jsonl([good]) + b'{"custom_id": "n\x00ul", "body": {}}\n',
        "NUL escape in custom_id": jsonl([good, chat_line("nul\u0000id", max_tokens=8)]),
        "NUL escape in body": jsonl(
            [good, line("nb", messages=[{"role": "user", "content": "a\u0000b"}])]
        ),
        "duplicate custom_ids": jsonl([good, chat_line("ok-1", max_tokens=8)]),
        "oversized file": b"\n".join([json.dumps(good).encode()] * (MAX_FILE // 100)) + b"\n",
        "negative max_tokens": jsonl([good, line("neg", max_tokens=-5)]),
        "zero max_tokens": jsonl([good, line("zero", max_tokens=0)]),
        "huge max_tokens": jsonl([good, line("huge", max_tokens=10**12)]),
        "float max_tokens": jsonl([good, line("flt", max_tokens=1.5)]),
        "string max_tokens": jsonl([good, line("str", max_tokens="10")]),
        "wrong url": jsonl([good, {**chat_line("url"), "url": "/v1/embeddings"}]),
        "empty file": b"\n\n",
    }


# Hostile-looking but valid: accepted, and stored whole.
ACCEPTED = {"NUL escape in body"}


def _refusal(response: httpx.Response) -> str:
    error = response.json().get("error") or {}
    return f"{response.status_code} {error.get('code')}: {error.get('message')}"


def test_hostile_batch_files_are_refused_clearly_and_store_nothing(api: Api) -> None:
    outcomes: dict[str, str] = {}
    with api.http(api.a) as http:
        for name, content in _hostile_files().items():
            before = api.rows()
            up = http.post(
                "/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"}
            )
            assert up.status_code < 500, (name, up.status_code, up.text[:300])
            if up.status_code >= 400:
                assert up.json()["error"]["message"], name
                outcomes[name] = f"upload {_refusal(up)}"
                assert api.rows() == before, f"{name}: a refused upload stored something"
                continue
            created = http.post(
                "/v1/batches",
                json={
                    "input_file_id": up.json()["id"],
                    "endpoint": "/v1/chat/completions",
                    "completion_window": "24h",
                },
            )
            assert created.status_code < 500, (name, created.status_code, created.text[:300])
            after = api.rows()
            if name in ACCEPTED:
                # Valid JSON whose string holds an escaped NUL: stored whole, round-tripping.
                assert created.json()["status"] == "in_progress", created.text[:300]
                assert after["items"] == before["items"] + 2
                outcomes[name] = "accepted whole (escaped NUL round-trips in the JSON body)"
                continue
            assert after["items"] == before["items"], f"{name}: items of a refused file stored"
            if created.status_code >= 400:
                outcomes[name] = f"create {_refusal(created)}"
                continue
            batch = created.json()
            assert batch["status"] == "failed", f"{name}: accepted: {batch['status']}"
            errors = batch["errors"]["data"]
            assert errors, name
            assert all(e["message"] and e["code"] for e in errors), errors
            first = errors[0]
            outcomes[name] = f"batch failed: line {first.get('line')} {first['code']}"
    for name, outcome in outcomes.items():
        print(f"  {name:28s} -> {outcome[:150]}")
    report(
        "9 hostile batch input",
        cases=len(outcomes),
        refused=len(outcomes) - len(ACCEPTED),
        accepted_valid=len(ACCEPTED),
        items_stored_from_refused_files=0,
        server_errors=0,
    )
    assert len(outcomes) == len(_hostile_files())


def test_another_tenants_ids_answer_404_and_keys_never_stored_or_logged(api: Api) -> None:
    with api.http(api.a) as a, api.http(api.b) as b:
        up = a.post(
            "/v1/files",
            files={
                "file": ("in.jsonl", jsonl([chat_line(f"r{i}", max_tokens=8) for i in range(3)]))
            },
            data={"purpose": "batch"},
        )
        assert up.status_code == 200, up.text
        file_id = up.json()["id"]
        created = a.post(
            "/v1/batches",
            json={
                "input_file_id": file_id,
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
        )
        assert created.status_code == 200, created.text
        batch_id = created.json()["id"]
        calls = [
            ("GET", f"/v1/files/{file_id}", None),
            ("GET", f"/v1/files/{file_id}/content", None),
            ("DELETE", f"/v1/files/{file_id}", None),
            ("GET", f"/v1/batches/{batch_id}", None),
            ("POST", f"/v1/batches/{batch_id}/cancel", None),
            ("GET", f"/v1/batches/{batch_id}/results", None),
            (
                "POST",
                "/v1/batches",
                {
                    "input_file_id": file_id,
                    "endpoint": "/v1/chat/completions",
                    "completion_window": "24h",
                },
            ),
        ]
        leaks = []
        for method, path, body in calls:
            r = b.request(method, path, json=body)
            # A 404 may echo the id the caller sent; anything else shows the other tenant's.
            if r.status_code != 404 or "in.jsonl" in r.text:
                leaks.append((method, path, r.status_code, r.text[:200]))
        listed = b.get("/v1/batches").json()["data"] + b.get("/v1/files").json()["data"]
        leaks += [("LIST", x["id"], 200, "") for x in listed if x["id"] in (file_id, batch_id)]
        # Tenant a still sees its own: nothing was changed by b's calls.
        assert a.get(f"/v1/files/{file_id}").status_code == 200
        assert a.get(f"/v1/batches/{batch_id}").json()["status"] != "cancelled"
    dumped = _database_text(api.repo)
    keys = [api.a.key, api.b.key]
    in_db = [k for k in keys if k in dumped or k[3:] in dumped]
    in_logs = [k for k in keys if any(k in line or k[3:] in line for line in api.logs.lines)]
    report(
        "10 tenant isolation",
        id_routes_probed=len(calls),
        cross_tenant_leaks=len(leaks),
        keys_in_database=len(in_db),
        keys_in_logs=len(in_logs),
        log_lines_checked=len(api.logs.lines),
        database_chars_checked=len(dumped),
    )
    assert not leaks, leaks
    assert not in_db
    assert not in_logs


def _database_text(repo: Repository) -> str:
    """Every row of every table of the public schema, as text (a dump of the database)."""
    parts: list[str] = []
    with repo.engine.connect() as conn:
        tables = conn.execute(
            text("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        ).scalars()
        for table in list(tables):
            rows = conn.execute(text(f'SELECT t::text FROM "{table}" t')).scalars()
            parts.extend(rows)
    return "\n".join(parts)


def test_a_nul_byte_in_a_query_parameter_is_a_400_not_a_500(api: Api) -> None:
    # Found by the schemathesis run: Postgres refuses NUL in text; the repository now turns
    # that DataError into InvalidInput, which the API answers as 400.
    with api.http(api.a) as http:
        for path in ("/v1/files?purpose=a%00b", "/v1/batches?after=x%00y"):
            r = http.get(path)
            assert r.status_code in (400, 200), (path, r.status_code, r.text)
            assert r.status_code < 500
    with pytest.raises(InvalidInput):
        api.repo.files.list_files(api.a.id, purpose="a\x00b")
    with pytest.raises(InvalidInput):
        api.repo.files.list_files(api.a.id, after="x\x00y")


# ---------------------------------------------------------------------------------------------
# 11. Bodies: size on the bytes read, the key before the body, nesting, anonymous cost
# ---------------------------------------------------------------------------------------------

HOSTILE_BYTES = 64 * 1024 * 1024
"""Each hostile body: bigger than every route's limit (the gateway's is 4 MiB here)."""
FILLER = b"x" * 65536
BOUNDARY = "hostileboundary"
UPLOAD_HEAD = (
    f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
    "Content-Type: application/octet-stream\r\n\r\n"
).encode()
JSON_HEAD = b'{"model": "tiny-model", "prompt": "'
MULTIPART = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
JSON = {"Content-Type": "application/json"}
# route -> (headers, first bytes of its body)
BODY_ROUTES: dict[str, tuple[dict[str, str], bytes]] = {
    "/v1/files": (MULTIPART, UPLOAD_HEAD),
    "/v1/batches": (JSON, JSON_HEAD),
    "/v1/chat/completions": (JSON, JSON_HEAD),
    "/v1/completions": (JSON, JSON_HEAD),
}


def _hostile(api: Api, path: str, key: str | None, **kwargs: Any) -> tuple[Answer, int]:
    headers, first = BODY_ROUTES.get(path, (JSON, JSON_HEAD))
    if key is not None:
        headers = {**headers, "Authorization": f"Bearer {key}"}
    return peak_growth(
        lambda: post_body(
            api.server.base_url,
            path,
            pieces(HOSTILE_BYTES, FILLER, first),
            headers=headers,
            **kwargs,
        )
    )


@pytest.mark.parametrize("path", sorted(BODY_ROUTES))
@pytest.mark.parametrize("key", ["none", "wrong"])
def test_a_body_without_a_valid_key_is_refused_before_one_byte_of_it_is_read(
    api: Api, path: str, key: str
) -> None:
    # Was: the whole body was read (an upload spooled to disk, JSON into memory), then 401.
    before = api.rows()
    answer, grown = _hostile(api, path, None if key == "none" else "bf-wrong", early_answer_s=30.0)
    assert answer.status == 401, answer
    assert answer.error["code"] == "invalid_api_key"
    assert answer.sent == 0, f"{answer.sent} body bytes were read before the 401"
    assert answer.headers.get("connection") == "close"  # the body is not drained either
    assert grown < 1024 * 1024, grown
    assert api.rows() == before


@pytest.mark.parametrize("path", [*sorted(BODY_ROUTES), "/lab/kv"])
def test_a_chunked_body_over_the_routes_limit_is_cut_off_where_it_crosses_it(
    api: Api, path: str
) -> None:
    # Was: only Content-Length was checked, so a chunked body had no limit at all (a 100 MB
    # one to /lab/kv grew the API by 264 MB).
    limit = {
        "/v1/files": MAX_FILE + 64 * 1024,
        "/v1/chat/completions": 4 * 1024 * 1024,
        "/v1/completions": 4 * 1024 * 1024,
    }.get(path, 64 * 1024)
    before = api.rows()
    answer, grown = _hostile(api, path, api.a.key)
    # The 413 may be lost to the reset of a connection closed with unread bytes in it.
    assert answer.status in (413, None), answer
    if answer.status == 413:
        code = "file_too_large" if path == "/v1/files" else "request_too_large"
        assert answer.error["code"] == code, answer
        assert str(limit) in answer.error["message"]
    # What loopback socket buffers hold is all the client gets to write past the limit.
    assert answer.sent < HOSTILE_BYTES // 2, answer.sent
    print(f"\n{path}: {answer.status} after {answer.sent} bytes, peak growth {grown}")
    assert grown < 2 * limit + 2 * 1024 * 1024, grown
    assert api.rows() == before


@pytest.mark.parametrize("path", [*sorted(BODY_ROUTES), "/lab/kv"])
def test_a_declared_length_over_the_limit_is_413_before_the_body(api: Api, path: str) -> None:
    answer, _ = _hostile(api, path, api.a.key, content_length=HOSTILE_BYTES, early_answer_s=30.0)
    assert answer.status == 413, answer
    assert answer.sent == 0
    assert answer.error["message"]


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", b'{"model": "m", "messages": ' + _nested(5000) + b"}"),
        (
            "/v1/chat/completions",
            b'{"model": "m", "messages": [{"role": "user", "content": ' + _nested(100) + b"}]}",
        ),
        ("/v1/completions", b'{"model": "m", "prompt": ' + _nested(5000) + b"}"),
        ("/v1/completions", _nested(5000)),
        ("/v1/batches", b'{"input_file_id": ' + _nested(5000) + b"}"),
        ("/lab/kv", b'{"capacity_slots": ' + _nested(5000) + b"}"),
    ],
)
def test_deeply_nested_json_is_a_400_on_every_json_route(api: Api, path: str, body: bytes) -> None:
    # Was: a 500 on the gateway routes (only ValueError was caught; deep JSON is a
    # RecursionError).
    with api.http(api.a) as http:
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, (r.status_code, r.text[:300])
    assert r.json()["error"]["message"]


class CountingTenants(Tenants):
    """The tenants role, counting key lookups."""

    def __init__(self, db: Database) -> None:
        super().__init__(db)
        self.key_lookups = 0

    def tenant_for_key(self, key: str) -> Any:
        self.key_lookups += 1
        return super().tenant_for_key(key)


class CountingStats(Stats):
    """The stats role, counting item scans."""

    def __init__(self, db: Database) -> None:
        super().__init__(db)
        self.item_scans = 0

    def item_state_totals(self) -> Any:
        self.item_scans += 1
        return super().item_state_totals()


class CountingRepository(Repository):
    """The real repository, counting the reads anonymous callers can cause."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.counting_tenants = self.tenants = CountingTenants(self.db)
        self.counting_stats = self.stats = CountingStats(self.db)

    @property
    def key_lookups(self) -> int:
        return self.counting_tenants.key_lookups

    @property
    def item_scans(self) -> int:
        return self.counting_stats.item_scans


ANON_BURST = 10


@pytest.fixture
def counted(module_database_url: str) -> Iterator[tuple[LiveServer, CountingRepository]]:
    """A server whose anonymous limit (per address) is small enough to reach."""
    s = api_settings(
        Settings(
            database_url=module_database_url,
            redis_url=REDIS_URL,
            redis_namespace=f"bfh{secrets.token_hex(3)}",
        ),
        anonymous_rate_limit_per_s=0.5,
        anonymous_rate_limit_burst=ANON_BURST,
        api_key_cache_s=60.0,
        metrics_cache_s=60.0,
    )
    repo = CountingRepository(Repository.connect(s.database_url).engine)
    try:
        with serve(s, repository=repo) as server:
            yield server, repo
    finally:
        repo.close()


def test_a_wrong_key_costs_one_postgres_lookup_and_guessing_keys_is_rate_limited(
    counted: tuple[LiveServer, CountingRepository],
) -> None:
    # Was: every request with a wrong key was a Postgres query, without any limit.
    server, repo = counted
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        same = [
            http.get("/v1/batches", headers={"Authorization": "Bearer bf-wrong"}).status_code
            for _ in range(30)
        ]
        assert same == [401] * 30
        assert repo.key_lookups == 1
        guesses = [
            http.get("/v1/batches", headers={"Authorization": f"Bearer bf-{i}"}) for i in range(30)
        ]
    codes = [r.status_code for r in guesses]
    assert 429 in codes, codes
    limited = guesses[codes.index(429)]
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(limited.headers["Retry-After"]) >= 1
    # Each lookup took a token of the address's bucket: at most the burst reached Postgres.
    assert repo.key_lookups <= ANON_BURST, repo.key_lookups


def test_metrics_scrapes_reuse_one_scan_and_the_lab_is_rate_limited_per_address(
    counted: tuple[LiveServer, CountingRepository],
) -> None:
    # Was: every scrape of /metrics (no key) scanned the unfinished items, and /lab/kv took
    # up to 3.2 s of CPU per anonymous call, without any limit.
    server, repo = counted
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        scrapes = [http.get("/metrics").status_code for _ in range(ANON_BURST // 2)]
        assert scrapes == [200] * len(scrapes)
        assert repo.item_scans == 1
        lab = [
            http.post("/lab/kv", json={"capacity_slots": 4, "working_set": 8, "requests": 64})
            for _ in range(ANON_BURST)
        ]
    codes = [r.status_code for r in lab]
    assert codes[0] == 200
    assert 429 in codes, codes
    assert lab[codes.index(429)].json()["error"]["code"] == "rate_limit_exceeded"
